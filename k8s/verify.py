"""A task's verifier: run it, turn its result into a reward, and record the reward.

One function turns a verifier's exit status and output into a `Verdict`, for both backends. Where the reward
goes differs: a pod's verifier posts it to its sidecar's admin endpoint with the reward credential
(`forge verify`, in the verifier container, the only one besides the sidecar that can read the token); the local
backend's orchestrator writes it into the store itself (it is the trusted party there).
"""

import contextlib
import json
import math
import os
import subprocess
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from forge.errors import ForgeError

TERMINATION_LOG = Path("/dev/termination-log")  # the kubelet copies it into the pod's status: the orchestrator reads it


@dataclass(frozen=True)
class Verdict:
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    exit_code: int = 0
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"reward": self.reward, "components": self.components, "exit_code": self.exit_code,
                "detail": self.detail}  # fmt: skip


def verdict_from(exit_code: int, stdout: str) -> Verdict:
    """Exit 0 → 1.0, else 0.0; a last stdout line that is a number or {"reward", "components"} says otherwise."""
    lines = [line for line in stdout.strip().splitlines() if line.strip()]
    if lines:
        try:
            last = json.loads(lines[-1])
        except json.JSONDecodeError:
            last = None
        if isinstance(last, int | float) and not isinstance(last, bool) and math.isfinite(last):
            return Verdict(float(last), {}, exit_code, "reward printed by the verifier")
        if isinstance(last, dict) and isinstance(last.get("reward"), int | float) and math.isfinite(last["reward"]):
            components = last.get("components") or {}
            if isinstance(components, dict):
                numbers = {str(k): float(v) for k, v in components.items() if isinstance(v, int | float)}
                return Verdict(float(last["reward"]), numbers, exit_code, "reward printed by the verifier")
    return Verdict(1.0 if exit_code == 0 else 0.0, {}, exit_code, f"verifier exited {exit_code}")


def run_verifier(command: tuple[str, ...], cwd: Path, env: dict[str, str], timeout_s: float) -> Verdict:
    try:
        done = subprocess.run(
            list(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return Verdict(0.0, {}, -1, f"verifier timed out after {timeout_s:.0f} s")
    except OSError as error:
        return Verdict(0.0, {}, -1, f"verifier could not start: {error.strerror}")
    return verdict_from(done.returncode, done.stdout)


def post_reward(admin_url: str, token_file: Path | None, episode_id: str, verdict: Verdict) -> None:
    """POST the reward to the sidecar's admin endpoint, with the bearer token when a token file is given."""
    body = json.dumps({"episode_id": episode_id, "reward": verdict.reward, "components": verdict.components,
                       "source": "verifier"}).encode()  # fmt: skip
    request = urllib.request.Request(f"{admin_url.rstrip('/')}/reward", data=body, method="POST")
    request.add_header("content-type", "application/json")
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as error:
            raise ForgeError(f"cannot read the reward token {token_file}: {error.strerror}") from error
        request.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()
    except urllib.error.HTTPError as error:
        raise ForgeError(f"the sidecar refused the reward: HTTP {error.code}") from error
    except OSError as error:
        raise ForgeError(f"cannot reach the sidecar's admin endpoint {admin_url}: {error}") from error


def write_reward(store_uri: str, s3_endpoint: str | None, run_id: str, episode_id: str, verdict: Verdict) -> str:
    """The reward as one Parquet file in the store (the same row `forge reward` writes)."""
    from sidecar.record import to_table
    from sidecar.store import StoreError, open_store

    now = datetime.now(UTC)
    row = {"episode_id": episode_id, "call_id": None, "reward": verdict.reward, "source": "verifier", "at": now,
           "components": list(verdict.components.items()) or None}  # fmt: skip
    name = f"rewards/run={run_id}/date={now:%Y-%m-%d}/rollout-{uuid.uuid4().hex}.parquet"
    try:
        return str(open_store(store_uri, s3_endpoint).write_parquet(name, to_table([row], "rewards")))
    except (StoreError, OSError) as error:
        raise ForgeError(f"could not write the reward to the store {store_uri}: {error}") from error


def verify_in_pod(
    command: tuple[str, ...], cwd: Path, timeout_s: float, termination_log: Path = TERMINATION_LOG
) -> Verdict:
    """`forge verify` in a rollout pod: run the verifier, post its reward to the sidecar, leave the verdict in the
    termination log for the orchestrator."""
    env = dict(os.environ)
    verdict = run_verifier(command, cwd, env, timeout_s)
    episode = env.get("FORGE_EPISODE_ID") or env.get("POD_UID")
    if not episode:
        raise ForgeError("no episode id: FORGE_EPISODE_ID and POD_UID are both unset (is the pod injected?)")
    token = env.get("FORGE_REWARD_TOKEN_FILE")
    post_reward(
        env.get("FORGE_ADMIN_URL") or "http://127.0.0.1:15002", Path(token) if token else None, episode, verdict
    )
    with contextlib.suppress(OSError):  # not in a pod: the verdict is printed anyway
        termination_log.write_text(json.dumps(verdict.as_json()))
    return verdict
