"""The sidecar's admin endpoint, on loopback only: ``POST /reward`` (the verifier's, with a bearer token),
``GET /metrics`` and ``GET /healthz`` (read-only, open); and, in a pod, its reward socket.

The agent under training shares the pod's loopback and runs shell commands, so the port alone proves nothing:
a reward is taken only with ``Authorization: Bearer <token>``, the token read from a file the harness's uid
cannot read (``--reward-token-file``; by default a random one the sidecar writes, mode 0600, into its WAL
folder). Without a token the answer is 401, with a wrong one 403, and nothing is written.

In a pod no token exists (``--reward-socket``): rewards come on a Unix socket in a volume only the sidecar and
the verifier container mount, mode 0600, and a connection is taken only from a peer whose uid (the kernel's
``SO_PEERCRED``, not anything the caller says) is root's or the sidecar's own: ``forge verify`` runs as root and
runs the task's verifier (agent-written code) as uid 65534, which can neither open the socket nor pass the check.
Loopback TCP then takes no reward at all (403, ``reward_refused_total{reason="tcp_closed"}``): there is no
credential in the pod for the agent to find.

The record's ``source`` is set here (``admin:verifier``), never taken from the caller. In a pod (``episode``
given) only the pod's own episode takes a reward (403, counted as
``reward_refused_total{reason="other_episode"}``). Every accepted reward is kept; the collector counts the latest
per episode (or call), and all stay queryable in ``rewards``.
"""

import hmac
import json
import logging
import math
import os
import secrets
import socket
import socketserver
import stat
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sidecar.metrics import Metrics
from sidecar.record import RewardRow, reward_row
from sidecar.writer import RecordWriter, now_us

log = logging.getLogger("openforge.sidecar")
REWARD_SOURCE = "admin:verifier"  # what a token-holding caller is, whatever it says it is
DEFAULT_TOKEN_FILE = "reward-token"
MIN_TOKEN_LEN = 16


class RewardError(ValueError):
    pass


class TokenFileError(ValueError):
    """The reward token file cannot be used (missing, empty, too short): said in one line."""


def payload_reward(payload: Any, source: str) -> RewardRow:
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
    return reward_row(episode, value, source, call_id=call_id, components=components, at=now_us())


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


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket, as the kernel knows it (SO_PEERCRED:
    the client's when the server asks, the server's, as of its listen(), when the client asks)."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


class _RewardSocketServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """HTTP on a Unix socket, mode 0600; each request's client address is ("unix", the peer's uid)."""

    daemon_threads = True

    def server_bind(self) -> None:
        path = Path(str(self.server_address))
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a socket left by an earlier start of this sidecar
        except FileNotFoundError:
            pass
        super().server_bind()
        os.chmod(path, 0o600)  # before listen(): nothing can connect in between

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        connection, _ = self.socket.accept()
        return connection, ("unix", peer_uid(connection))


class AdminServer:
    def __init__(
        self, address: tuple[str, int] | None, writer: RecordWriter, metrics: Metrics, token: str | None,
        episode: str | None = None, reward_socket: Path | None = None,
        socket_uids: frozenset[int] | None = None,
    ) -> None:  # fmt: skip
        """``token`` None: loopback TCP takes no reward (the reward socket does). ``socket_uids``: the peers the
        socket takes rewards from [default: root and this process's own uid]."""
        allowed = socket_uids if socket_uids is not None else frozenset({0, os.geteuid()})
        if token is not None and len(token) < MIN_TOKEN_LEN:
            raise TokenFileError(f"the reward token must be at least {MIN_TOKEN_LEN} characters")
        expected = token.encode() if token is not None else None

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

            def refuse(self, reason: str, code: int, message: str, headers: dict[str, str] | None = None) -> bool:
                metrics.inc(f'reward_refused_total{{reason="{reason}"}}')
                self.reply(code, {"error": message}, headers=headers)
                return False

            def authorized(self) -> bool:
                """On the socket: the peer's uid is root's or the sidecar's. On TCP: the caller holds the token (401
                when none is given, 403 when a wrong one is, or when TCP takes no rewards)."""
                if isinstance(self.server, _RewardSocketServer):
                    uid = self.client_address[1]
                    if uid in allowed:
                        return True
                    return self.refuse("peer_uid", 403, f"uid {uid} may not post rewards on this socket")
                if expected is None:
                    return self.refuse("tcp_closed", 403, "this sidecar takes rewards on its reward socket only")
                given = bearer_token(self.headers.get("authorization"))
                if given is None:
                    return self.refuse("no_token", 401,
                                       "a reward needs Authorization: Bearer <the token in the reward token file>",
                                       {"www-authenticate": 'Bearer realm="forge-admin"'})  # fmt: skip
                if not hmac.compare_digest(given.encode(), expected):  # constant time: no guessing byte by byte
                    return self.refuse("wrong_token", 403, "wrong reward token")
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
                    row = payload_reward(json.loads(self.rfile.read(length) or b"null"), source=REWARD_SOURCE)
                except (RewardError, ValueError) as error:
                    self.reply(400, {"error": str(error)})
                    return
                if episode is not None and row["episode_id"] != episode:
                    self.refuse(
                        "other_episode", 403, f"this sidecar takes rewards for its pod's episode ({episode}) only"
                    )
                    return
                if writer.append("rewards", row) is None:
                    self.reply(503, {"error": "the write-ahead log is full; reward not recorded"})
                    return
                metrics.inc("rewards_total")
                self.reply(200, {"ok": True, "source": REWARD_SOURCE, "at": row["at"]})

        self.servers: list[socketserver.BaseServer] = []
        if address is not None:
            tcp = ThreadingHTTPServer(address, Handler)
            tcp.daemon_threads = True
            self.servers.append(tcp)
        if reward_socket is not None:
            self.servers.append(_RewardSocketServer(str(reward_socket), Handler))
        self.reward_socket = reward_socket

    @property
    def port(self) -> int:
        tcp = next(s for s in self.servers if isinstance(s, ThreadingHTTPServer))
        return int(tcp.server_address[1])

    def start(self) -> "AdminServer":
        for server in self.servers:
            threading.Thread(target=server.serve_forever, name="forge-admin", daemon=True).start()
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
        if self.reward_socket is not None:
            self.reward_socket.unlink(missing_ok=True)
