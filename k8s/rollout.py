"""`forge rollout`: G rollouts per task, at most N at a time, failures retried with their reason, a summary.

The scheduler (`orchestrate`) is one loop for both backends: it starts rollouts while fewer than `concurrency`
run, waits for the backend to report one finished, retries it (up to `retries` more attempts) when it failed for
a reason other than its reward, and draws a progress bar. A backend has two methods: `start(attempt)` and
`wait()` (block until some started attempt ends, return it with its `Outcome`).

- `LocalBackend` (here): each rollout is a subprocess in its own folder, behind one regular-mode sidecar whose
  proxy user name is the episode id; the reward is written to the store by this (trusted) process. `forge demo`
  runs tasks through it.
- `KubernetesBackend` (k8s/kube.py): each rollout is a Job in which the webhook injects the sidecar.
An episode id is `<run>.<task>.<index>`: the same across retries, so a retried rollout's calls and reward belong
to one episode (the collector sees a retry as a new segment of it).
"""

import contextlib
import errno
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from forge.console import terminal
from forge.errors import ForgeError
from k8s.tasks import Task
from k8s.verify import Verdict, run_verifier, write_reward


@dataclass(frozen=True)
class Rollout:
    task: Task
    index: int  # 0 .. G-1 within the task's group
    run_id: str

    @property
    def episode_id(self) -> str:
        return f"{self.run_id}.{self.task.id}.{self.index}"


@dataclass(frozen=True)
class Attempt:
    rollout: Rollout
    number: int  # 1, 2, ...

    @property
    def episode_id(self) -> str:
        """A retry is a new episode (the same group): an aborted attempt's calls never get the retry's reward."""
        return self.rollout.episode_id if self.number == 1 else f"{self.rollout.episode_id}.a{self.number}"


@dataclass(frozen=True)
class Outcome:
    verdict: Verdict | None  # None: the rollout failed before a reward (the reason says why)
    reason: str = ""


@dataclass
class RolloutResult:
    rollout: Rollout
    verdict: Verdict | None = None
    attempts: int = 0
    reasons: list[str] = field(default_factory=list)  # why each failed attempt failed
    episode_id: str | None = None  # the episode of the attempt that got the reward

    @property
    def ok(self) -> bool:
        return self.verdict is not None

    def as_json(self) -> dict[str, object]:
        """One line of `forge rollout --results`."""
        rollout, verdict = self.rollout, self.verdict
        return {
            "episode_id": self.episode_id or rollout.episode_id, "task_id": rollout.task.id, "index": rollout.index,
            "run_id": rollout.run_id, "ok": self.ok, "attempts": self.attempts, "reasons": self.reasons,
            "reward": verdict.reward if verdict else None, "components": verdict.components if verdict else None,
        }  # fmt: skip


class Backend(Protocol):
    def start(self, attempt: Attempt) -> None: ...

    def wait(self) -> tuple[Attempt, Outcome]: ...

    def cancel(self) -> None: ...


def rollouts_for(tasks: list[Task], group_size: int, run_id: str) -> list[Rollout]:
    """G rollouts per task, interleaved (task 1 #0, task 2 #0, ...) so early results cover every task."""
    return [Rollout(task, index, run_id) for index in range(group_size) for task in tasks]


