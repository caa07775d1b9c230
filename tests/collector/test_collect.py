"""Incremental collection: only new files are read, the episodes they touch rebuilt, and the result equals a full
rebuild; hidden (in-flight) files are never read; collecting beside a writing sidecar store is safe."""

import itertools
import os
import random
import threading
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import collector.collect as collect_module
from bench.collector_generate import SyntheticEpisode, write_calls, write_rewards
from collector.collect import collect, shard_of
from forge.errors import ForgeError
from tests.collector.conftest import linear_calls


def full_rebuild(store: str, tmp_path: Path, name: str):
    return collect(store, state_dir=tmp_path / name, rebuild=True, idle_seconds=0)


def assert_same(a, b) -> None:
    assert a.segments.equals(b.segments)
    assert a.episodes.equals(b.episodes)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the store files (not the state's) the collector opens."""
    seen: list[str] = []
    real = pq.read_table

    def read_table(source, *args, **kwargs):
        if "/store/" in str(source):
            seen.append(os.path.basename(str(source)))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(collect_module.pq, "read_table", read_table)
    return seen


def test_a_second_run_reads_only_new_files_and_equals_a_full_rebuild(tmp_path, reads):
    store = str(tmp_path / "store")
    a, b = SyntheticEpisode("a"), SyntheticEpisode("b")
    linear_calls(a, 4)
    linear_calls(b, 3, base=50_000)
    write_calls(store, a.rows[:2] + b.rows, name="s1-calls-0")
    state = tmp_path / "state"
    first = collect(store, state_dir=state, idle_seconds=0)
    assert first.files_read == 1 and {r["episode_id"]: r["n_calls"] for r in first.episodes.to_pylist()} == {
        "a": 2, "b": 3,
    }  # fmt: skip

    write_calls(store, a.rows[2:], name="s1-calls-1")  # the rest of a
    write_rewards(store, [{"episode_id": "a", "reward": 1.0}])
    reads.clear()
    second = collect(store, state_dir=state, idle_seconds=0)
    # the two new files, and the old file again for a's first calls only (b is kept as it was)
    assert sorted(reads) == ["s1-calls-0.parquet", "s1-calls-1.parquet", "synthetic-rewards-0.parquet"]
    assert (second.files_read, second.episodes_rebuilt) == (2, 1)
    assert_same(second, full_rebuild(store, tmp_path, "full-1"))
    a_row = next(r for r in second.episodes.to_pylist() if r["episode_id"] == "a")
    assert (a_row["n_calls"], a_row["n_segments"], a_row["status"]) == (4, 1, "complete")

    reads.clear()
    third = collect(store, state_dir=state, idle_seconds=0)
    assert reads == [] and third.files_read == 0
    assert_same(third, second)


def test_replaced_and_removed_files_rebuild_their_episodes_and_hidden_files_are_skipped(tmp_path, reads):
    store = str(tmp_path / "store")
    a, b = SyntheticEpisode("a"), SyntheticEpisode("b")
    linear_calls(a, 3)
    linear_calls(b, 2, base=50_000)
    write_calls(store, a.rows[:2], name="s1-calls-0")
    write_calls(store, b.rows, name="s1-calls-1")
    state = tmp_path / "state"
    collect(store, state_dir=state, idle_seconds=0)

    # A WAL replay rewrites a segment file under its own name, with one more row.
    write_calls(store, a.rows, name="s1-calls-0")
    folder = Path(store) / "calls" / "run=run-1" / "date=2026-01-05"
    (folder / ".s1-calls-2.parquet.0123.tmp").write_bytes(b"PAR1 half written")
    (folder / ".s1-calls-3.parquet").write_bytes(b"not even parquet")
    reads.clear()
    replaced = collect(store, state_dir=state, idle_seconds=0)
    assert not any(name.startswith(".") for name in reads)
    assert {r["episode_id"]: r["n_calls"] for r in replaced.episodes.to_pylist()} == {"a": 3, "b": 2}
    assert_same(replaced, full_rebuild(store, tmp_path, "full-1"))

    os.unlink(folder / "s1-calls-1.parquet")
    removed = collect(store, state_dir=state, idle_seconds=0)
    assert removed.episodes["episode_id"].to_pylist() == ["a"]
    assert_same(removed, full_rebuild(store, tmp_path, "full-2"))


def test_collecting_while_a_sidecar_keeps_writing_ends_equal_to_a_full_rebuild(tmp_path):
    store = str(tmp_path / "store")
    episodes = [SyntheticEpisode(f"e{i}") for i in range(6)]
    for i, episode in enumerate(episodes):
        linear_calls(episode, 6, base=1000 * i)
    batches = [[e.rows[t] for e in episodes] for t in range(6)]  # one file per turn, every episode in each
    write_calls(store, batches[0], name="w-calls-0")
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for n, rows in enumerate(batches[1:], start=1):
                write_calls(store, rows, name=f"w-calls-{n}")
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=writer)
    thread.start()
    state = tmp_path / "state"
    while thread.is_alive():
        collect(store, state_dir=state, idle_seconds=0)
    thread.join()
    assert not errors
    final = collect(store, state_dir=state, idle_seconds=0)
    assert_same(final, full_rebuild(store, tmp_path, "full"))
    assert final.episodes["n_calls"].to_pylist() == [6] * 6
    assert final.segments["n_calls"].to_pylist() == [6] * 6


