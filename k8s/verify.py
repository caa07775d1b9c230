"""A task's verifier: run it, turn its result into a reward, and record the reward.

One function turns a verifier's exit status and output into a `Verdict`, for both backends. Where the reward
goes differs: in a pod, `forge verify` (root, in the verifier container) runs the task's verifier as uid 65534 and
posts the reward on the sidecar's reward socket (a volume only the sidecar and the verifier container mount; the
sidecar takes it from root only, and `forge verify` checks that the socket's listener is the sidecar's uid, not
something the verifier left in its place): no credential exists in the pod. Elsewhere it posts to the sidecar's
loopback admin endpoint with the reward token. The local backend's orchestrator writes the reward into the store
itself (it is the trusted party there).
"""

import contextlib
import http.client
import json
import math
import os
import socket
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from forge.errors import ForgeError

VERDICT_ENV = "FORGE_VERDICT_FILE"  # where the verifier writes its verdict (a number or {"reward", "components"})
MAX_VERDICT_BYTES = 1 << 16
VERIFIER_UID = 65534  # nobody: in a pod, the verifier (and the agent-written code it runs) cannot read the token
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


def verdict_from(exit_code: int, written: str | None) -> Verdict:
    """A non-zero exit is no reward, whatever was written; exit 0 → what the verifier wrote to its verdict file (a
    number or {"reward", "components"}), else 1.0."""
    if exit_code != 0:
        return Verdict(0.0, {}, exit_code, f"verifier exited {exit_code}: no reward")
    try:
        found = json.loads(written or "null")
    except json.JSONDecodeError:
        found = None
    components: dict[str, float] = {}
    if isinstance(found, dict):
        parts = found.get("components")
        if isinstance(parts, dict):
            components = {str(k): float(v) for k, v in parts.items() if _finite(v)}
        found = found.get("reward")
    if _finite(found):
        return Verdict(float(found), components, 0, "reward written by the verifier")
    return Verdict(1.0, {}, 0, "verifier exited 0")


def _finite(value: Any) -> bool:
    """A number a float holds finitely (an int of 400 digits overflows: not one; neither is a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def read_verdict(path: Path) -> str | None:
    """At most MAX_VERDICT_BYTES of the verdict file, if it is a regular file: never through a link (it could point
    at what root may read), never blocking (a FIFO), never the whole of a huge sparse file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_VERDICT_BYTES).decode(errors="replace")
    finally:
        os.close(fd)


