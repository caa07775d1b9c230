"""Synthetic call records in the sidecar's schema, for the collector's tests and its benchmark.

``SyntheticEpisode`` records calls the way the sidecar does: each prompt is split against the episode's recent
calls with the sidecar's own ``PrefixIndex`` (parent call + prefix length + suffix), and only ok calls with a
completion are remembered. ``write_bench_store`` writes a large store fast (numpy, no per-token Python): agent
episodes of linear turns with a compaction now and then, stored as the sidecar stores them.

    .venv/bin/python bench/collector_generate.py --calls 100000 --episodes 2000 --prompt-tokens 4000 --out DIR
"""

import argparse
import time
from array import array
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sidecar.prefix import PrefixIndex
from sidecar.record import CALL_SCHEMA, SCHEMA_VERSION, reward_row, to_table
from sidecar.store import open_store

T0_US = int(datetime(2026, 1, 5, 12, 0, tzinfo=UTC).timestamp() * 1e6)


def lp_for(ids: list[int]) -> list[float]:
    """A distinct, reproducible logprob per sampled token (so alignment errors show)."""
    return [-((i % 97) + 1) / 100.0 - (t % 13) / 1000.0 for i, t in enumerate(ids)]


class SyntheticEpisode:
    """Calls of one episode, recorded as the sidecar records them."""

    def __init__(
        self, episode_id: str, task_id: str | None = "task-1", run_id: str = "run-1", policy_version: str = "0",
        index: PrefixIndex | None = None, parents: bool = True, harness: str = "openai-python", t0_us: int = T0_US,
    ) -> None:  # fmt: skip
        self.episode_id, self.task_id, self.run_id = episode_id, task_id, run_id
        self.policy_version, self.harness = policy_version, harness
        self.index = index or PrefixIndex()
        self.parents = parents
        self.rows: list[dict[str, Any]] = []
        self.t_us = t0_us

    def call(
        self, prompt: list[int] | None, completion: list[int] | None, status: str = "ok",
        logprobs: list[float] | None = None, policy_version: str | None = None, error: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        seq = len(self.rows)
        call_id = f"{self.episode_id}-c{seq:03d}"
        parent, prefix_len = None, 0
        if prompt is not None:
            packed = array("i", prompt).tobytes()
            if self.parents:
                parent, prefix_len = self.index.split(self.episode_id, packed)
            if status == "ok" and completion:
                self.index.remember(self.episode_id, call_id, packed + array("i", completion).tobytes())
        self.t_us += 1_000_000
        row = {
            "call_id": call_id, "episode_id": self.episode_id, "task_id": self.task_id, "run_id": self.run_id,
            "seq": seq, "api": "chat", "stream": False, "policy_version": policy_version or self.policy_version,
            "started_at": datetime.fromtimestamp(self.t_us / 1e6, UTC),
            "finished_at": datetime.fromtimestamp((self.t_us + 500_000) / 1e6, UTC), "status": status,
            "error": error, "parent_call_id": parent, "prefix_len": prefix_len,
            "prompt_suffix_ids": prompt[prefix_len:] if prompt is not None else None,
            "prompt_len": len(prompt) if prompt is not None else None, "completion_token_ids": completion,
            "completion_logprobs": (logprobs if logprobs is not None else lp_for(completion)) if completion else None,
            "harness": self.harness, "sidecar_id": "synthetic",
        }  # fmt: skip
        self.rows.append(row)
        return row


def write_calls(store: str, rows: list[dict[str, Any]], name: str = "synthetic-calls-0", run: str = "run-1") -> str:
    """Rows as one calls file laid out as the sidecar lays it out."""
    return open_store(store).write_parquet(f"calls/run={run}/date=2026-01-05/{name}.parquet", to_table(rows, "calls"))


def write_rewards(store: str, rows: list[dict[str, Any]], name: str = "synthetic-rewards-0", run: str = "run-1") -> str:
    at = T0_US + 3600 * 10**6
    table = to_table([reward_row(**{"at": at, "source": "test", **row}) for row in rows], "rewards")
    return open_store(store).write_parquet(f"rewards/run={run}/date=2026-01-05/{name}.parquet", table)


def _list_array(lengths: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, value_type))