class Progress:
    """A progress bar on stderr (tqdm), quiet when stderr is not a terminal unless asked."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="rollout", disable=not enabled, file=terminal(), dynamic_ncols=True)
        self.ok = self.failed = self.retried = 0

    def update(self, result: RolloutResult | None, retried: bool = False) -> None:
        if retried:
            self.retried += 1
        elif result is not None:
            self.ok += result.ok
            self.failed += not result.ok
            self.bar.update(1)
        self.bar.set_postfix(ok=self.ok, failed=self.failed, retries=self.retried, refresh=False)

    def close(self) -> None:
        self.bar.close()


def orchestrate(
    rollouts: list[Rollout], backend: Backend, concurrency: int, retries: int,
    on_result: Callable[[RolloutResult], None] | None = None, progress: bool = False,
) -> list[RolloutResult]:  # fmt: skip
    if concurrency < 1:
        raise ForgeError("--concurrency must be at least 1")
    if retries < 0:
        raise ForgeError("--retries must be 0 or more")
    results = {r: RolloutResult(r) for r in rollouts}
    pending: deque[Attempt] = deque(Attempt(r, 1) for r in rollouts)
    running = 0
    bar = Progress(len(rollouts), progress)
    try:
        while pending or running:
            while pending and running < concurrency:
                attempt = pending.popleft()
                results[attempt.rollout].attempts = attempt.number
                backend.start(attempt)
                running += 1
            attempt, outcome = backend.wait()
            running -= 1
            result = results[attempt.rollout]
            if outcome.verdict is not None:
                result.verdict, result.episode_id = outcome.verdict, attempt.episode_id
            else:
                result.reasons.append(outcome.reason)
                if attempt.number <= retries:
                    pending.append(Attempt(attempt.rollout, attempt.number + 1))
                    bar.update(None, retried=True)
                    continue
            bar.update(result)
            if on_result:
                on_result(result)
    except BaseException:
        backend.cancel()
        raise
    finally:
        bar.close()
    return [results[r] for r in rollouts]


def summary(results: list[RolloutResult]) -> str:
    """One line per task (rollouts, ok, failed, retries, mean and spread of rewards), then the total."""
    rows = [("task", "rollouts", "ok", "failed", "retries", "mean reward", "min", "max")]
    by_task: dict[str, list[RolloutResult]] = {}
    for result in results:
        by_task.setdefault(result.rollout.task.id, []).append(result)
    for name, group in [*by_task.items(), ("all", results)]:
        rewards = [r.verdict.reward for r in group if r.verdict is not None]
        rows.append((
            name, str(len(group)), str(sum(r.ok for r in group)), str(sum(not r.ok for r in group)),
            str(sum(r.attempts - 1 for r in group)),
            f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
            f"{min(rewards):.3f}" if rewards else "-", f"{max(rewards):.3f}" if rewards else "-",
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    failures = [f"{r.rollout.episode_id}: {'; '.join(r.reasons)}" for r in results if not r.ok]
    return "\n".join(lines + (["failed:", *failures] if failures else []))


# -- the local backend ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalSettings:
    workdir: Path  # one folder per rollout below it: <workdir>/<episode id>/
    store: str | None = None  # where rewards go (None: not recorded, e.g. a dry run)
    s3_endpoint: str | None = None
    proxy_url: str | None = None  # the sidecar in regular mode, http://127.0.0.1:PORT (None: no proxy)
    trust_env: dict[str, str] = field(default_factory=dict)  # the sidecar CA's trust variables
    base_env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    # True: a harness that crashes (exit status ≠ 0) or times out gets no reward, its reason recorded (forge demo);
    # False: its end is judged by the verifier like any other.
    harness_must_succeed: bool = False


def rollout_env(attempt: Attempt, settings: LocalSettings) -> dict[str, str]:
    rollout = attempt.rollout
    env = {**settings.base_env, **rollout.task.env, **settings.trust_env}
    env |= {"FORGE_EPISODE_ID": attempt.episode_id, "FORGE_TASK_ID": rollout.task.id, "FORGE_RUN_ID": rollout.run_id,
            "FORGE_PROMPT": rollout.task.prompt}  # fmt: skip
    if settings.proxy_url:
        # Regular mode: the proxy user name is EPISODE;task=TASK (the sidecar asks every client for credentials).
        scheme, _, address = settings.proxy_url.partition("://")
        proxy = f"{scheme}://{attempt.episode_id};task={rollout.task.id}:x@{address}"
        env |= {"HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "http_proxy": proxy}
    return env


def run_in_own_session(
    command: list[str], folder: Path, env: dict[str, str], log: IO[bytes], timeout: float
) -> subprocess.CompletedProcess:  # fmt: skip
    """The harness under a subreaper (k8s/reaper.py), in a session of its own; whatever it left running (a background
    writer that would change the workspace or the trajectory under the verifier, or wait for the next rollout's
    folder), in its session or one it made (setsid, a double fork), is killed before this returns."""
    program = folder / command[0] if "/" in command[0] else shutil.which(command[0], path=env.get("PATH", ""))
    if program is None or not os.access(program, os.X_OK) or not os.path.isfile(program):
        raise FileNotFoundError(errno.ENOENT, "No such executable file", command[0])  # as Popen would say
    # -I: the script alone (stdlib only), whatever PYTHON* variables or files the harness's folder holds.
    reaper = [sys.executable, "-I", str(Path(__file__).with_name("reaper.py")), "--", *command]
    process = subprocess.Popen(reaper, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        return subprocess.CompletedProcess(command, process.wait(timeout=timeout))
    finally:
        if process.poll() is None:  # timed out (or interrupted): the reaper kills and reaps the harness's processes
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_local_rollout(attempt: Attempt, settings: LocalSettings) -> Outcome:
    """One rollout as local processes: the harness, then the verifier, in the rollout's own folder."""
    rollout = attempt.rollout
    folder = settings.workdir / rollout.episode_id / f"attempt-{attempt.number}"
    folder.mkdir(parents=True, exist_ok=True)
    env = rollout_env(attempt, settings)
    deadline = time.monotonic() + rollout.task.timeout_s
    try:
        with open(folder / "harness.log", "wb") as log:
            harness = run_in_own_session(list(rollout.task.command), folder, env, log, rollout.task.timeout_s)
        (folder / "harness.exit").write_text(f"{harness.returncode}\n")
    except subprocess.TimeoutExpired:
        (folder / "harness.exit").write_text("timeout\n")
        if settings.harness_must_succeed:
            return Outcome(None, f"the harness timed out after {rollout.task.timeout_s:.0f} s ({folder}/harness.log)")
    except OSError as error:
        return Outcome(None, f"the harness could not start: {error.strerror}")
    else:
        if settings.harness_must_succeed and harness.returncode != 0:
            return Outcome(None, f"the harness exited with status {harness.returncode} ({folder}/harness.log)")
    verdict = run_verifier(rollout.task.verifier, folder, env, max(1.0, deadline - time.monotonic()))
    if verdict.exit_code == -1 and "could not start" in verdict.detail:
        return Outcome(None, verdict.detail)
    if settings.store:
        try:
            write_reward(settings.store, settings.s3_endpoint, rollout.run_id, attempt.episode_id, verdict)
        except ForgeError as error:
            return Outcome(None, str(error))
    return Outcome(verdict)