def run_verifier(
    command: tuple[str, ...], cwd: Path, env: dict[str, str], timeout_s: float, uid: int | None = None
) -> Verdict:
    """Run the verifier in ``cwd`` (as ``uid`` when given); its verdict is what it writes to ``$FORGE_VERDICT_FILE``,
    a fresh file outside the workspace, never its stdout (it runs agent-written code, which prints what it likes)."""
    # A process the verifier left could keep writing into the folder: its cleanup must not fail the verdict.
    with tempfile.TemporaryDirectory(prefix="forge-verdict-", ignore_cleanup_errors=True) as folder:
        verdict_file = Path(folder) / "verdict.json"
        if uid is not None:
            os.chown(folder, uid, uid)
        try:
            done = subprocess.run(
                list(command), cwd=cwd, env={**env, VERDICT_ENV: str(verdict_file)}, capture_output=True, text=True,
                timeout=timeout_s, check=False, user=uid, group=uid, extra_groups=[] if uid is not None else None,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return Verdict(0.0, {}, -1, f"verifier timed out after {timeout_s:.0f} s")
        except OSError as error:
            return Verdict(0.0, {}, -1, f"verifier could not start: {error.strerror}")
        written = read_verdict(verdict_file)
    return verdict_from(done.returncode, written)


def read_token(token_file: Path) -> str:
    try:
        return token_file.read_text().strip()
    except OSError as error:
        raise ForgeError(f"cannot read the reward token {token_file}: {error.strerror}") from error


def reward_body(episode_id: str, verdict: Verdict) -> str:
    """What `forge verify` posts to the sidecar, on the socket or over TCP."""
    return json.dumps({"episode_id": episode_id, "reward": verdict.reward, "components": verdict.components,
                       "source": "verifier"})  # fmt: skip


def post_reward(admin_url: str, token: str | None, episode_id: str, verdict: Verdict) -> None:
    """POST the reward to the sidecar's admin endpoint, with the bearer token when one is given."""
    body = reward_body(episode_id, verdict).encode()
    request = urllib.request.Request(f"{admin_url.rstrip('/')}/reward", data=body, method="POST")
    request.add_header("content-type", "application/json")
    if token is not None:
        request.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()
    except urllib.error.HTTPError as error:
        raise ForgeError(f"the sidecar refused the reward: HTTP {error.code}") from error
    except OSError as error:
        raise ForgeError(f"cannot reach the sidecar's admin endpoint {admin_url}: {error}") from error


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket whose listener must run as ``server_uid`` (SO_PEERCRED, checked before a byte is
    sent)."""

    def __init__(self, path: str, server_uid: int | None, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path, self.server_uid = path, server_uid

    def connect(self) -> None:
        from sidecar.admin import peer_uid

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
            uid = peer_uid(sock)
        except OSError:
            sock.close()
            raise
        if uid == VERIFIER_UID or (self.server_uid is not None and uid != self.server_uid):
            sock.close()
            raise ForgeError(f"the reward socket {self.socket_path} is served by uid {uid}, not the sidecar's "
                             f"({self.server_uid}): something replaced it; no reward posted")  # fmt: skip
        self.sock = sock


def post_reward_socket(path: str, server_uid: int | None, episode_id: str, verdict: Verdict) -> None:
    """POST the reward on the sidecar's reward socket (no token: the sidecar checks this process's uid)."""
    body = reward_body(episode_id, verdict)
    connection = _UnixConnection(path, server_uid, timeout=10)
    try:
        connection.request("POST", "/reward", body, {"content-type": "application/json"})
        answer = connection.getresponse()
        detail = answer.read()[:300].decode(errors="replace")
    except OSError as error:
        raise ForgeError(f"cannot reach the sidecar's reward socket {path}: {error}") from error
    finally:
        connection.close()
    if answer.status != 200:
        raise ForgeError(f"the sidecar refused the reward: HTTP {answer.status} {detail}")


def write_reward(store_uri: str, s3_endpoint: str | None, run_id: str, episode_id: str, verdict: Verdict) -> str:
    """The reward as one Parquet file in the store (the same row `forge reward` writes)."""
    from sidecar.record import reward_row, to_table
    from sidecar.store import StoreError, open_store

    row = reward_row(episode_id, verdict.reward, "verifier", components=verdict.components or None)
    day = datetime.fromtimestamp(row["at"] / 1e6, UTC)
    name = f"rewards/run={run_id}/date={day:%Y-%m-%d}/rollout-{uuid.uuid4().hex}.parquet"
    try:
        return str(open_store(store_uri, s3_endpoint).write_parquet(name, to_table([row], "rewards")))
    except (StoreError, OSError) as error:
        raise ForgeError(f"could not write the reward to the store {store_uri}: {error}") from error


def verify_in_pod(
    command: tuple[str, ...], cwd: Path, timeout_s: float, termination_log: Path = TERMINATION_LOG
) -> Verdict:
    """`forge verify` in a rollout pod: run the verifier (as ``VERIFIER_UID`` when run as root), post its reward to
    the sidecar (on its reward socket; else with the reward token, read before the verifier runs), leave the verdict
    in the termination log for the orchestrator."""
    env = dict(os.environ)
    episode = env.get("FORGE_EPISODE_ID") or env.get("POD_UID")
    if not episode:
        raise ForgeError("no episode id: FORGE_EPISODE_ID and POD_UID are both unset (is the pod injected?)")
    token_file = env.pop("FORGE_REWARD_TOKEN_FILE", None)
    token = read_token(Path(token_file)) if token_file else None  # read before the verifier runs, never after
    socket_path = env.pop("FORGE_REWARD_SOCKET", None)
    sidecar_uid = env.pop("FORGE_SIDECAR_UID", None)
    if sidecar_uid is not None and not sidecar_uid.isdigit():
        raise ForgeError(f"FORGE_SIDECAR_UID={sidecar_uid!r} is not a uid")
    uid = VERIFIER_UID if os.geteuid() == 0 else None
    verdict = run_verifier(command, cwd, env, timeout_s, uid)
    if socket_path:
        post_reward_socket(socket_path, int(sidecar_uid) if sidecar_uid else None, episode, verdict)
    else:
        post_reward(env.get("FORGE_ADMIN_URL") or "http://127.0.0.1:15002", token, episode, verdict)
    with contextlib.suppress(OSError):  # not in a pod: the verdict is printed anyway
        termination_log.write_text(json.dumps(verdict.as_json()))
    return verdict
