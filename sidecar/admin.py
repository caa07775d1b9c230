"""The sidecar's admin endpoint, on loopback only: ``POST /reward`` (the verifier's, with a bearer token),
``GET /metrics`` and ``GET /healthz`` (read-only, open).

The agent under training shares the pod's loopback and runs shell commands, so the port alone proves nothing:
a reward is taken only with ``Authorization: Bearer <token>``, the token read from a file the harness's uid
cannot read (``--reward-token-file``; by default a random one the sidecar writes, mode 0600, into its WAL
folder). Without a token the answer is 401, with a wrong one 403, and nothing is written. The record's
``source`` is set here (``admin:verifier``), never taken from the caller. In a pod (``episode`` given) only the
pod's own episode takes a reward: one Secret serves every pod, and its holder must not set a sibling's (403,
counted as ``reward_refused_total{reason="other_episode"}``). Every accepted reward is kept; the collector counts
the latest per episode (or call), and all stay queryable in ``rewards``.
"""

import hmac
import json
import logging
import math
import os
import secrets
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sidecar.metrics import Metrics
from sidecar.writer import RecordWriter, now_us

log = logging.getLogger("openforge.sidecar")
REWARD_SOURCE = "admin:verifier"  # what a token-holding caller is, whatever it says it is
DEFAULT_TOKEN_FILE = "reward-token"
MIN_TOKEN_LEN = 16


class RewardError(ValueError):
    pass


class TokenFileError(ValueError):
    """The reward token file cannot be used (missing, empty, too short): said in one line."""


def reward_row(payload: Any, source: str) -> dict[str, Any]:
    """A reward record from a JSON payload; RewardError says what is wrong with it. ``source`` is the server's:
    a ``source`` in the payload is ignored (the caller does not choose what it is recorded as)."""
    if not isinstance(payload, dict):
        raise RewardError("the body must be a JSON object")
    episode = payload.get("episode_id")
    if not isinstance(episode, str) or not episode:
        raise RewardError("episode_id (a non-empty string) is required")
    value = payload.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardError("reward (a finite number) is required")
    components = payload.get("components") or {}
    if not isinstance(components, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in components.items()
    ):
        raise RewardError("components must map names to finite numbers")
    call_id = payload.get("call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise RewardError("call_id must be a string")
    return {
        "episode_id": episode, "call_id": call_id, "reward": float(value),
        "components": {k: float(v) for k, v in components.items()}, "source": source, "at": now_us(),
    }  # fmt: skip


def read_token_file(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace ignored); TokenFileError when it cannot serve as one."""
    try:
        token = path.read_text().strip()
        mode = path.stat().st_mode
    except OSError as error:
        raise TokenFileError(f"reward token file {path}: {error.strerror}") from error
    if len(token) < MIN_TOKEN_LEN:
        raise TokenFileError(f"reward token file {path}: the token must be at least {MIN_TOKEN_LEN} characters")
    if mode & stat.S_IROTH:
        log.warning("reward token file %s is readable by every uid: a harness that can see it can post rewards "
                    "(make it 0600/0640, readable only by the sidecar and the verifier)", path)  # fmt: skip
    return token


def create_token_file(path: Path) -> str:
    """A new random token in ``path``, mode 0600 from the first byte (written under a temporary name, renamed)."""
    token = secrets.token_urlsafe(32)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the file may have existed with another mode
        os.write(fd, f"{token}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return token


def bearer_token(authorization: str | None) -> str | None:
    scheme, _, credential = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credential.strip() or None


class AdminServer:
    def __init__(
        self, address: tuple[str, int], writer: RecordWriter, metrics: Metrics, token: str, episode: str | None = None
    ) -> None:
        if len(token) < MIN_TOKEN_LEN:
            raise TokenFileError(f"the reward token must be at least {MIN_TOKEN_LEN} characters")
        expected = token.encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # no access log: bodies and headers stay out of logs
                pass

            def reply(self, code: int, body: dict[str, Any] | str, content_type: str = "application/json",
                      headers: dict[str, str] | None = None) -> None:  # fmt: skip
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(code)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self.reply(200, metrics.render(), "text/plain; version=0.0.4")
                elif self.path == "/healthz":
                    self.reply(200, {"ok": True})
                else:
                    self.reply(404, {"error": f"no such endpoint: GET {self.path}"})

            def authorized(self) -> bool:
                """The caller holds the token; else answer 401 (none given) or 403 (a wrong one) and say no."""
                given = bearer_token(self.headers.get("authorization"))
                if given is None:
                    metrics.inc('reward_refused_total{reason="no_token"}')
                    message = "a reward needs Authorization: Bearer <the token in the reward token file>"
                    self.reply(401, {"error": message}, headers={"www-authenticate": 'Bearer realm="forge-admin"'})
                    return False
                if not hmac.compare_digest(given.encode(), expected):  # constant time: no guessing byte by byte
                    metrics.inc('reward_refused_total{reason="wrong_token"}')
                    self.reply(403, {"error": "wrong reward token"})
                    return False
                return True

            def do_POST(self) -> None:
                if self.path != "/reward":
                    self.reply(404, {"error": f"no such endpoint: POST {self.path}"})
                    return
                if not self.authorized():
                    self.close_connection = True  # the body, unread, is not taken as the next request
                    return
                try:
                    length = int(self.headers.get("content-length") or 0)
                    if length > 1 << 20:
                        raise RewardError("body too large")
                    row = reward_row(json.loads(self.rfile.read(length) or b"null"), source=REWARD_SOURCE)
                except (RewardError, ValueError) as error:
                    self.reply(400, {"error": str(error)})
                    return
                if episode is not None and row["episode_id"] != episode:
                    metrics.inc('reward_refused_total{reason="other_episode"}')
                    self.reply(403, {"error": f"this sidecar takes rewards for its pod's episode ({episode}) only"})
                    return
                if writer.append("rewards", row) is None:
                    self.reply(503, {"error": "the write-ahead log is full; reward not recorded"})
                    return
                metrics.inc("rewards_total")
                self.reply(200, {"ok": True, "source": REWARD_SOURCE, "at": row["at"]})

        self.server = ThreadingHTTPServer(address, Handler)
        self.server.daemon_threads = True

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> "AdminServer":
        threading.Thread(target=self.server.serve_forever, name="forge-admin", daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
