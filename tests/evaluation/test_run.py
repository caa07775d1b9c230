"""`forge eval` reads its figures back from the store (the collector's views), whatever the rollouts returned."""

from pathlib import Path

import pytest

from bench.collector_generate import SyntheticEpisode, write_calls
from forge.errors import ForgeError
from forge.evaluation import report
from forge.evaluation.run import check_new_run, read_back
from k8s.tasks import Task
from k8s.verify import Verdict, write_reward

RUN = "eval-unit"


def task(name: str, threshold: float = 1.0) -> Task:
    return Task(id=name, command=("true",), verifier=("true",), success_threshold=threshold)


def test_every_planned_sample_is_read_back_from_the_store(tmp_path: Path):
    store = str(tmp_path / "store")
    rows = []
    for episode_id, version in ((f"{RUN}.a.0", "3"), (f"{RUN}.a.1", "3"), (f"{RUN}.b.0", "3")):
        episode = SyntheticEpisode(episode_id, task_id=episode_id.split(".")[1], run_id=RUN, policy_version=version)
        episode.call([1, 2, 3], [4, 5])
        rows += episode.rows
    write_calls(store, rows, run=RUN)
    write_reward(store, None, RUN, f"{RUN}.a.0", Verdict(0.4))
    write_reward(store, None, RUN, f"{RUN}.a.0", Verdict(1.0))  # the latest reward of an episode counts
    write_reward(store, None, RUN, f"{RUN}.a.1", Verdict(0.0))
    write_reward(store, None, RUN, f"{RUN}.b.1", Verdict(0.75))  # a harness that made no call: its reward counts
    # b.0 made a call but got no reward: missing, not a failure.

    results, served = read_back(store, None, RUN, [task("a"), task("b", threshold=0.5)], samples=2)
    a, b = results
    assert [(s.episode_id, s.reward, s.status, s.n_calls) for s in a.samples] == [
        (f"{RUN}.a.0", 1.0, "complete", 1), (f"{RUN}.a.1", 0.0, "complete", 1),
    ]  # fmt: skip
    assert [(s.reward, s.status, s.n_calls) for s in b.samples] == [(None, "no_reward", 1), (0.75, None, 0)]
    assert served["policy_versions"] == {"3": 3}

    document = report.build({"run_id": RUN}, results, [1, 2])
    assert document["tasks"][0] | {"samples": None} == {
        "task_id": "a", "success_threshold": 1.0, "n": 2, "successes": 1, "mean_reward": 0.5, "pass@1": 0.5,
        "pass@k": {"1": 0.5, "2": 1.0}, "pass^k": {"1": 0.5, "2": 0.0}, "missing": 0, "samples": None,
    }  # fmt: skip
    second = document["tasks"][1]
    assert (second["n"], second["successes"], second["missing"], second["pass@k"]["2"]) == (1, 1, 1, None)
    assert document["overall"]["n"] == 3 and document["overall"]["pass@k"]["2"] is None  # k > n for task b
    assert document["tasks"][1]["samples"][1]["success"] is True


def test_a_run_the_store_already_holds_is_refused(tmp_path: Path):
    store = str(tmp_path / "store")
    check_new_run(store, None, RUN)
    write_reward(store, None, RUN, f"{RUN}.a.0", Verdict(1.0))
    with pytest.raises(ForgeError, match=f"already holds rewards of run {RUN}"):
        check_new_run(store, None, RUN)
