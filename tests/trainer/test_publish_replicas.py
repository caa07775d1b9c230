"""Publishing to several policy replicas: two real vLLM servers (fp32 SmolLM2 on CPU), the trainer's veRL engine,
real sidecars routing over both.

Behaviour, not labels: "serves the new version" is each replica's own sample, teacher-forced under the new
version's checkpoint (and, the control, under the previous one). Order matters, as in a run: the load-balanced
refusal (both servers up), a publish on both, a replica that fails to load (left out, routed around, healed by the
next publish), a replica that cannot read the load folder (it loads the store's copy), a store copy that fails
(every replica relabelled), then a replica killed mid-publish (last: it stays down). Both replicas are on loopback:
each publish of full weights is loaded from the trainer's /dev/shm load folder, and ``served_by`` teacher-forces the
store's copy.
"""

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from bench.trainer_publish import nudge
from forge.errors import ForgeError
from sidecar.policy import PolicyServerClient
from sidecar.replicas import rendezvous
from tests.support.sidecar import SidecarFactory, read_calls, wait_for
from tests.support.sockets import relay
from tests.trainer.recording import sample
from trainer import teacher
from trainer.serve import PolicyServer, default_checkpoint, free_port, start_together

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "Write one short sentence about the sea."}]
POLL_OFTEN = ("--health-seconds", "0.5")  # the sidecar's health poll (and step judgment) twice a second
FP32_BOUND = 2e-4  # |served − teacher-forced| under the checkpoint that served it (fp32 serving measured ~1e-5)


@pytest.fixture(scope="module")
def servers(prepared_model, tmp_path_factory) -> Iterator[list[PolicyServer]]:
    """Two vLLM servers of this module's own (their weights change), started together."""
    started = [PolicyServer(model=default_checkpoint(), port=free_port(), max_model_len=2048,
                            run_dir=tmp_path_factory.mktemp(f"vllm-replica-{n}"), start_timeout=300.0)
               for n in range(2)]  # fmt: skip
    try:
        start_together(started)
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("replicas-store")


@pytest.fixture(scope="module")
def trainer(servers, store):
    from trainer.loop import Trainer, TrainSettings

    url = ",".join(server.base_url for server in servers)
    trainer = Trainer(TrainSettings(store=str(store), policy_url=url, run="r", lr=2e-5))
    root = trainer.load_folder
    yield trainer
    trainer.close()
    assert root is None or not root.exists(), "close() removes the load folder"


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False))


def served_by(server: PolicyServer, prompt: list[int], checkpoint: Path, previous: Path, seed: int) -> None:
    """The replica's own sample is the checkpoint's (teacher forcing, fp32 bound), clearly not the previous one's."""
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        s = sample(http, server.name, prompt, 16, seed=seed)
    base = default_checkpoint("float32")
    gap = teacher.mean_abs_gap(s.logprobs, teacher.logprobs(checkpoint, base, prompt, s.completion))
    old = teacher.mean_abs_gap(s.logprobs, teacher.logprobs(previous, base, prompt, s.completion))
    print(f"{server.base_url} ({s.version}): |served − {checkpoint.name}| {gap:.2e}, |served − previous| {old:.2e}")
    assert gap <= FP32_BOUND and old > 10 * gap and old > FP32_BOUND


def state(server: PolicyServer) -> tuple[str, bool]:
    """(weight version, paused) of a replica."""
    with closing(PolicyServerClient(server.base_url, timeout=60)) as client:
        return str(client.get("/weight_info")["weight_version"]), bool(client.get("/is_paused")["is_paused"])


def checkpoint(store: Path, version: int) -> Path:
    return store / "checkpoints" / "r" / f"v{version}"


def calls_through_sidecar(tmp_path: Path, servers: list[PolicyServer], episodes: list[str], out_of_step: str | None
                          ) -> tuple[list[dict], dict]:  # fmt: skip
    """One chat call per episode through a real sidecar over both replicas, once its health poll has judged them
    (``out_of_step``: the replica it must report out of step; None: every one in step); the records and metrics."""
    urls = [server.base_url for server in servers]
    tmp_path.mkdir(parents=True, exist_ok=True)
    sidecars = SidecarFactory(tmp_path)
    try:
        sidecar = sidecars(",".join(urls), mode=f"reverse:{urls[0]}", episode_id=None, extra=POLL_OFTEN)
        expected = {url: (1 if url == out_of_step else 0) for url in urls}
        metrics = wait_for(
            lambda: (m := sidecar.metrics()) and all(m.get(f'replica_out_of_step{{replica="{u}"}}') == v
                                                     for u, v in expected.items()) and m,
            timeout=30, what=f"the sidecar's step judgment {expected}",
        )  # fmt: skip
        for episode in episodes:
            httpx.post(f"{sidecar.url}/v1/chat/completions", timeout=300, headers={"x-forge-episode-id": episode},
                       json={"model": "gpt-x", "messages": QUESTION, "max_tokens": 8,
                             "temperature": 1.0}).raise_for_status()  # fmt: skip
        calls = wait_for(lambda: (rows := read_calls(sidecar.store)) and len(rows) == len(episodes) and rows,
                         timeout=60, what="the calls' records")  # fmt: skip
        return calls, sidecar.metrics() | {"judged": metrics}
    finally:
        sidecars.stop_all()