def test_an_old_state_is_rebuilt_not_trusted(tmp_path, synthetic_store):
    state = tmp_path / "state"
    first = collect(synthetic_store.uri, state_dir=state, idle_seconds=0)
    table = pq.read_table(state / "manifest.parquet")
    pq.write_table(table.replace_schema_metadata({"openforge.state_version": "0"}), state / "manifest.parquet")
    again = collect(synthetic_store.uri, state_dir=state, idle_seconds=0)
    assert again.files_read == 5
    assert_same(first, again)


def test_assembly_in_batches_of_episodes_equals_one_batch(tmp_path, synthetic_store, monkeypatch):
    whole = full_rebuild(synthetic_store.uri, tmp_path, "whole")
    monkeypatch.setattr(collect_module, "ASSEMBLY_BATCH_CALLS", 3)  # episodes of 2 to 4 calls: 3 batches
    batches: list[int] = []
    real = collect_module.assemble

    def counted(calls, rewards, episode_order=None):
        batches.append(calls.num_rows)
        return real(calls, rewards, episode_order)

    monkeypatch.setattr(collect_module, "assemble", counted)
    batched = full_rebuild(synthetic_store.uri, tmp_path, "batched")
    assert_same(batched, whole)
    # Episodes of 2 to 4 calls, cut once a batch holds 3 calls or more: never one batch, never a split episode.
    assert len(batches) >= 3 and sum(batches) == 11 and all(n <= 3 + 3 for n in batches)


def _episodes_for_arrival() -> list[SyntheticEpisode]:
    """Six episodes of varied shape: linear, compacted, retried, truncated (error), with and without parents."""
    episodes = []
    for i in range(6):
        episode = SyntheticEpisode(f"ep-{i}", task_id=f"t{i % 2}", run_id=f"run-{i % 2}", parents=i != 3)
        last = linear_calls(episode, 3 + i % 3, base=10_000 * i)
        if i == 1:  # a compaction: a second segment
            linear_calls(episode, 2, base=10_000 * i + 5000, prompt=[*last[:40], 7, 7, 7])
        if i == 2:  # a retry of the last prompt
            episode.call(last[: episode.rows[-1]["prompt_len"]], [1, 2])
        if i == 4:
            episode.call([*last, 5, 5], [9], status="truncated", error="client hung up")
        episodes.append(episode)
    return episodes


