"""`forge eval`: each task of a task file N times through its harness on one policy, no training; the rewards read
back from the store; pass@1, pass@k and pass^k per task and overall; `DIR/eval.json`.

The rollouts are `forge demo`'s: `k8s.rollout.run_local` (one regular-mode sidecar in front of the policy server,
each rollout a process in its own folder, its verifier's reward written to the store) on the demo's task format
(`forge.demo.harness.with_harness_env`: $FORGE_DEMO_MINI, $FORGE_DEMO_DIR, $FORGE_DEMO_PYTHON). A harness that crashes
or times out is judged by its verifier like any other rollout: a failure counts, it is not dropped.

The run id starts with `eval-` (`collector.episode.EVALUATION_RUN_PREFIX`): no trainer ever learns from these
episodes. The figures come from the store through the collector's DuckDB views (`rewards`, `episodes`), never
from the rollouts' return values: eval.json says what the store holds.
"""

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from collector.episode import EVALUATION_RUN_PREFIX
from forge.errors import ForgeError
from forge.evaluation import report
from forge.evaluation.report import Sample, TaskResult
from k8s.rollout import RolloutResult, rollouts_for, run_local
from k8s.tasks import Task, load_tasks

# Per episode of the run: its latest episode reward (the `rewards` view, so an episode whose harness made no call
# still counts) and, where calls were recorded, the collector's status and call count.
READ_BACK_SQL = """
WITH r AS (SELECT episode_id, arg_max(reward, "at") AS reward FROM rewards WHERE call_id IS NULL GROUP BY episode_id)
SELECT coalesce(r.episode_id, e.episode_id), r.reward, e.status, coalesce(e.n_calls, 0)
FROM r FULL OUTER JOIN episodes e ON e.episode_id = r.episode_id
"""
SERVED_SQL = """
SELECT coalesce(model_served, '?'), coalesce(policy_version, '?'), count(*) FROM calls_raw GROUP BY ALL ORDER BY ALL
"""


@dataclass
class EvalSettings:
    tasks_file: Path
    samples: int  # rollouts per task
    out: Path  # eval.json, the rollouts' folders, the store by default
    ks: list[int] = field(default_factory=lambda: [1])
    run: str = ""  # the run id (starts with eval-) [default: eval-<time>]
    policy_url: str | None = None  # a running policy server
    checkpoint: Path | None = None  # else: serve this (an HF folder or a LoRA adapter) [default: the base model]
    policy_model: str | None = None  # the served name the sidecar sends the harness's calls to
    store: str | None = None  # default: <out>/store
    s3_endpoint: str | None = None
    concurrency: int = 4
    retries: int = 1  # more attempts for a rollout that got no reward for a reason other than the policy's
    harness: Path | None = None  # mini-swe-agent's `mini` [default: installed when a task uses $FORGE_DEMO_MINI]
    progress: bool = True

    @property
    def store_uri(self) -> str:
        return self.store or str(self.out / "store")


def evaluation_run_id(name: str | None) -> str:
    """The run id: the name given, `eval-` put in front when it lacks it; else eval-<time>."""
    if not name:
        return f"{EVALUATION_RUN_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
    run = name if name.startswith(EVALUATION_RUN_PREFIX) else EVALUATION_RUN_PREFIX + name
    if "/" in run or "." in run or any(c.isspace() for c in run):
        raise ForgeError(f"--run {name!r}: a run id has no '/', '.' or spaces (episode ids are <run>.<task>.<index>)")
    return run


def parse_ks(text: str) -> list[int]:
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        ks = []
    if not ks or ks[0] < 1:
        raise ForgeError(f"--k {text!r}: give a comma-separated list of integers ≥ 1, e.g. 1,3")
    return ks


def run_rollouts(
    tasks: list[Task], settings: EvalSettings, run_id: str, policy_url: str, policy_model: str | None
) -> list[RolloutResult]:
    """`k8s.rollout.run_local` on the policy: its sidecar sends every call to ``policy_model`` (None: the server's
    first model)."""
    return run_local(
        tasks, settings.samples, run_id, settings.out / "rollouts", settings.store_uri, policy_url,
        concurrency=settings.concurrency, retries=settings.retries, s3_endpoint=settings.s3_endpoint,
        progress=settings.progress, harness_must_succeed=False, policy_model=policy_model,
    )  # fmt: skip