class RoundRobin:
    """A TCP load balancer in front of the replicas, as a Service's ClusterIP: each new connection goes to the
    next one."""

    def __init__(self, targets: list[PolicyServer]) -> None:
        self.targets = [(t.host, t.port) for t in targets]
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.turn = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            target = self.targets[self.turn % len(self.targets)]
            self.turn += 1
            try:
                upstream = socket.create_connection(target)
            except OSError:
                client.close()
                continue
            relay(client, upstream)

    def close(self) -> None:
        self.listener.close()


def test_a_load_balanced_url_in_front_of_several_replicas_is_refused_in_one_line(servers, tmp_path):
    balancer = RoundRobin(servers)
    try:
        args = ["train", "--store", str(tmp_path), "--policy-url", f"http://127.0.0.1:{balancer.port}",
                "--wait-timeout", "5"]  # fmt: skip
        result = subprocess.run([sys.executable, "-m", "forge", *args], capture_output=True, text=True, timeout=300,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    finally:
        balancer.close()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("forge:")]
    assert len(lines) == 1 and "load-balanced over several policy servers" in lines[0], result.stderr
    assert all(state(server) == ("default", False) for server in servers)  # nothing was published, nor paused


def test_a_publish_lands_on_every_replica_and_leaves_none_paused(trainer, servers, store, prompt):
    assert all(state(server) == ("0", False) for server in servers)  # v0 (the base) claimed on both at the start
    nudge(trainer.engine)
    result = trainer.publish(1)
    print(result)
    assert result.replicas == [server.base_url for server in servers] and result.left_out == {}
    assert result.path == str(checkpoint(store, 1)) and (checkpoint(store, 1) / "_PUBLISHED.json").is_file()
    for n, server in enumerate(servers):
        assert state(server) == ("1", False)
        served_by(server, prompt, checkpoint(store, 1), previous=default_checkpoint("float32"), seed=n)