@pytest.mark.parametrize("seed", range(12))
def test_incremental_equals_a_full_rebuild_whatever_order_files_arrive_in(tmp_path, monkeypatch, seed):
    """A property over random arrival orders: files of random slices of the calls and rewards land in a random
    order (some replaced by a longer version, as a WAL replay does, some removed); collecting after any prefix
    of arrivals equals a full rebuild of what is there. Three shards, so shards hold several episodes."""
    monkeypatch.setattr(collect_module, "SHARDS", 3)
    rng = random.Random(seed)
    store, state = str(tmp_path / "store"), tmp_path / "state"
    rows = [row for episode in _episodes_for_arrival() for row in episode.rows]
    rng.shuffle(rows)
    cuts = sorted(rng.sample(range(1, len(rows)), 5))
    files = [rows[a:b] for a, b in itertools.pairwise([0, *cuts, len(rows)])]
    arrivals: list[tuple[str, Any]] = [("calls", (n, part)) for n, part in enumerate(files)]
    arrivals += [("rewards", (n, [{"episode_id": f"ep-{i}", "reward": float(i + n)}])) for n, i in
                 enumerate(rng.sample(range(6), 4))]  # fmt: skip
    rng.shuffle(arrivals)
    written: list[str] = []
    for step, (kind, (n, part)) in enumerate(arrivals):
        if kind == "calls":
            run = part[0]["run_id"]
            written.append(write_calls(store, [r for r in part if r["run_id"] == run], name=f"s-calls-{n}", run=run))
            if len({r["run_id"] for r in part}) > 1:  # the other run's rows in its own partition, as sidecars write
                other = next(r["run_id"] for r in part if r["run_id"] != run)
                written.append(write_calls(store, [r for r in part if r["run_id"] == other], name=f"s-calls-{n}",
                                           run=other))  # fmt: skip
        else:
            written.append(write_rewards(store, part, name=f"s-rewards-{n}"))
        if rng.random() < 0.2 and len(written) > 1:  # a file removed (an operator cleaning up)
            os.unlink(written.pop(rng.randrange(len(written) - 1)))
        if rng.random() < 0.6 or step == len(arrivals) - 1:
            incremental = collect(store, state_dir=state, idle_seconds=0)
            assert_same(incremental, full_rebuild(store, tmp_path, f"full-{step}"))
    assert incremental.episodes.num_rows >= 1


def test_an_update_rewrites_only_the_shards_of_the_episodes_it_touches(tmp_path, monkeypatch):
    store, state = str(tmp_path / "store"), tmp_path / "state"
    episodes = [SyntheticEpisode(f"e{i}") for i in range(40)]
    for i, episode in enumerate(episodes):
        linear_calls(episode, 2, base=1000 * i)
    write_calls(store, [row for e in episodes for row in e.rows], name="s-calls-0")
    collect(store, state_dir=state, idle_seconds=0)
    assert len(list((state / "shards").glob("segments-*.parquet"))) == len(
        set(shard_of(e.episode_id for e in episodes))
    )
    writes: list[str] = []
    real = collect_module._write_atomic

    def spy(table, target):
        writes.append(target.name)
        return real(table, target)

    monkeypatch.setattr(collect_module, "_write_atomic", spy)
    late = SyntheticEpisode("late")
    linear_calls(late, 3, base=90_000)
    write_calls(store, late.rows[:2], name="s-calls-1")
    write_calls(store, late.rows[2:], name="s-calls-2")
    write_rewards(store, [{"episode_id": "late", "reward": 1.0}])
    updated = collect(store, state_dir=state, idle_seconds=0)
    (shard,) = shard_of(["late"])
    assert sorted(writes) == sorted([f"segments-{shard:03d}.parquet", f"episodes-{shard:03d}.parquet",
                                     "manifest.parquet"])  # fmt: skip
    assert (updated.files_read, updated.episodes_rebuilt) == (3, 1)
    assert_same(updated, full_rebuild(store, tmp_path, "full"))