@dataclass
class Policy:
    url: str
    model: str | None  # the served name the sidecar must route to; None: the server's first (its only) model
    about: dict[str, Any]  # for eval.json


def checkpoint_kind(folder: Path) -> str:
    """The checkpoint's kind: `full` (an HF folder: config.json) or `lora` (adapter_config.json), else an error."""
    if (folder / "config.json").is_file():
        return "full"
    if (folder / "adapter_config.json").is_file():
        return "lora"
    if not folder.is_dir():
        raise ForgeError(f"--checkpoint {folder}: no such folder")
    raise ForgeError(f"--checkpoint {folder}: neither an HF checkpoint (config.json) nor a LoRA adapter "
                     "(adapter_config.json); a trainer's are in <store>/checkpoints/<run>/v<version>/")  # fmt: skip


def published_version(folder: Path) -> int | None:
    """The version a trainer published this checkpoint as (its _PUBLISHED.json), if it says."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        version = json.loads((folder / "_PUBLISHED.json").read_text()).get("version")
        return int(version) if version is not None else None
    return None


def lora_base(adapter: Path) -> Path:
    """The adapter's base checkpoint: the folder its config names when it is one here, else the embedded default."""
    from trainer.serve import default_checkpoint

    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        named = Path(json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path") or "")
        if (named / "config.json").is_file():
            return named
    return default_checkpoint()


def served_folder(checkpoint: Path | None) -> tuple[str, Path]:
    """(kind, the folder vLLM loads): "base" (no checkpoint: the embedded default), "full" (itself) or "lora" (the
    adapter's base)."""
    from trainer.serve import default_checkpoint

    if checkpoint is None:
        return "base", default_checkpoint()
    kind = checkpoint_kind(checkpoint)
    return kind, checkpoint if kind == "full" else lora_base(checkpoint)


@contextlib.contextmanager
def serve_policy(settings: EvalSettings, echo: Callable[[str], None]) -> Iterator[Policy]:
    """The policy the rollouts run on: --policy-url as is; else a policy server started on --checkpoint (a LoRA
    adapter on its base), or on the embedded base model, and stopped at the end."""
    from trainer.publish import PolicyClient
    from trainer.serve import PolicyServer, free_port

    if settings.policy_url:
        url = settings.policy_url.rstrip("/").removesuffix("/v1")
        yield Policy(url, settings.policy_model, {"url": url})
        return
    checkpoint = settings.checkpoint.absolute() if settings.checkpoint else None
    kind, model = served_folder(checkpoint)
    adapter = (settings.policy_model or "forge-eval") if kind == "lora" else None
    server = PolicyServer(
        model=model, port=free_port(), run_dir=settings.out / "policy-server",
        served_model_name=None if adapter else settings.policy_model,
    )  # fmt: skip
    echo(f"forge eval: starting the policy server (vLLM) on {server.model}"
         + (f" with the adapter {checkpoint}" if adapter else "") + " ...")  # fmt: skip
    server.start()
    try:
        client = PolicyClient(server.base_url)
        if adapter and checkpoint:
            client.load_adapter(adapter, checkpoint)
        version = published_version(checkpoint) if checkpoint else 0
        if version is not None:  # the records then name the version evaluated
            client.set_version(version)
        about = {"url": server.base_url, "checkpoint": str(checkpoint) if checkpoint else None, "kind": kind,
                 "served_model": adapter or server.name, "version": version}  # fmt: skip
        yield Policy(server.base_url, adapter, about)
    finally:
        server.stop()


def check_new_run(store_uri: str, s3_endpoint: str | None, run_id: str) -> None:
    """An evaluation's figures are read back from its run's records: a run id the store already holds is refused."""
    import pyarrow.fs as pafs

    from sidecar.store import StoreError, open_store

    try:
        store = open_store(store_uri, s3_endpoint)
        for table in ("calls", "rewards"):
            if store.filesystem.get_file_info(store.path(f"{table}/run={run_id}")).type != pafs.FileType.NotFound:
                raise ForgeError(f"the store {store_uri} already holds {table} of run {run_id}: pass another --run")
    except (StoreError, OSError) as error:
        raise ForgeError(f"cannot open the store {store_uri}: {error}") from error


def read_back(
    store_uri: str, s3_endpoint: str | None, run_id: str, tasks: list[Task], samples: int
) -> tuple[list[TaskResult], dict[str, dict[str, int]]]:
    """Every planned sample's reward as the store holds it (through the collector), and which model and policy
    version served the run's calls."""
    from collector.sql import connect

    con = connect(store_uri, s3_endpoint, episodes=True, idle_seconds=0.0, run=run_id)
    found = {row[0]: row for row in con.execute(READ_BACK_SQL).fetchall()}
    served: dict[str, dict[str, int]] = {"models_served": {}, "policy_versions": {}}
    for model, version, calls in con.execute(SERVED_SQL).fetchall():
        served["models_served"][model] = served["models_served"].get(model, 0) + int(calls)
        served["policy_versions"][version] = served["policy_versions"].get(version, 0) + int(calls)
    results = []
    for task in tasks:
        result = TaskResult(task.id, task.success_threshold)
        for rollout in rollouts_for([task], samples, run_id):
            _, reward, status, n_calls = found.get(rollout.episode_id, (None, None, None, 0))
            result.samples.append(Sample(rollout.index, rollout.episode_id, reward, status=status, n_calls=n_calls))
        results.append(result)
    return results, served


def needs_mini(tasks: list[Task]) -> bool:
    return any("FORGE_DEMO_MINI" in part for task in tasks for part in (*task.command, *task.verifier))


def check_settings(settings: EvalSettings, tasks: list[Task]) -> None:
    if settings.samples < 1 or settings.concurrency < 1 or settings.retries < 0:
        raise ForgeError("--samples and --concurrency must be ≥ 1, --retries ≥ 0")
    if too_large := [k for k in settings.ks if k > settings.samples]:
        raise ForgeError(f"--k {too_large[0]} is larger than --samples {settings.samples}: pass@k and pass^k draw k of "
                         "a task's samples; raise --samples or lower --k")  # fmt: skip
    if settings.policy_url and settings.checkpoint:
        raise ForgeError("give --policy-url (a running server) or --checkpoint (served here), not both")
    if settings.checkpoint:
        checkpoint_kind(settings.checkpoint)  # a folder that is neither kind: refused before anything starts


def evaluate(settings: EvalSettings, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the evaluation, write DIR/eval.json, print the figures; returns the eval.json document."""
    from forge.demo.harness import find_harness, with_harness_env

    started, started_at = time.monotonic(), datetime.now(UTC)
    tasks = load_tasks(settings.tasks_file)
    check_settings(settings, tasks)
    run_id = settings.run or evaluation_run_id(None)
    settings.out.mkdir(parents=True, exist_ok=True)
    check_new_run(settings.store_uri, settings.s3_endpoint, run_id)
    mini = find_harness(settings.harness) if needs_mini(tasks) else settings.harness
    tasks = with_harness_env(tasks, mini, settings.out, {})
    echo(f"forge eval: run {run_id}: {len(tasks)} tasks × {settings.samples} samples from {settings.tasks_file}; "
         f"store {settings.store_uri}; everything in {settings.out}")  # fmt: skip
    with serve_policy(settings, echo) as policy:
        results = run_rollouts(tasks, settings, run_id, policy.url, policy.model)
    for failed in (r for r in results if not r.ok):
        echo(f"forge eval: rollout {failed.rollout.episode_id} got no reward: {'; '.join(failed.reasons)}")
    task_results, served = read_back(settings.store_uri, settings.s3_endpoint, run_id, tasks, settings.samples)
    meta = {
        "run_id": run_id, "tasks_file": str(settings.tasks_file.absolute()), "samples_per_task": settings.samples,
        "store": settings.store_uri, "policy": {**policy.about, **served}, "started_at": started_at.isoformat(),
        "wall_s": round(time.monotonic() - started, 1),
    }  # fmt: skip
    document = report.build(meta, task_results, settings.ks)
    path = settings.out / "eval.json"
    report.write(path, document)
    echo("")
    echo(report.figures_table(task_results, settings.ks))
    versions = ", ".join(f"{v} ({n} calls)" for v, n in served["policy_versions"].items()) or "no calls recorded"
    models = ", ".join(served["models_served"]) or "-"
    echo(f"\nserved by {models}, policy version {versions}; success = reward ≥ each task's threshold")
    echo(f"forge eval: {document['wall_s'] / 60:.1f} min; {path}")
    return document
