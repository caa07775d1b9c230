"""`forge eval` reads its figures back from the store (the collector's views), whatever the rollouts returned."""

from pathlib import Path
from typing import ClassVar

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


class FakeServer:
    """Stands in for trainer.serve.PolicyServer: records what it was asked to serve."""

    started: ClassVar[list["FakeServer"]] = []

    def __init__(self, model: Path, port: int, run_dir: Path, served_model_name: str | None = None) -> None:
        self.model, self.served_model_name, self.stopped = model, served_model_name, False
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.name

    def start(self) -> "FakeServer":
        FakeServer.started.append(self)
        return self

    def stop(self) -> None:
        self.stopped = True


class FakeClient:
    calls: ClassVar[list[tuple]] = []

    def __init__(self, base_url: str) -> None:
        pass

    def load_adapter(self, name: str, directory: Path) -> None:
        FakeClient.calls.append(("load_adapter", name, directory))

    def set_version(self, version: int) -> None:
        FakeClient.calls.append(("set_version", version))


def test_a_checkpoint_is_served_as_what_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import json

    import trainer.publish
    import trainer.serve
    from forge.evaluation.run import EvalSettings, checkpoint_kind, serve_policy

    monkeypatch.setattr(trainer.serve, "PolicyServer", FakeServer)
    monkeypatch.setattr(trainer.publish, "PolicyClient", FakeClient)
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    full, lora = tmp_path / "full" / "v5", tmp_path / "lora" / "v2"
    full.mkdir(parents=True)
    (full / "config.json").write_text("{}")
    (full / "_PUBLISHED.json").write_text(json.dumps({"run": "r", "version": 5}))
    lora.mkdir(parents=True)
    (lora / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    (lora / "_PUBLISHED.json").write_text(json.dumps({"run": "r", "version": 2}))
    assert (checkpoint_kind(full), checkpoint_kind(lora)) == ("full", "lora")
    with pytest.raises(ForgeError, match="neither an HF checkpoint"):
        checkpoint_kind(tmp_path)

    def served(checkpoint: Path) -> tuple:
        FakeServer.started.clear()
        FakeClient.calls.clear()
        settings = EvalSettings(tasks_file=tmp_path / "t.jsonl", samples=1, out=tmp_path / "out", checkpoint=checkpoint)
        with serve_policy(settings, echo=lambda _: None) as policy:
            server = FakeServer.started[0]
        assert server.stopped
        return server.model, policy.model, policy.about["version"], FakeClient.calls

    # Full weights: the server's only model; the records name the version the trainer published it as.
    assert served(full) == (full, None, 5, [("set_version", 5)])
    # A LoRA adapter: its base served, the adapter loaded, and the sidecar told to route to it by name.
    assert served(lora) == (base, "forge-eval", 2, [("load_adapter", "forge-eval", lora), ("set_version", 2)])
    # --policy-url: used as is, nothing started.
    settings = EvalSettings(tasks_file=tmp_path / "t.jsonl", samples=1, out=tmp_path / "out",
                            policy_url="http://127.0.0.1:8000/v1/", policy_model="m")  # fmt: skip
    FakeServer.started.clear()
    with serve_policy(settings, echo=lambda _: None) as policy:
        assert (policy.url, policy.model, FakeServer.started) == ("http://127.0.0.1:8000", "m", [])
