"""The policy version of each call: the server's weight version asked just before the call is sent, and again
after it was answered. A call whose two differ straddled a publish.

vLLM's OpenAI endpoints do not say which weights served a request, so each call is bracketed by two questions to
``GET /weight_info``. Both are shared between calls without losing exactness (the version only moves forward):

- before: the newest answer to any question (before or after another call) serves when its question was sent at
  most ``FRESH_S`` ago: it was answered before this call is sent, so it names a version no newer than the one the
  call meets. Else a question already in flight answers for it too, or one is asked, on a kept-alive connection,
  and the call waits for it (about 0.3 ms on loopback; on a busy server up to one engine step). Calls that follow
  each other closely (a harness's turns, many clients) thus ask nothing before they are sent. The price: a call
  sent within ``FRESH_S`` after a publish may be recorded as straddling it (two versions) when it was not.
- after: one worker thread asks for every call answered before its question began, then completes their WAL rows.
  It waits ``AFTER_WAIT_S`` after a call ends so the calls ending meanwhile share one question (one client's
  consecutive calls, many clients): a publish in that instant marks them as straddling it (conservative).
"""

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from http.client import HTTPConnection, HTTPException, HTTPSConnection
from typing import Any
from urllib.parse import ParseResult

log = logging.getLogger("openforge.sidecar")
# How long one question may take. A loaded policy server (its API loop busy with other requests' prefill and
# detokenization, 2 shared cores) took over 2 s to answer the first calls of `forge demo`, whose records then said
# "version unknown"; the call would have waited that long for the server anyway.
TIMEOUT_S = 10.0
FRESH_S = 0.05  # an answer to a question sent at most this long ago stands for a call's version before it is sent
AFTER_WAIT_S = 0.02  # the question after a call waits this long for other calls to end and share it


def version_text(answer: Any) -> str | None:
    version = answer.get("weight_version") if isinstance(answer, dict) else None
    return None if version is None else str(version)


class VersionClock:
    def __init__(self, upstream: ParseResult, complete: Callable[[int, str | None], None]) -> None:
        self.upstream = upstream
        self.port = upstream.port or (443 if upstream.scheme == "https" else 80)
        self.complete = complete  # (WAL row id, version after the call) -> None
        self.in_flight: asyncio.Future[str | None] | None = None
        self.refused = False  # the last question found the server refusing connections (it is down)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.waiting: list[int] = []
        self.known: tuple[float, str] | None = None  # (when its question was sent, monotonic; the version)
        self.known_lock = threading.Lock()
        self.lock = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._after_loop, name="forge-version", daemon=True)
        self.thread.start()

    # -- before: on the event loop ------------------------------------------------------------------------------
    def _learn(self, asked_at: float, version: str | None) -> None:
        if version is None:
            return
        with self.known_lock:
            if self.known is None or asked_at >= self.known[0]:
                self.known = (asked_at, version)

    async def before(self) -> str | None:
        """The server's version now (None: unknown): a fresh answer, else a question in flight or a new one."""
        known = self.known
        if known is not None and time.monotonic() - known[0] <= FRESH_S:
            return known[1]
        if self.in_flight is None or self.in_flight.done():
            self.in_flight = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self.in_flight)

    async def _ask(self) -> str | None:
        for attempt in range(2):  # a kept-alive connection the server closed meanwhile: once more on a new one
            # Only the first attempt takes a kept-alive connection: the server closes idle ones (uvicorn after
            # 5 s), and a second stale one would leave the call's version unknown.
            connection = self.idle.pop() if self.idle and attempt == 0 else None
            asked_at = time.monotonic()
            try:
                if connection is None:
                    try:
                        connection = await asyncio.wait_for(
                            asyncio.open_connection(self.upstream.hostname, self.port,
                                                    ssl=self.upstream.scheme == "https" or None), TIMEOUT_S,
                        )  # fmt: skip
                    except ConnectionRefusedError:
                        self.refused = True
                        return None
                self.refused = False
                version = await asyncio.wait_for(self._exchange(*connection), TIMEOUT_S)
                self.idle.append(connection)
                self._learn(asked_at, version)
                return version
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as error:
                if connection is not None:
                    connection[1].close()
                if attempt == 1 or isinstance(error, TimeoutError):  # a server that did not answer: once is enough
                    return None
        return None

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str | None:
        writer.write(f"GET /weight_info HTTP/1.1\r\nHost: {self.upstream.netloc}\r\n\r\n".encode())
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
        length = int({k.strip().lower(): v.strip() for k, v in headers.items()}.get("content-length", "-1"))
        if length < 0:
            raise ValueError("no content-length")
        body = await reader.readexactly(length)
        return version_text(json.loads(body)) if " 200 " in f"{head[0]} " else None

    # -- after: in a worker thread ------------------------------------------------------------------------------
    def after(self, row_id: int) -> None:
        """Ask the version once this call is done, then complete its WAL row."""
        with self.lock:
            self.waiting.append(row_id)
            self.lock.notify()

    def _after_loop(self) -> None:
        connection: HTTPConnection | None = None
        while True:
            with self.lock:
                while not self.waiting and not self.stopped:
                    self.lock.wait()
                if self.stopped and not self.waiting:
                    return
                deadline = time.monotonic() + AFTER_WAIT_S  # the calls ending meanwhile share this question
                while not self.stopped and (left := deadline - time.monotonic()) > 0:
                    self.lock.wait(left)
                rows, self.waiting = self.waiting, []
            version = None  # asked after every one of these calls was answered: one question serves them all
            for _ in range(2):
                asked_at = time.monotonic()
                try:
                    if connection is None:
                        kind = HTTPSConnection if self.upstream.scheme == "https" else HTTPConnection
                        connection = kind(self.upstream.hostname or "127.0.0.1", self.port, timeout=TIMEOUT_S)
                    connection.request("GET", "/weight_info")
                    answer = connection.getresponse()
                    data = answer.read()
                    version = version_text(json.loads(data)) if answer.status == 200 else None
                    self._learn(asked_at, version)
                    break
                except (OSError, HTTPException, ValueError):
                    connection.close() if connection else None
                    connection = None
            for row_id in rows:
                try:
                    self.complete(row_id, version)
                except Exception as error:  # the WAL refused: the row goes on without it after its hold
                    log.error("could not complete a record's version (%s)", error)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify()
        self.thread.join(TIMEOUT_S * 2)