def test_a_run_stopped_between_shards_and_manifest_is_redone_even_if_its_file_is_gone(tmp_path, monkeypatch):
    store, state = str(tmp_path / "store"), tmp_path / "state"
    a, b = SyntheticEpisode("a"), SyntheticEpisode("b")
    linear_calls(a, 4)
    linear_calls(b, 2, base=50_000)
    write_calls(store, a.rows[:2] + b.rows, name="s-calls-0")
    collect(store, state_dir=state, idle_seconds=0)
    late = write_calls(store, a.rows[2:], name="s-calls-1")
    real = collect_module._write_atomic

    def stop_at_the_manifest(table, target):
        if target.name == "manifest.parquet":
            raise KeyboardInterrupt  # the process stopped here: a's shard holds calls of a file not in the manifest
        return real(table, target)

    monkeypatch.setattr(collect_module, "_write_atomic", stop_at_the_manifest)
    with pytest.raises(KeyboardInterrupt):
        collect(store, state_dir=state, idle_seconds=0)
    monkeypatch.setattr(collect_module, "_write_atomic", real)
    os.unlink(late)  # and the file it had read is gone before the next run
    again = collect(store, state_dir=state, idle_seconds=0)
    assert {r["episode_id"]: r["n_calls"] for r in again.episodes.to_pylist()} == {"a": 2, "b": 2}
    assert_same(again, full_rebuild(store, tmp_path, "full"))
    assert not (state / "pending.json").exists()


def test_a_run_scoped_collect_lists_only_that_runs_partitions_and_keeps_the_others(tmp_path, monkeypatch):
    store, state = str(tmp_path / "store"), tmp_path / "state"
    a, b = SyntheticEpisode("a", run_id="run-a"), SyntheticEpisode("b", run_id="run-b")
    linear_calls(a, 3)
    linear_calls(b, 3, base=50_000)
    write_calls(store, a.rows[:2], name="s-calls-0", run="run-a")
    write_calls(store, b.rows[:2], name="s-calls-0", run="run-b")
    collect(store, state_dir=state, idle_seconds=0)
    write_calls(store, a.rows[2:], name="s-calls-1", run="run-a")
    write_calls(store, b.rows[2:], name="s-calls-1", run="run-b")
    listed: list[str] = []
    real = collect_module.pafs.FileSelector

    def selector(base_dir, *args, **kwargs):
        listed.append(base_dir[len(str(tmp_path / "store")) :])
        return real(base_dir, *args, **kwargs)

    monkeypatch.setattr(collect_module.pafs, "FileSelector", selector)
    scoped = collect(store, state_dir=state, idle_seconds=0, run="run-a")
    assert listed == ["/calls/run=run-a", "/rewards/run=run-a"]
    assert scoped.files_read == 1  # run-b's new file is not seen, and run-b's episode is kept as it was
    assert {r["episode_id"]: r["n_calls"] for r in scoped.episodes.to_pylist()} == {"a": 3, "b": 2}
    everything = collect(store, state_dir=state, idle_seconds=0)
    assert everything.files_read == 1
    assert_same(everything, full_rebuild(store, tmp_path, "full"))
    with pytest.raises(ForgeError, match="one path segment"):
        collect(store, state_dir=state, run="../x")


def test_files_from_before_policy_version_end_and_after_it_collect_together(tmp_path):
    """A store holding records of the previous release (no policy_version_end column) and of this one."""
    store = str(tmp_path / "store")
    episode = SyntheticEpisode("ep", task_id="t", run_id="r", policy_version="5")
    linear_calls(episode, 4)
    old = write_calls(store, episode.rows[:2], name="old-calls-0", run="r")
    table = pq.read_table(old).drop_columns(["policy_version_end"])
    pq.write_table(table, old)  # as the previous release wrote it
    for row in episode.rows[2:]:
        row["policy_version_end"] = "6"
    write_calls(store, episode.rows[2:], name="new-calls-0", run="r")
    write_rewards(store, [{"episode_id": "ep", "reward": 1.0}], run="r")
    result = collect(store, state_dir=tmp_path / "state", idle_seconds=0)
    [row] = result.episodes.to_pylist()
    assert (row["n_calls"], row["policy_version_min"], row["policy_version_max"]) == (4, "5", "6")
