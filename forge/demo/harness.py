"""The demo's harness (mini-swe-agent's `mini`) and the environment its task format reads: shared by `forge demo`
and `forge eval` (which the demo runs), so it lives apart from both."""

import dataclasses
import os
import sys
from pathlib import Path

from forge.errors import ForgeError
from k8s.tasks import Task

TASKS_DIR = Path(__file__).parent / "tasks"


def with_harness_env(tasks: list[Task], mini: Path | None, out: Path, extra: dict[str, str]) -> list[Task]:
    """The tasks with what the demo's task format reads from its environment (`forge demo` and `forge eval`):
    $FORGE_DEMO_MINI (mini-swe-agent's `mini`; unset when None), $FORGE_DEMO_DIR, $FORGE_DEMO_PYTHON."""
    env = {
        "FORGE_DEMO_DIR": str(TASKS_DIR), "FORGE_DEMO_PYTHON": sys.executable,
        # mini-swe-agent as a user runs it: no setup wizard, its config and its logs beside the run, a key it
        # sends to "OpenAI" (the sidecar redacts it; the policy server needs none).
        "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_GLOBAL_CONFIG_DIR": str(out / "mini-swe-agent"), "MSWEA_SILENT_STARTUP": "1",
        "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "sk-openforge-demo"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TASKS_DIR.parents[2]), os.environ.get("PYTHONPATH")])),
        **({"FORGE_DEMO_MINI": str(mini)} if mini is not None else {}), **extra,
    }  # fmt: skip
    return [dataclasses.replace(task, env={**task.env, **env}) for task in tasks]


def find_harness(explicit: Path | None) -> Path:
    """mini-swe-agent's `mini`: --harness, else where `scripts/harness.sh mini-swe-agent` installs it."""
    import subprocess

    from forge.paths import repo_root

    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ForgeError(f"--harness {explicit} is not an executable")
        return explicit
    script = repo_root() / "scripts" / "harness.sh"
    try:
        found = subprocess.run([str(script), "mini-swe-agent"], capture_output=True, text=True, timeout=900, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        raise ForgeError(f"cannot install mini-swe-agent ({script} mini-swe-agent): {detail.strip()[-300:]}") from error
    return Path(found.stdout.strip().splitlines()[-1])
