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
- after: a task on the event loop asks for every call answered before its question was sent, then completes their
  WAL rows. It waits ``AFTER_WAIT_S`` after a call ends so the calls ending meanwhile share one question (one
  client's consecutive calls, many clients): a publish in that instant marks them as straddling it (conservative).
  No call waits for it. (It was a worker thread: its Python work contended with the event loop for the GIL and
  cost every call ~0.07 ms at the median under one client, measured against a fixed ``--policy-version``; on the
  loop the cost was within noise of none. ``bench/README.md``, issue 24.)

A slow answer is not a failure. vLLM 0.32 answers ``/weight_info`` from its engine core, between two engine steps
(``get_weight_version`` is a utility call into the engine's busy loop), so the answer waits for the step under way.
On a freshly started server the first steps (cold kernels, several harnesses' prompts prefilled together on 2 shared
cores) took over 10 s: the question gave up and the call was recorded with no version (the demo's first round,
issue 25). The call itself would have waited for that same step boundary to be scheduled, so waiting for the
answer costs it at most one step: only connecting is bounded tightly; the answer may take ``ANSWER_TIMEOUT_S``.
A version that stays unknown comes with the reason (``Asked.why``), which the record's note gives.
"""

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import ParseResult

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
        self.in_flight: asyncio.Future[Asked] | None = None
        self.refused = False  # the last question before a call found the server refusing connections (it is down)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.waiting: list[int] = []  # WAL rows of calls answered since the last question after calls was sent
        self.asking: list[int] = []  # WAL rows whose question after is out
        self.closing = False  # ``settle`` began: no question after calls is asked any more
        self.after_task: asyncio.Task[None] | None = None
        self.known: tuple[float, str] | None = None  # (when its question was sent, monotonic; the version)
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop its questions run on (``stop``)
        self.stopped = False

    # -- before: on the event loop ------------------------------------------------------------------------------
    def _learn(self, asked_at: float, version: str | None) -> None:
        if version is not None and (self.known is None or asked_at >= self.known[0]):
            self.known = (asked_at, version)

    async def before(self) -> Asked:
        """The server's version now (or why it is unknown): a fresh answer, else a question in flight or a new one."""
        known = self.known
        if known is not None and time.monotonic() - known[0] <= FRESH_S:
            return Asked(known[1])
        if self.in_flight is None or self.in_flight.done():
            self.in_flight = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self.in_flight)

    async def _ask(self, before: bool = True) -> Asked:
        """One question on a kept-alive connection (or a new one). ``before``: a call waits for it, and a refused
        connection marks the server as down for routing (``refused``); the question after calls never does."""
        why = "not asked"
        self.loop = asyncio.get_running_loop()
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
                        if before:
                            self.refused = True
                        return Asked(None, "the policy server refused the version question's connection")
                if before:
                    self.refused = False
                version, status = await asyncio.wait_for(self._exchange(*connection), ANSWER_TIMEOUT_S)
                if self.stopped:  # ``stop`` closed the pool meanwhile
                    connection[1].close()
                else:
                    self.idle.append(connection)
                self._learn(asked_at, version)
                if version is None:
                    return Asked(None, f"GET /weight_info answered HTTP {status} with no weight_version")
                return Asked(version)
            except asyncio.CancelledError:  # shutdown gave up on it: its connection goes, not back to the pool
                if connection is not None:
                    connection[1].close()
                raise
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

    # -- after: a task on the event loop -----------------------------------------------------------------------
    def after(self, row_id: int) -> None:
        """Ask the version once this call is done, then complete its WAL row (called on the event loop, as the
        call's record is logged). The calls that end before the question is sent share it: one task, no call
        waits. Once ``settle`` began (shutdown), a call's version after stays unknown: no question is left to come."""
        if self.closing:
            self._complete([row_id], None)
            return
        self.waiting.append(row_id)
        if self.after_task is None or self.after_task.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop (not the addon's way): the version stays unknown, the row goes on
                log.warning("no event loop to ask the version after %d calls: it stays unknown", len(self.waiting))
                rows, self.waiting = self.waiting, []
                self._complete(rows, None)
                return
            self.after_task = loop.create_task(self._after())

    async def _after(self) -> None:
        try:
            while self.waiting:  # once ``settle`` began nothing joins: the rows there are asked for, then it ends
                if not self.closing:
                    await asyncio.sleep(AFTER_WAIT_S)  # the calls ending meanwhile share this question
                rows, self.waiting = self.waiting, []
                self.asking = rows  # ``settle`` releases them should this question not be answered in time
                try:
                    asked = await self._ask(before=False)  # sent after every one of these calls was answered
                except Exception as error:  # never left unanswered: the rows go on, the version unknown
                    log.error("the version question after %d calls failed (%s)", len(rows), error)
                    asked = Asked(None)
                if self.asking is rows:  # else ``settle`` released them meanwhile
                    self.asking = []
                    self._complete(rows, asked.version)
        finally:
            if self.after_task is asyncio.current_task():
                self.after_task = None

    def _complete(self, rows: list[int], version: str | None) -> None:
        try:
            self.complete(rows, version)  # every row at once: one WAL statement per question
        except Exception as error:  # the WAL refused: the rows go on without it after their hold
            log.error("could not complete %d records' version (%s)", len(rows), error)

    async def settle(self, timeout_s: float) -> None:
        """Shutdown: the calls already answered get the version after them (one last question, at most
        ``timeout_s``); calls that end from now on, and rows whose question is not answered in time, go on with it
        unknown, released at once (nothing is left to complete them while the WAL closes)."""
        self.closing = True  # the task asks for the calls it has (after its pause), then ends
        task = self.after_task
        if task is not None and not (await asyncio.wait({task}, timeout=timeout_s))[0]:
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)
        rows = self.asking + self.waiting
        self.asking, self.waiting = [], []
        if rows:
            self._complete(rows, None)

    def stop(self) -> None:
        """Close the kept-alive connections (an unfinished question after calls is left to ``settle``). Safe from
        any thread: a replica DNS no longer lists is forgotten by the poller's."""
        self.stopped = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the sockets go with it
                loop.call_soon_threadsafe(self._close_idle)

    def _close_idle(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()