def _bench_chunk(
    rng: np.random.Generator, first_episode: int, episodes: int, turns: int, prompt_tokens: int, compaction_every: int
) -> tuple[pa.Table, np.ndarray]:
    """The calls of ``episodes`` episodes (rows episode by episode) and each row's turn."""
    first = prompt_tokens // 2
    step = max((prompt_tokens - first) * 2 // max(turns - 1, 1), 2)  # completion + next suffix, per turn
    completion_len = step // 2
    n = turns * episodes
    episode_of = np.repeat(np.arange(first_episode, first_episode + episodes), turns)
    turn = np.tile(np.arange(turns), episodes)
    compaction = (turn > 0) & (turn % compaction_every == 0)
    # Prompt length and parent reference as the sidecar writes them: a turn's prefix is the whole previous
    # sequence; a compaction keeps the system prompt (half the first prompt) and rewrites the rest.
    prompt_len = first + turn * step
    completion_lens = np.full(n, completion_len)
    prefix_len = np.where(turn == 0, 0, np.where(compaction, first // 2, prompt_len - (step - completion_len)))
    suffix_len = prompt_len - prefix_len
    call_ids = np.array([f"e{e:06d}-c{t:04d}" for e, t in zip(episode_of, turn, strict=True)], dtype=object)
    parents = np.roll(call_ids, 1)
    parents[turn == 0] = None
    suffix_values = rng.integers(0, 49152, int(suffix_len.sum()), dtype=np.int32)
    completion_values = rng.integers(0, 49152, int(completion_lens.sum()), dtype=np.int32)
    logprob_values = -rng.random(int(completion_lens.sum()), dtype=np.float32)
    at = T0_US + (turn.astype(np.int64) * 2_000_000) + episode_of.astype(np.int64) * 1000
    table = pa.table(
        {
            "schema_version": pa.array(np.full(n, SCHEMA_VERSION, np.int16)),
            "call_id": pa.array(call_ids, pa.string()),
            "episode_id": pa.array([f"e{e:06d}" for e in episode_of], pa.string()),
            "task_id": pa.array([f"task-{e % 50}" for e in episode_of], pa.string()),
            "run_id": pa.array(["bench"] * n, pa.string()),
            "seq": pa.array(turn, pa.int32()),
            "policy_version": pa.array(["0"] * n, pa.string()),
            "started_at": pa.array(at, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            "finished_at": pa.array(at + 1_000_000, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
            "status": pa.array(["ok"] * n, pa.string()),
            "parent_call_id": pa.array(parents, pa.string()),
            "prefix_len": pa.array(prefix_len, pa.int32()),
            "prompt_suffix_ids": _list_array(suffix_len, suffix_values, pa.int32()),
            "prompt_len": pa.array(prompt_len, pa.int32()),
            "completion_token_ids": _list_array(completion_lens, completion_values, pa.int32()),
            "completion_logprobs": _list_array(completion_lens, logprob_values, pa.float32()),
            "harness": pa.array(["bench"] * n, pa.string()),
        }
    )
    for f in CALL_SCHEMA:
        if f.name not in table.column_names:
            table = table.append_column(f, pa.nulls(n, f.type))
    return table.select(CALL_SCHEMA.names).cast(CALL_SCHEMA), turn


def write_bench_store(
    out: str, calls: int, episodes: int, prompt_tokens: int, calls_per_file: int = 1000, seed: int = 0,
    compaction_every: int = 25, chunk_episodes: int = 2000,
) -> dict[str, float]:  # fmt: skip
    """Episodes of calls/episodes turns whose prompts average ``prompt_tokens`` tokens.

    The first prompt is half the average; each turn adds a completion and a tool result, so the last prompt is
    1.5x the average. Every ``compaction_every``-th call rewrites history (a new segment). Each file holds
    ``calls_per_file`` calls of many episodes in time order, as sidecars flushing by rows write them. Written
    ``chunk_episodes`` episodes at a time, so a large store needs little memory. Returns what was written.
    """
    rng = np.random.default_rng(seed)
    turns = calls // episodes
    store = open_store(out)
    n_files = stored = whole = 0
    for first_episode in range(0, episodes, chunk_episodes):
        count = min(chunk_episodes, episodes - first_episode)
        table, turn = _bench_chunk(rng, first_episode, count, turns, prompt_tokens, compaction_every)
        stored += pc.sum(pc.list_value_length(table["prompt_suffix_ids"])).as_py()
        stored += pc.sum(pc.list_value_length(table["completion_token_ids"])).as_py()
        whole += pc.sum(table["prompt_len"]).as_py()
        order = np.lexsort((np.repeat(np.arange(count), turns), turn))
        for i in range(0, table.num_rows, calls_per_file):
            part = table.take(pa.array(order[i : i + calls_per_file]))
            store.write_parquet(f"calls/run=bench/date=2026-01-05/bench-calls-{n_files}.parquet", part)
            n_files += 1
    at = T0_US + 86400 * 10**6
    rewards = to_table([reward_row(f"e{e:06d}", float(e % 2), "bench", at=at) for e in range(episodes)], "rewards")
    store.write_parquet("rewards/run=bench/date=2026-01-05/bench-rewards-0.parquet", rewards)
    return {
        "calls": turns * episodes, "episodes": episodes, "files": n_files,
        "mean_prompt_tokens": whole / (turns * episodes), "stored_ids": stored, "whole_prompt_ids": whole,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--episodes", type=int, default=2_000)
    parser.add_argument("--prompt-tokens", type=int, default=4_000)
    parser.add_argument("--calls-per-file", type=int, default=1000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        raise SystemExit(f"{args.out} is not empty")
    start = time.perf_counter()
    written = write_bench_store(args.out, args.calls, args.episodes, args.prompt_tokens, args.calls_per_file)
    print(f"wrote {written} in {time.perf_counter() - start:.1f} s to {args.out}")


if __name__ == "__main__":
    main()