class LocalBackend:
    """Rollouts as local processes, each attempt in its own thread (the scheduler bounds how many run)."""

    def __init__(self, settings: LocalSettings) -> None:
        self.settings = settings
        self.done: queue.Queue[tuple[Attempt, Outcome]] = queue.Queue()

    def start(self, attempt: Attempt) -> None:
        def run() -> None:
            try:
                outcome = run_local_rollout(attempt, self.settings)
            except Exception as error:  # a bug must not hang the scheduler: report it as the attempt's failure
                outcome = Outcome(None, f"{type(error).__name__}: {error}")
            self.done.put((attempt, outcome))

        threading.Thread(target=run, name=f"rollout-{attempt.rollout.episode_id}", daemon=True).start()

    def wait(self) -> tuple[Attempt, Outcome]:
        return self.done.get()

    def cancel(self) -> None:
        pass  # Ctrl-C reaches the harnesses too (one process group); a timeout ends each one anyway


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


POD_IDENTITY = ("POD_UID", "POD_NAME", "POD_NAMESPACE", "FORGE_EPISODE_ID", "FORGE_TASK_ID", "FORGE_RUN_ID")


class LocalSidecar:
    """One `forge sidecar --mode regular` for every local rollout (each proxy user name is an episode id)."""

    def __init__(
        self, upstream: str, store: str, run_id: str, folder: Path, s3_endpoint: str | None = None,
        policy_model: str | None = None,
    ) -> None:  # fmt: skip
        from sidecar import ca

        self.folder = folder
        self.port, self.admin_port = free_port(), free_port()
        self.ca = ca.init_ca(folder / "ca")
        forge = str(Path(sys.executable).parent / "forge")
        self.command = [
            forge, "sidecar", "--mode", "regular", "--listen-port", str(self.port), "--admin-port",
            str(self.admin_port), "--upstream", upstream, "--store", store, "--wal-dir", str(folder / "wal"),
            "--ca-dir", str(folder / "ca"), "--run-id", run_id, "--flush-seconds", "1",
        ]  # fmt: skip
        if s3_endpoint:
            self.command += ["--s3-endpoint", s3_endpoint]
        if policy_model:
            self.command += ["--policy-model", policy_model]
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "LocalSidecar":
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "sidecar.log", "wb")  # noqa: SIM115 (kept open for the process's life)
        # A pod's identity in our own environment would outrank each client's proxy user name: leave it out.
        env = {k: v for k, v in os.environ.items() if k not in POD_IDENTITY}
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.folder / "sidecar.log").read_text(errors="replace").strip().splitlines()[-1:]
                raise ForgeError(f"the sidecar exited at start: {tail[0] if tail else 'no output'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/healthz", timeout=1):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise ForgeError(f"the sidecar did not answer within {timeout_s:.0f} s (log: {self.folder / 'sidecar.log'})")

    def stop(self) -> None:
        """SIGTERM: the sidecar flushes every record to the store before it exits."""
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "LocalSidecar":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_local(
    tasks: list[Task], group_size: int, run_id: str, workdir: Path, store: str, upstream: str | None,
    concurrency: int = 4, retries: int = 2, s3_endpoint: str | None = None,
    on_result: Callable[[RolloutResult], None] | None = None, progress: bool = False,
    harness_must_succeed: bool = False, policy_model: str | None = None,
) -> list[RolloutResult]:  # fmt: skip
    """The local backend whole: G rollouts of each task as processes behind one sidecar (none when `upstream` is
    None: rewards only), rewards into `store`. What `forge rollout --backend local` and `forge demo` run."""
    rollouts = rollouts_for(tasks, group_size, run_id)
    folder = workdir / run_id
    if upstream is None:
        backend = LocalBackend(LocalSettings(folder, store, s3_endpoint, harness_must_succeed=harness_must_succeed))
        return orchestrate(rollouts, backend, concurrency, retries, on_result, progress)
    from sidecar.ca import CaFiles

    with LocalSidecar(upstream, store, run_id, folder / "sidecar", s3_endpoint, policy_model) as sidecar:
        trust = CaFiles(folder / "sidecar" / "ca").trust_env()
        backend = LocalBackend(
            LocalSettings(folder, store, s3_endpoint, sidecar.url, trust, harness_must_succeed=harness_must_succeed)
        )
        return orchestrate(rollouts, backend, concurrency, retries, on_result, progress)
