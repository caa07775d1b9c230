"""A store of synthetic episodes of known structure, written as the sidecar writes its files."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.collector_generate import SyntheticEpisode, write_calls, write_rewards

SYSTEM = list(range(1000, 1032))


def turn_ids(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def linear_calls(episode: SyntheticEpisode, turns: int, base: int = 0, prompt: list[int] | None = None) -> list[int]:
    """Linear turns; returns the whole last sequence (prompt + completion)."""
    prompt = list(prompt or SYSTEM + turn_ids(base + 100, 8))
    for turn in range(turns):
        completion = turn_ids(base + 5000 + 100 * turn, 6)
        episode.call(prompt, completion)
        prompt = prompt + completion + turn_ids(base + 200 + 10 * turn, 4)
    return prompt[:-4]


@dataclass
class SyntheticStore:
    path: Path
    episodes: dict[str, SyntheticEpisode]

    @property
    def uri(self) -> str:
        return str(self.path)


def build_episodes() -> dict[str, SyntheticEpisode]:
    """linear (1 segment, complete), compacted (2 segments, complete), broken (truncated: error), pending."""
    linear = SyntheticEpisode("linear", task_id="t1", run_id="run-a")
    linear_calls(linear, 3)
    compacted = SyntheticEpisode("compacted", task_id="t1", run_id="run-a")
    linear_calls(compacted, 2, base=10_000)
    linear_calls(compacted, 2, base=20_000, prompt=SYSTEM + turn_ids(29_000, 10))
    broken = SyntheticEpisode("broken", task_id="t2", run_id="run-b", harness="codex")
    last = linear_calls(broken, 1, base=30_000)
    broken.call(last + turn_ids(31_000, 3), turn_ids(32_000, 2), status="truncated", error="client hung up")
    pending = SyntheticEpisode("pending", task_id="t2", run_id="run-b", harness="codex")
    linear_calls(pending, 2, base=40_000)
    return {e.episode_id: e for e in (linear, compacted, broken, pending)}


REWARDS = [{"episode_id": "linear", "reward": 1.0}, {"episode_id": "compacted", "reward": 0.0},
           {"episode_id": "broken", "reward": 1.0}]  # fmt: skip


def write_store(path: Path, episodes: dict[str, SyntheticEpisode], store: str | None = None) -> None:
    """Two call files per run (first and second half of every episode) and one reward file."""
    target = store or str(path)
    for run in ("run-a", "run-b"):
        runs = [e for e in episodes.values() if e.run_id == run]
        first = [row for e in runs for row in e.rows[: len(e.rows) // 2]]
        second = [row for e in runs for row in e.rows[len(e.rows) // 2 :]]
        write_calls(target, first, name=f"sidecar-x-calls-{run}-0", run=run)
        write_calls(target, second, name=f"sidecar-x-calls-{run}-1", run=run)
    write_rewards(target, REWARDS)


@pytest.fixture
def synthetic_store(tmp_path: Path) -> SyntheticStore:
    episodes = build_episodes()
    path = tmp_path / "store"
    write_store(path, episodes)
    return SyntheticStore(path, episodes)
