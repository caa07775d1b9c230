"""The tasks file of `forge rollout`: JSONL, one task per line (blank lines and lines starting with # are skipped).

    {"id": "add-2-3", "prompt": "Write 2+3 to answer.txt", "command": "python agent.py",
     "verifier": "test \"$(cat answer.txt)\" = 5", "image": "python:3.12-slim", "timeout_s": 300, "env": {"K": "V"}}

- `id` (required): letters, digits, `-`, `_`, `.`; at most 40 characters (it goes into Job names and labels).
- `command` (required): the harness, a string (run by `sh -c`) or a list (run as is). It runs in the rollout's
  own working folder (`/workspace` in a pod) with `FORGE_PROMPT`, `FORGE_EPISODE_ID`, `FORGE_TASK_ID`,
  `FORGE_RUN_ID` set. Its exit status is logged, not judged: the verifier decides the reward.
- `verifier` (required): a string or list, run after the harness in the same folder. Reward: a non-zero exit →
  0.0; exit 0 → what it wrote to `$FORGE_VERDICT_FILE` (outside the folder), a number or
  `{"reward": R, "components": {...}}`, else 1.0. Its stdout is not read (it runs agent-written code).
- `prompt` (optional): the task's text, given as `FORGE_PROMPT`.
- `image` (Kubernetes backend): the harness's image [default: `--image`]; `verifier_image`: the verifier's,
  which must hold `forge` (it posts the reward) [default: the OpenForge sidecar image].
- `timeout_s` (optional, default 600): for the harness and the verifier together.
- `env` (optional): extra variables, name → string.
- `harness` (optional): the harness's name in the records (`claude-code`, `codex`, `my-agent`, ...). On Kubernetes
  it becomes the pod's `openforge.io/harness` annotation, which the sidecar reads (downward API) and which beats
  every other sign; without it the sidecar tells the harness from the calls (sidecar/harness.py).
- `success_threshold` (optional, default 1.0): a rollout succeeded when its reward is at least this (`forge eval`'s
  pass@k and pass^k count successes; a verifier with partial credit sets what counts as solved).
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.errors import ForgeError

TASK_ID = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,38}[A-Za-z0-9])?$")
FIELDS = {
    "id", "command", "verifier", "prompt", "image", "verifier_image", "timeout_s", "env", "harness",
    "success_threshold",
}  # fmt: skip


@dataclass(frozen=True)
class Task:
    id: str
    command: tuple[str, ...]  # argv; a string command becomes ("sh", "-c", command)
    verifier: tuple[str, ...]
    prompt: str = ""
    image: str = ""
    verifier_image: str = ""
    timeout_s: float = 600.0
    env: dict[str, str] = field(default_factory=dict, hash=False)  # rollouts are keyed by task: id and argv hash
    harness: str = ""  # the harness's name for the records (Kubernetes: the pod's openforge.io/harness annotation)
    success_threshold: float = 1.0  # reward ≥ this: the rollout solved the task (forge eval)


def _argv(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str) and value.strip():
        return ("sh", "-c", value)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"{name} must be a non-empty string or list of strings")


def parse_task(data: Any) -> Task:
    if not isinstance(data, dict):
        raise ValueError("a task is a JSON object")
    unknown = set(data) - FIELDS
    if unknown:
        raise ValueError(f"unknown field {sorted(unknown)[0]!r} (known: {', '.join(sorted(FIELDS))})")
    task_id = data.get("id")
    if not isinstance(task_id, str) or not TASK_ID.match(task_id):
        raise ValueError(f"id {task_id!r}: use 1-40 letters, digits, '-', '_' or '.' (it names Jobs and labels)")
    for name in ("prompt", "image", "verifier_image", "harness"):
        if not isinstance(data.get(name, ""), str):
            raise ValueError(f"{name} must be a string")
    timeout = data.get("timeout_s", 600)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError("timeout_s must be a positive number")
    threshold = data.get("success_threshold", 1.0)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not math.isfinite(threshold):
        raise ValueError(
            f"success_threshold {threshold!r} must be a finite number (a rollout succeeds when its reward ≥ it)"
        )
    env = data.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must map names to strings")
    return Task(
        id=task_id, command=_argv(data.get("command"), "command"), verifier=_argv(data.get("verifier"), "verifier"),
        prompt=data.get("prompt", ""), image=data.get("image", ""), verifier_image=data.get("verifier_image", ""),
        timeout_s=float(timeout), env=dict(env), harness=data.get("harness", "").strip(),
        success_threshold=float(threshold),
    )  # fmt: skip


def load_tasks(path: Path) -> list[Task]:
    """The tasks in a JSONL file; a bad line is an error naming its line number."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ForgeError(f"cannot read the tasks file {path}: {error.strerror}") from error
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            task = parse_task(json.loads(line))
        except json.JSONDecodeError as error:
            raise ForgeError(f"{path}:{number}: not JSON ({error.msg})") from error
        except ValueError as error:
            raise ForgeError(f"{path}:{number}: {error}") from error
        if task.id in seen:
            raise ForgeError(f"{path}:{number}: task id {task.id!r} appears twice")
        seen.add(task.id)
        tasks.append(task)
    if not tasks:
        raise ForgeError(f"{path} has no tasks: write one JSON object per line")
    return tasks