def test_a_replica_that_fails_to_load_is_left_out_routed_around_and_healed_by_the_next_publish(
    trainer, servers, store, prompt, tmp_path
):  # fmt: skip
    a, b = servers
    client_b = trainer.replicas.known[b.base_url]
    nudge(trainer.engine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(client_b, "load_full", lambda path: None)  # b keeps v1's weights
        result = trainer.publish(2)
    print(result)
    assert result.replicas == [a.base_url] and list(result.left_out) == [b.base_url]
    assert "did not land" in result.left_out[b.base_url]
    assert state(a) == ("2", False) and state(b) == ("left-out-v2", False)
    served_by(a, prompt, checkpoint(store, 2), previous=checkpoint(store, 1), seed=2)
    served_by(b, prompt, checkpoint(store, 1), previous=checkpoint(store, 2), seed=3)  # still v1's weights
    # The sidecar takes b out of routing: episodes whose own replica is b are served by a, as v2.
    urls = [a.base_url, b.base_url]
    episodes = [e for e in (f"left-{n}" for n in range(200)) if rendezvous(e, urls) == b.base_url][:3]
    calls, metrics = calls_through_sidecar(tmp_path / "left", servers, episodes, out_of_step=b.base_url)
    assert [(c["replica"], c["policy_version"], c["status"]) for c in calls] == [(a.base_url, "2", "ok")] * 3
    assert metrics["replica_out_of_step_total"] >= 1 and metrics[f'replica_up{{replica="{b.base_url}"}}'] == 1
    # The next publish loads b again: both serve v3, and the sidecar routes to b again.
    nudge(trainer.engine)
    result = trainer.publish(3)
    assert result.replicas == urls and result.left_out == {}
    for n, server in enumerate(servers):
        assert state(server) == ("3", False)
        served_by(server, prompt, checkpoint(store, 3), previous=checkpoint(store, 2), seed=4 + n)
    calls, _ = calls_through_sidecar(tmp_path / "healed", servers, episodes[:1], out_of_step=None)
    assert [(c["replica"], c["policy_version"]) for c in calls] == [(b.base_url, "3")]


def test_a_replica_that_cannot_read_the_load_folder_loads_the_stores_copy(trainer, servers, store, prompt):
    """Both replicas listen on loopback: the trainer writes full weights to a private /dev/shm folder for them to
    load and copies them to the store beside the load. Replica b is made to look for them on another machine's file
    system (the path does not exist there): the real vLLM refuses the path and keeps its weights; the trainer loads
    the store's copy there. Both serve v4, no replica left out, and the load folder keeps only v4."""
    root = trainer.load_folder
    assert root is not None and root.parent == Path("/dev/shm") and (root / "v3").is_dir()
    a, b = servers
    client_b = trainer.replicas.known[b.base_url]
    load = client_b.load_full
    asked: list[Path] = []

    def on_another_machine(path: Path) -> None:
        asked.append(path)
        load(Path("/nonexistent-host") / path.relative_to("/") if path.is_relative_to(root) else path)

    nudge(trainer.engine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(client_b, "load_full", on_another_machine)
        result = trainer.publish(4)
    print(result)
    assert result.replicas == [a.base_url, b.base_url] and result.left_out == {}
    assert asked == [root / "v4", checkpoint(store, 4)] and result.path == str(checkpoint(store, 4))
    assert [p.name for p in root.iterdir()] == ["v4"]
    for n, server in enumerate(servers):
        assert state(server) == ("4", False)
        served_by(server, prompt, checkpoint(store, 4), previous=checkpoint(store, 3), seed=8 + n)


def test_a_store_copy_that_fails_relabels_every_replica_that_loaded_it_and_stops_the_run(trainer, servers, store):
    """The replicas load v5 from the load folder while the store's copy fails (a full disk): no sidecar may record
    calls as a version the store does not hold, so every replica is relabelled left out, and the publish fails."""
    from trainer.loop import PublishError

    def full_disk(*args, **kwargs):
        raise ForgeError("cannot write the checkpoint checkpoints/r/v5: [Errno 28] No space left on device")

    nudge(trainer.engine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("trainer.loop.copy_checkpoint", full_disk)
        with pytest.raises(PublishError, match="relabelled left-out-v5"):
            trainer.publish(5)
    assert all(state(server) == ("left-out-v5", False) for server in servers)
    assert not checkpoint(store, 5).exists()


def test_a_replica_killed_mid_publish_leaves_the_others_published_and_routed_to(
    trainer, servers, store, prompt, tmp_path
):  # fmt: skip
    a, b = servers
    client_b = trainer.replicas.known[b.base_url]
    load = client_b.load_full

    def killed_while_loading(path: Path) -> None:
        assert state(a)[1] and state(b)[1], "both replicas are paused before either loads"
        b.stop()
        load(path)

    nudge(trainer.engine)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(client_b, "load_full", killed_while_loading)
        result = trainer.publish(6)
    print(result)
    assert result.replicas == [a.base_url] and list(result.left_out) == [b.base_url]
    assert "unreachable" in result.left_out[b.base_url]
    assert state(a) == ("6", False)
    served_by(a, prompt, checkpoint(store, 6), previous=checkpoint(store, 4), seed=6)
    urls = [a.base_url, b.base_url]
    episodes = [e for e in (f"killed-{n}" for n in range(200)) if rendezvous(e, urls) == b.base_url][:2]
    sidecars = SidecarFactory(tmp_path)
    try:
        sidecar = sidecars(",".join(urls), mode=f"reverse:{urls[0]}", episode_id=None, extra=POLL_OFTEN)
        wait_for(lambda: sidecar.metrics().get(f'replica_up{{replica="{b.base_url}"}}') == 0, timeout=30,
                 what="the killed replica reported down")  # fmt: skip
        for episode in episodes:
            httpx.post(
                f"{sidecar.url}/v1/chat/completions",
                timeout=300,
                headers={"x-forge-episode-id": episode},
                json={"model": "gpt-x", "messages": QUESTION, "max_tokens": 8},
            ).raise_for_status()
        calls = wait_for(lambda: (rows := read_calls(sidecar.store)) and len(rows) == 2 and rows, timeout=60,
                         what="the calls' records")  # fmt: skip
    finally:
        sidecars.stop_all()
    assert [(c["replica"], c["policy_version"], c["status"]) for c in calls] == [(a.base_url, "6", "ok")] * 2
