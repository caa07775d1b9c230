"""The load folder of a publish (trainer.publish.load_root): full weights written where the policy servers load them
(tmpfs when they share this machine), copied to the store beside the load, byte for byte, the store's copy loaded
by a replica that cannot read the load folder. The publish itself, against real vLLM servers, is in
test_publish_replicas.py (the auto folder there: both replicas on loopback)."""

import os
import stat
from concurrent.futures import Future
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from forge.errors import ForgeError
from sidecar.store import open_store
from trainer.loop import Trainer
from trainer.publish import PublishError, copy_checkpoint, load_root, stage_checkpoint

LOOPBACK = ["http://127.0.0.1:8000", "http://localhost:8001"]


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm here")
def test_auto_is_a_fresh_folder_of_our_own_on_tmpfs_only_when_every_replica_is_on_loopback(tmp_path):
    assert load_root("store", LOOPBACK, 1) is None
    assert load_root("auto", [*LOOPBACK, "http://10.0.0.7:8000"], 1) is None  # one replica elsewhere
    assert load_root("auto", LOOPBACK, 10**15) is None  # no room for two checkpoints
    first, second = load_root("auto", LOOPBACK, 1), load_root("auto", LOOPBACK, 1)
    try:
        assert first and second and first != second and first.parent == second.parent == Path("/dev/shm")
        assert stat.S_IMODE(first.stat().st_mode) == 0o755 and first.stat().st_uid == os.getuid()
    finally:
        for folder in (first, second):
            if folder:
                folder.rmdir()
    named = load_root(str(tmp_path / "mine"), ["http://10.0.0.7:8000"], 1)  # a folder: whatever the replicas
    assert named and named.parent == tmp_path / "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(ForgeError, match="--load-dir"):
        load_root(str(tmp_path / "file" / "sub"), LOOPBACK, 1)


def test_a_named_folder_another_user_could_swap_our_folder_in_is_refused(tmp_path):
    """--load-dir's parent: writable by others and not sticky (they could rename our folder and put theirs in its
    place, which the servers would load and the store copy), or a link: refused. Sticky (as /tmp): kept."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ForgeError, match="another user could replace"):
        load_root(str(shared), LOOPBACK, 1)
    shared.chmod(0o1777)
    assert load_root(str(shared), LOOPBACK, 1)
    (tmp_path / "link").symlink_to(tmp_path / "mine", target_is_directory=True)
    (tmp_path / "mine").mkdir()
    with pytest.raises(ForgeError, match="another user could replace"):
        load_root(str(tmp_path / "link"), LOOPBACK, 1)


def staged(tmp_path: Path) -> Path:
    """A full-weights checkpoint staged in a load folder: the weights, the base model's config beside them."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    (base / "model.safetensors").write_bytes(b"base weights: not copied")
    folder = tmp_path / "load" / "v3"

    def save(staging: Path) -> None:
        (staging / "model.safetensors").write_bytes(os.urandom(1 << 20))

    stage_checkpoint(folder, "r", 3, save, base, "v3 to the load folder")
    return folder


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != "_PUBLISHED.json"}


def test_the_store_gets_the_load_folders_checkpoint_byte_for_byte_marker_last(tmp_path):
    source = staged(tmp_path)
    assert set(files(source)) == {"model.safetensors", "config.json"}
    store = open_store(str(tmp_path / "store"))
    final = copy_checkpoint(store, "r", 3, source)
    assert final == tmp_path / "store" / "checkpoints" / "r" / "v3"
    assert files(final) == files(source) and (final / "_PUBLISHED.json").is_file()
    assert [p.name for p in final.parent.iterdir()] == ["v3"]  # no staging folder left
    assert files(source)  # the load folder is the servers': untouched


def test_an_object_store_gets_it_too_with_a_local_copy_a_replica_can_load(tmp_path, s3_server):
    source = staged(tmp_path)
    store = open_store(f"s3://{s3_server.bucket}/run", s3_server.endpoint)
    local = copy_checkpoint(store, "r", 3, source, tmp_path / "state")
    assert local == tmp_path / "state" / "forge-checkpoints" / "checkpoints" / "r" / "v3"
    assert files(local) == files(source)
    infos = store.filesystem.get_file_info(pafs.FileSelector(store.path("checkpoints/r/v3")))
    assert sorted(Path(i.path).name for i in infos) == ["_PUBLISHED.json", "config.json", "model.safetensors"]
    with store.filesystem.open_input_stream(store.path("checkpoints/r/v3/model.safetensors")) as stream:
        assert stream.read() == (source / "model.safetensors").read_bytes()


class Replica:
    """A policy client that, like vLLM, refuses a path it cannot read (HTTP 500) and loads one it can."""

    def __init__(self, readable: Path | None) -> None:
        self.base_url = "http://replica"
        self.readable = readable
        self.loaded: list[Path] = []

    def load_full(self, path: Path) -> None:
        if self.readable is None:
            raise PublishError("the policy server at http://replica is unreachable (reload_weights): timed out")
        if not str(path).startswith(str(self.readable)):
            raise PublishError("the policy server refused reload_weights: HTTP 500 Repo id must be in the form ...",
                               status=500)  # fmt: skip
        self.loaded.append(path)


class Said:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def echo(self, line: str) -> None:
        self.lines.append(line)


def test_a_replica_that_cannot_read_the_load_folder_loads_the_stores_copy(tmp_path):
    stored: Future = Future()
    stored.set_result(tmp_path / "store" / "v3")
    replica, trainer = Replica(readable=tmp_path / "store"), Said()
    Trainer._load_full(trainer, replica, tmp_path / "shm" / "v3", stored)  # type: ignore[arg-type]
    assert replica.loaded == [tmp_path / "store" / "v3"] and "store's copy" in trainer.lines[0]
    same_machine = Replica(readable=tmp_path)
    Trainer._load_full(trainer, same_machine, tmp_path / "shm" / "v3", stored)  # type: ignore[arg-type]
    assert same_machine.loaded == [tmp_path / "shm" / "v3"] and len(trainer.lines) == 1
    with pytest.raises(PublishError, match="HTTP 500"):  # no load folder: the store's copy was the one refused
        Trainer._load_full(trainer, Replica(readable=tmp_path / "nowhere"), tmp_path / "store" / "v3", None)  # type: ignore[arg-type]
    down = Replica(readable=None)  # unreachable or timed out: not asked again (it is left out)
    with pytest.raises(PublishError, match="unreachable"):
        Trainer._load_full(trainer, down, tmp_path / "shm" / "v3", stored)  # type: ignore[arg-type]
    assert down.loaded == [] and len(trainer.lines) == 1


def test_the_load_folders_of_dead_trainers_are_swept_and_no_other(tmp_path):
    """kill -9 leaves a trainer's load folder (a checkpoint in RAM until reboot): the next trainer removes those
    named for a pid that no longer runs, and nothing else."""
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"openforge-load-{dead.pid}-abc", f"openforge-load-{os.getppid()}-abc", f"openforge-load-{os.getpid()}-x",
             "openforge-load-notapid-abc", "openforge-load-99999999999999999999999-abc", "someone-else"]  # fmt: skip
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / f"openforge-load-{dead.pid}-link").symlink_to(tmp_path / "someone-else")
    swept = load_root(str(tmp_path), LOOPBACK, 1)
    assert swept is not None and swept.name.startswith(f"openforge-load-{os.getpid()}-")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([*names[1:], f"openforge-load-{dead.pid}-link", swept.name])
