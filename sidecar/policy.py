"""The policy server: which of its models is the policy under training, its context (read from its model list), and
one client for its HTTP API (``PolicyServerClient``; ``PolicyServerClients`` for callers in several threads) that
the sidecar, the trainer and the tests share.

The policy is one served name (``forge train`` prints it: ``forge-<run>`` with LoRA, the server's model with full
weights). A sidecar told it (``--policy-model``) serves every harness call by it; one not told takes the name the
server announces.
"""

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.client import HTTPConnection, HTTPException, HTTPMessage, HTTPSConnection, RemoteDisconnected
from typing import Any
from urllib.parse import urlsplit

from forge.errors import ForgeError


def announced_policy(listed: list[dict[str, Any]], current: str | None) -> str:
    """The policy a server announces in its model list: its only LoRA adapter (vLLM lists an adapter with its base as
    ``parent``), else its base model. An adapter once chosen stays while none or several are listed (a publish
    reloads it; another run's adapter may sit beside it): a LoRA run's calls never fall back to the base."""
    adapters = [m["id"] for m in listed if m.get("parent")]
    if len(adapters) == 1:
        return str(adapters[0])
    return current if current is not None else str(listed[0]["id"])


def policy_context(listed: list[dict[str, Any]], policy: str | None) -> int | None:
    """The policy's context (``max_model_len``): vLLM lists a LoRA adapter without one, its base model's is the
    adapter's (one server, one context)."""
    served = [m for m in listed if m.get("id") == policy]
    for card in (*served, *listed):
        context = card.get("max_model_len")
        if isinstance(context, int) and not isinstance(context, bool) and context > 0:
            return context
    return None


