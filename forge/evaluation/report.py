"""`eval.json`: what `forge eval` measured (every sample's reward and the figures), written once, read by `compare`.

    {"schema": "openforge.eval/1", "run_id": "eval-…", "tasks_file": …, "samples_per_task": N, "k": [1, 3],
     "store": …, "policy": {…}, "wall_s": …,
     "tasks": [{"task_id": …, "success_threshold": 1.0, "n": …, "successes": …, "mean_reward": …, "pass@1": …,
                "pass@k": {"1": …, "3": …}, "pass^k": {"1": …, "3": …}, "missing": 0,
                "samples": [{"index": 0, "episode_id": …, "reward": …, "success": …, "status": …, "n_calls": …}]}],
     "overall": {the same figures over the task set, "missing": …, "aggregation": …}}

A figure that cannot be computed (k > n) is null. A sample whose reward never reached the store is listed with
reward null and is not counted in n (``missing``).
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.errors import ForgeError
from forge.evaluation.metrics import Figures, overall_figures, task_figures

SCHEMA = "openforge.eval/1"
AGGREGATION = "n and successes summed; mean_reward over every sample; pass@k and pass^k the mean of the tasks'"


@dataclass
class Sample:
    index: int
    episode_id: str
    reward: float | None  # None: no reward in the store
    success: bool | None = None
    status: str | None = None  # the collector's episode status; None: no call was recorded
    n_calls: int = 0

    def as_json(self) -> dict[str, Any]:
        return {"index": self.index, "episode_id": self.episode_id, "reward": self.reward, "success": self.success,
                "status": self.status, "n_calls": self.n_calls}  # fmt: skip


@dataclass
class TaskResult:
    task_id: str
    success_threshold: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples if s.reward is not None]

    @property
    def successes(self) -> list[bool]:
        return [s.reward >= self.success_threshold for s in self.samples if s.reward is not None]

    @property
    def missing(self) -> int:
        return sum(s.reward is None for s in self.samples)

    def figures(self, ks: list[int]) -> Figures:
        return task_figures(self.rewards, self.success_threshold, ks)


def overall(tasks: list[TaskResult], ks: list[int]) -> Figures:
    return overall_figures([t.figures(ks) for t in tasks], [r for t in tasks for r in t.rewards])


def build(meta: dict[str, Any], tasks: list[TaskResult], ks: list[int]) -> dict[str, Any]:
    """The eval.json document."""
    for task in tasks:
        for sample in task.samples:
            sample.success = None if sample.reward is None else sample.reward >= task.success_threshold
    return {
        "schema": SCHEMA, **meta, "k": sorted(set(ks)),
        "tasks": [
            {"task_id": t.task_id, "success_threshold": t.success_threshold, **t.figures(ks).as_json(),
             "missing": t.missing, "samples": [s.as_json() for s in t.samples]}
            for t in tasks
        ],
        "overall": {**overall(tasks, ks).as_json(), "missing": sum(t.missing for t in tasks),
                    "aggregation": AGGREGATION},
    }  # fmt: skip


def write(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(document, indent=1) + "\n")
    staging.replace(path)


@dataclass
class EvalReport:
    """An eval.json read back: its tasks' samples (the figures are recomputed from them) and what ran."""

    path: Path
    run_id: str
    ks: list[int]
    tasks: list[TaskResult]
    meta: dict[str, Any]


def read(path: Path) -> EvalReport:
    """An eval.json, checked: a file that is not one is a one-line error naming what is wrong."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ForgeError(f"no eval.json at {path}: pass one that `forge eval --out DIR` wrote") from error
    except OSError as error:
        raise ForgeError(f"cannot read {path}: {error.strerror}") from error
    except ValueError as error:
        raise ForgeError(f"{path} is not JSON ({error}): pass an eval.json written by `forge eval`") from error
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise ForgeError(f'{path} is not a `forge eval` result (no "schema": "{SCHEMA}")')
    try:
        tasks = []
        for entry in document["tasks"]:
            threshold = float(entry["success_threshold"])
            samples = [_sample(s) for s in entry["samples"]]
            if any(s.reward is not None and not math.isfinite(s.reward) for s in samples):
                raise ValueError("a reward is not a finite number")
            if not math.isfinite(threshold):
                raise ValueError("a success_threshold is not a finite number")
            tasks.append(TaskResult(str(entry["task_id"]), threshold, samples))
        ks = [int(k) for k in document.get("k", [1])]
    except (KeyError, TypeError, ValueError) as error:
        raise ForgeError(f"{path}: a malformed `forge eval` result ({type(error).__name__}: {error})") from error
    meta = {k: v for k, v in document.items() if k not in ("tasks", "overall")}
    return EvalReport(path, str(document.get("run_id", "?")), ks, tasks, meta)


def _sample(entry: dict[str, Any]) -> Sample:
    reward = entry["reward"]
    return Sample(int(entry["index"]), str(entry["episode_id"]), None if reward is None else float(reward),
                  status=entry.get("status"), n_calls=int(entry.get("n_calls") or 0))  # fmt: skip


def number(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def render_table(header: list[str], rows: list[list[str]], total: list[str] | None = None) -> str:
    """Left-aligned first column, right-aligned numbers, a rule under the header and above the total."""
    every = [header, *rows, *([total] if total else [])]
    widths = [max(len(row[i]) for row in every) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    lines = [line(header), "-" * len(line(header)), *map(line, rows)]
    if total:
        lines += ["-" * len(line(header)), line(total)]
    return "\n".join(lines)


def figures_table(tasks: list[TaskResult], ks: list[int]) -> str:
    """Per task and overall: n, successes, mean reward, pass@1, and pass@k, pass^k for each k > 1."""
    extra = sorted(k for k in set(ks) if k > 1)
    header = ["task", "n", "successes", "threshold", "mean reward", "pass@1"]
    header += [name for k in extra for name in (f"pass@{k}", f"pass^{k}")]

    def row(name: str, figures: Figures, threshold: str, missing: int) -> list[str]:
        n = f"{figures.n}" + (f" (+{missing} missing)" if missing else "")
        cells = [name, n, str(figures.successes), threshold, number(figures.mean_reward), number(figures.pass_at[1])]
        return cells + [number(f[k]) for k in extra for f in (figures.pass_at, figures.pass_hat)]

    rows = [row(t.task_id, t.figures(ks), f"{t.success_threshold:g}", t.missing) for t in tasks]
    total = row("all", overall(tasks, ks), "", sum(t.missing for t in tasks))
    table = render_table(header, rows, total)
    if any(v is None for t in tasks for v in t.figures(ks).pass_at.values()):
        table += "\nn/a: not computable (k > n: fewer samples with a reward than k)"
    return table
