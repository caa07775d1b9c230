"""Incremental collection: only new files are read, the episodes they touch rebuilt, and the result equals a full
rebuild; hidden (in-flight) files are never read; collecting beside a writing sidecar store is safe."""

import os
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import collector.collect as collect_module
from bench.collector_generate import SyntheticEpisode, write_calls, write_rewards
from collector.collect import collect
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

    def counted(calls, rewards):
        batches.append(calls.num_rows)
        return real(calls, rewards)

    monkeypatch.setattr(collect_module, "assemble", counted)
    batched = full_rebuild(synthetic_store.uri, tmp_path, "batched")
    assert_same(batched, whole)
    assert batches == [6, 3, 2]  # broken + compacted, linear, pending