def upstream_headers() -> dict[str, str]:
    """What the sidecar sends the policy server with each request of its own: the server's key
    (``FORGE_UPSTREAM_API_KEY``, as the addon sends it with each call), or nothing."""
    key = os.environ.get("FORGE_UPSTREAM_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


class PolicyServerError(ForgeError):
    """The policy server could not be reached or did not answer in time (``status`` None), or answered an HTTP
    error (``status``, and the start of its ``body``)."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status, self.body = status, body


class PolicyServerClient:
    """The policy server's HTTP API (vLLM's OpenAI routes and its admin routes: ``/weight_info``, ``/pause``, ...)
    over one kept-alive connection. Stdlib only: it runs in the sidecar's environment as in the trainer's. One
    request at a time (a lock): threads that ask at once take theirs from a ``PolicyServerClients``.

    ``connect_timeout`` bounds reaching the server; ``timeout`` (per request, or the client's) bounds the answer.
    A kept-alive connection the server closed meanwhile (uvicorn closes idle ones after 5 s) is replaced once,
    silently; any other failure is a ``PolicyServerError`` that names the server and what went wrong."""

    def __init__(
        self, base_url: str, timeout: float = 300.0, connect_timeout: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.headers = dict(headers or {})  # sent with every request (the server's key: ``upstream_headers``)
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PolicyServerError(f"{base_url} is not a policy server URL (http://HOST:PORT)")
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._connection: HTTPConnection | None = None
        self._lock = threading.Lock()

    def request(
        self, method: str, path: str, payload: object = None, timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:  # fmt: skip
        """(HTTP status, body) of one request (``payload`` sent as JSON); PolicyServerError when there is none."""
        body = None if payload is None else json.dumps(payload).encode()
        sent = {"content-type": "application/json"} if body is not None else {}
        status, _, data = self.exchange(method, path, body, timeout, {**sent, **(headers or {})})
        return status, data

    def exchange(
        self, method: str, path: str, body: bytes | None = None, timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, HTTPMessage, bytes]:  # fmt: skip
        """(HTTP status, headers, body) of one request sending ``body`` as it is: an HTTP error is an answer like
        any other (a caller passes it on); PolicyServerError only when there is none."""
        with self._lock:
            for attempt in range(2):
                reused, answered = self._connection is not None, False
                try:
                    connection = self._connect()
                    if connection.sock is not None:  # connected within connect_timeout; the answer has its own
                        connection.sock.settimeout(self.timeout if timeout is None else timeout)
                    connection.request(method, self.prefix + path, body, {**self.headers, **(headers or {})})
                    answer = connection.getresponse()
                    answered = True
                    data = answer.read()
                    if answer.will_close:
                        self.close_locked()
                    return answer.status, answer.headers, data
                except (OSError, HTTPException) as error:
                    self.close_locked()
                    stale = isinstance(error, RemoteDisconnected | BrokenPipeError | ConnectionResetError)
                    # Asked again only when no answer began: a server that had begun one ran the request (a
                    # generation must not run twice)
                    if attempt == 0 and reused and stale and not answered:
                        continue  # the server closed the kept-alive connection meanwhile: once more on a new one
                    what = "did not answer in time" if isinstance(error, TimeoutError) else "is unreachable"
                    raise PolicyServerError(
                        f"the policy server at {self.base_url} {what} ({method} {path}: {type(error).__name__}: "
                        f"{error})"
                    ) from error
        raise AssertionError("unreachable")  # the loop returns or raises

    def get(self, path: str, timeout: float | None = None) -> Any:
        """The JSON answer to ``GET path``; PolicyServerError for an HTTP error or an answer that is not JSON."""
        return self._json(path, *self.request("GET", path, timeout=timeout))

    def post(
        self, path: str, payload: object = None, timeout: float | None = None, headers: dict[str, str] | None = None
    ) -> Any:
        """The answer to ``POST path``: its JSON, its text when it is not JSON (vLLM's LoRA routes answer in plain
        text), None when empty; PolicyServerError for an HTTP error."""
        status, data = self.request("POST", path, payload, timeout, headers)
        if status >= 400:
            raise self._refused(path, status, data)
        if not data:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return data.decode(errors="replace")

    def _json(self, path: str, status: int, data: bytes) -> Any:
        if status >= 400:
            raise self._refused(path, status, data)
        try:
            return json.loads(data)
        except ValueError:
            raise PolicyServerError(f"the policy server at {self.base_url} answered {path} with no JSON") from None

    def _refused(self, path: str, status: int, data: bytes) -> PolicyServerError:
        text = data.decode(errors="replace")[:200]
        return PolicyServerError(f"the policy server refused {path}: HTTP {status} {text}", status, text)

    def _connect(self) -> HTTPConnection:
        if self._connection is None:
            kind = HTTPSConnection if self.scheme == "https" else HTTPConnection
            connection = kind(self.host, self.port, timeout=self.connect_timeout)
            connection.connect()
            self._connection = connection
        return self._connection

    def close_locked(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()


class PolicyServerClients:
    """Kept-alive clients of one policy server for callers in several threads (the health poll, each call's
    tokens-in work): a request takes an idle client, or a new one, and gives it back, so concurrent callers never
    wait for each other and the next request reuses a warm connection. At most ``keep`` idle ones are kept."""

    def __init__(
        self, base_url: str, timeout: float = 300.0, connect_timeout: float = 10.0, keep: int = 8,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.base_url, self.timeout, self.connect_timeout, self.keep = base_url, timeout, connect_timeout, keep
        self.headers = headers
        self._idle: list[PolicyServerClient] = []
        self._lock = threading.Lock()

    @contextmanager
    def client(self) -> Iterator[PolicyServerClient]:
        """A client of this caller's own for a few requests in turn; idle again after."""
        with self._lock:
            client = self._idle.pop() if self._idle else None
        if client is None:
            client = PolicyServerClient(self.base_url, self.timeout, self.connect_timeout, self.headers)
        try:
            yield client
        finally:
            with self._lock:
                kept = len(self._idle) < self.keep
                if kept:
                    self._idle.append(client)
            if not kept:
                client.close()

    def exchange(
        self, method: str, path: str, body: bytes | None = None, timeout: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, HTTPMessage, bytes]:  # fmt: skip
        with self.client() as client:
            return client.exchange(method, path, body, timeout, headers)

    def get(self, path: str, timeout: float | None = None) -> Any:
        with self.client() as client:
            return client.get(path, timeout)

    def post(
        self, path: str, payload: object = None, timeout: float | None = None, headers: dict[str, str] | None = None
    ) -> Any:
        with self.client() as client:
            return client.post(path, payload, timeout, headers)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()
