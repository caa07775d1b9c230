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

A slow answer is not a failure. vLLM 0.32 answers ``/weight_info`` from its engine core, between two engine steps
(``get_weight_version`` is a utility call into the engine's busy loop), so the answer waits for the step under way.
On a freshly started server the first steps (cold kernels, several harnesses' prompts prefilled together on 2 shared
cores) took over 10 s: the question gave up and the call was recorded with no version (the demo's first round,
issue 25). The call itself would have waited for that same step boundary to be scheduled, so waiting for the
answer costs it at most one step: only connecting is bounded tightly; the answer may take ``ANSWER_TIMEOUT_S``.
A version that stays unknown comes with the reason (``Asked.why``), which the record's note gives.
"""

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import ParseResult

from sidecar.policy import PolicyServerClient, PolicyServerError

log = logging.getLogger("openforge.sidecar")
CONNECT_TIMEOUT_S = 10.0  # a server that does not accept a connection within this is taken as unreachable
ANSWER_TIMEOUT_S = 600.0  # an answer waits for the engine step under way (see above); a harness's call waits as long
FRESH_S = 0.05  # an answer to a question sent at most this long ago stands for a call's version before it is sent
AFTER_WAIT_S = 0.02  # the question after a call waits this long for other calls to end and share it


class Asked(NamedTuple):
    """The answer to a version question: the version, or None and why it is unknown."""

    version: str | None
    why: str | None = None


def version_text(answer: Any) -> str | None:
    version = answer.get("weight_version") if isinstance(answer, dict) else None
    return None if version is None else str(version)


class VersionClock:
    def __init__(self, upstream: ParseResult, complete: Callable[[list[int], str | None], None]) -> None:
        self.upstream = upstream
        self.port = upstream.port or (443 if upstream.scheme == "https" else 80)
        self.complete = complete  # (WAL row ids, the version after their calls) -> None
        # The question after calls, asked from the worker thread (not the hot path: no call waits for it).
        host = upstream.hostname or "127.0.0.1"
        self.after_client = PolicyServerClient(
            f"{upstream.scheme}://{f'[{host}]' if ':' in host else host}:{self.port}",
            timeout=ANSWER_TIMEOUT_S, connect_timeout=ANSWER_TIMEOUT_S,
        )  # fmt: skip
        self.in_flight: asyncio.Future[Asked] | None = None
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

    async def before(self) -> Asked:
        """The server's version now (or why it is unknown): a fresh answer, else a question in flight or a new one."""
        known = self.known
        if known is not None and time.monotonic() - known[0] <= FRESH_S:
            return Asked(known[1])
        if self.in_flight is None or self.in_flight.done():
            self.in_flight = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self.in_flight)

    async def _ask(self) -> Asked:
        why = "not asked"
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
                                                    ssl=self.upstream.scheme == "https" or None), CONNECT_TIMEOUT_S,
                        )  # fmt: skip
                    except ConnectionRefusedError:
                        self.refused = True
                        return Asked(None, "the policy server refused the version question's connection")
                self.refused = False
                version, status = await asyncio.wait_for(self._exchange(*connection), ANSWER_TIMEOUT_S)
                self.idle.append(connection)
                self._learn(asked_at, version)
                if version is None:
                    return Asked(None, f"GET /weight_info answered HTTP {status} with no weight_version")
                return Asked(version)
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as error:
                if connection is not None:
                    connection[1].close()
                waited = time.monotonic() - asked_at
                why = f"the version question failed after {waited:.1f} s ({type(error).__name__}: {error})"
                if attempt == 1 or isinstance(error, TimeoutError):  # a server that did not answer: once is enough
                    return Asked(None, why)
        return Asked(None, why)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str | None, str]:
        writer.write(f"GET /weight_info HTTP/1.1\r\nHost: {self.upstream.netloc}\r\n\r\n".encode())
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.split(":", 1) for line in head[1:] if ":" in line)
        length = int({k.strip().lower(): v.strip() for k, v in headers.items()}.get("content-length", "-1"))
        if length < 0:
            raise ValueError("no content-length")
        body = await reader.readexactly(length)
        status = [*head[0].split(" "), "?", "?"][1]
        return (version_text(json.loads(body)) if status == "200" else None), status

    # -- after: in a worker thread ------------------------------------------------------------------------------
    def after(self, row_id: int) -> None:
        """Ask the version once this call is done, then complete its WAL row. The thread is woken only by the first
        call of a batch (the calls after it join the question to come): no thread switch per call."""
        with self.lock:
            self.waiting.append(row_id)
            if len(self.waiting) == 1:
                self.lock.notify()

    def _after_loop(self) -> None:
        while True:
            with self.lock:
                while not self.waiting and not self.stopped:
                    self.lock.wait()
                if self.stopped and not self.waiting:
                    return
                deadline = time.monotonic() + AFTER_WAIT_S  # the calls ending meanwhile share this question
                while not self.stopped and (left := deadline - time.monotonic()) > 0:
                    self.lock.wait(left)  # woken early only by stop (calls joining the batch do not notify)
                rows, self.waiting = self.waiting, []
            version = None  # asked after every one of these calls was answered: one question serves them all
            for _ in range(2):
                asked_at = time.monotonic()
                try:
                    status, data = self.after_client.request("GET", "/weight_info")
                    version = version_text(json.loads(data)) if status == 200 else None
                    self._learn(asked_at, version)
                    break
                except (PolicyServerError, ValueError):
                    pass
            try:
                self.complete(rows, version)  # every row at once: one WAL statement per question
            except Exception as error:  # the WAL refused: the rows go on without it after their hold
                log.error("could not complete %d records' version (%s)", len(rows), error)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify()
        self.thread.join(CONNECT_TIMEOUT_S * 2)
        if not self.thread.is_alive():  # else it is still asking: its connection goes with the process
            self.after_client.close()
