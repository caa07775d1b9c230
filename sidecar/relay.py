"""The relay: a model call's answer on its way back to the harness, and its record.

A streamed answer is relayed one SSE event at a time through the wire API's stream state (which gathers the ids and
hides what we added); a whole answer goes through its ``finish``. Either way the call's record is logged before
the harness gets the end of its answer (delivered means recorded). Records of whole answers that end in the same
turn of the event loop share one WAL transaction (group commit). The row itself is built by
``record.call_row``; here is what around it has state: the episode's prompt and request prefixes, the version
question after the call, the metrics.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from mitmproxy import http

from sidecar import __version__ as SIDECAR_VERSION
from sidecar import apis, codec
from sidecar.apis.base import Sampled
from sidecar.call import Call, moved_note, note_of
from sidecar.metrics import Metrics
from sidecar.prefix import PrefixIndex
from sidecar.record import call_row, checked_row, pack_ids
from sidecar.redact import redacted_json, redacted_text, scrub_text
from sidecar.replicas import Replica
from sidecar.request_delta import RequestDelta, RequestIndex
from sidecar.sse import EventFramer
from sidecar.writer import RecordWriter, now_us

log = logging.getLogger("openforge.sidecar")


class Relay:
    """Answers back to the harness, records into the WAL."""

    def __init__(self, metrics: Metrics, after_call: Callable[[Replica, int], None]) -> None:
        self.metrics = metrics
        self.after_call = after_call  # the version question once a call's row is logged (routing.Router.clock)
        self.writer: RecordWriter | None = None
        self.sidecar_id = ""
        self.secrets: list[str] = []
        self.policy_version: str | None = None  # fixed by --policy-version; else asked per call
        self.prefixes = PrefixIndex()
        self.requests = RequestIndex()
        self.in_flight: dict[str, tuple[http.HTTPFlow, Call]] = {}  # calls begun, not yet recorded
        # Records of whole answers waiting for their group commit: (call, row, probe, status, done).
        self.staged: list[tuple[Call, dict[str, Any], bool, str, asyncio.Future[int | None]]] = []

    def stream(self, flow: http.HTTPFlow, call: Call) -> None:
        """An SSE answer (``responseheaders``): relayed live, one event at a time, through the API's stream state."""
        assert call.added is not None and flow.response is not None
        call.stream = call.added.stream_state()
        call.framer = EventFramer()
        flow.response.stream = lambda data: self.on_stream_data(flow, call, data)

    def on_stream_data(self, flow: http.HTTPFlow, call: Call, data: bytes) -> list[bytes]:
        """One piece of the upstream's SSE body in; what the harness gets now out (never held past an event)."""
        assert call.framer is not None and call.stream is not None and call.added is not None
        if call.stream_failed:  # our code broke on this stream earlier: pass the rest on untouched
            return [] if call.added.upstream_path else [data]
        pending = call.framer.buffer + data  # what the harness has not got yet, should we fail on this piece
        try:
            if data == b"":  # end of the body
                rest = call.framer.rest()
                if not call.recorded:
                    self.record(
                        flow, call, status="ok" if call.stream.done else "truncated", sampled=call.stream.sampled
                    )
                return [rest] if rest else []
            out = []
            for event in call.framer.feed(data):
                if call.first_token_at is None:
                    call.first_token_at = now_us()
                rewritten = call.stream.feed_event(event)
                if call.stream.done and not call.recorded:
                    # Logged before the final event reaches the harness: delivered means recorded.
                    self.record(flow, call, status="ok", sampled=call.stream.sampled)
                out += rewritten
            return out
        except Exception as error:  # never break the stream because recording failed
            self.internal_error("stream", error)
            call.stream_failed = True
            if not call.recorded:
                call.error = f"recording failed mid-stream ({type(error).__name__}); the rest passed on unread"
                try:
                    self.record(flow, call, status="error")
                except Exception as again:
                    self.internal_error("stream record", again)
            if call.added.upstream_path:  # a translated stream cannot go on raw: end it with the API's error
                return [call.added.error_event("the proxy failed while translating this stream")]
            return [pending]

    async def answer(self, flow: http.HTTPFlow, call: Call) -> None:
        """A call's answer is in (``response`` hook): a whole one is finished and its record committed with the
        calls that end in the same turn of the event loop; a streamed one was recorded as it went."""
        call.group = []
        self.finish(flow, call)
        group, call.group = call.group, None
        if group:
            await self.commit(call, *group[0])

    def finish(self, flow: http.HTTPFlow, call: Call) -> None:
        response = flow.response
        assert response is not None
        if call.stream is not None:  # streamed: recorded at [DONE] or at the end of the body
            return
        if response.status_code >= 400:
            text = response.get_text(strict=False) or ""
            upstream = scrub_text(text[:2000], call.secrets)
            call.error = f"{call.error}; upstream said: {upstream}" if call.error else upstream
            self.record(flow, call, status="upstream_error")
            rewrite = apis.spec(call.api).dialect.upstream_error
            if rewrite is not None and call.added is not None:  # the harness asked in its own format (Anthropic's)
                response.content = rewrite(response.status_code, text)
            return
        if call.added is None:
            self.record(flow, call, status="error")
            return
        try:
            answer = codec.loads(response.get_content(strict=True) or b"")
        except ValueError:
            call.error = "the upstream's answer is not JSON"
            self.record(flow, call, status="error")
            return
        sampled, answer = call.added.finish(answer)
        call.first_token_at = int((response.timestamp_start or time.time()) * 1e6)
        data = codec.dumps(answer)
        self.record(flow, call, status="ok", sampled=sampled, response_json=redacted_text(data.decode(), call.secrets))
        response.content = data

    def record(
        self, flow: http.HTTPFlow, call: Call, status: str, sampled: Sampled | None = None,
        response_json: str | None = None,
    ) -> None:  # fmt: skip
        call.recorded = True
        self.in_flight.pop(call.call_id, None)
        assert self.writer is not None
        if sampled is not None and sampled.upstream_error and status in ("ok", "truncated"):
            status, call.error = "upstream_error", scrub_text(sampled.upstream_error, call.secrets)
        if sampled is not None and status == "ok" and (sampled.prompt_ids is None or not sampled.completion_ids):
            status, call.error = "error", "the upstream returned no token ids"
        if status == "ok" and (gather_error := getattr(call.stream, "gather_error", None)):
            status, call.error = "error", f"ids not gathered: {gather_error}"
        if sampled is not None and (problem := sampled.problem()):  # -inf/misaligned logprobs: never silent
            status, call.error = (
                ("error", problem) if status == "ok" else (status, "; ".join(filter(None, [call.error, problem])))
            )
        if sampled is not None and sampled.n_choices > 1:
            call.error = f"n={sampled.n_choices}: only choice 0 is recorded"
        prompt = pack_ids(sampled.prompt_ids) if sampled and sampled.prompt_ids is not None else None
        completion = pack_ids(sampled.completion_ids) if sampled else None
        parent, prefix_len = (None, 0)
        if prompt is not None:
            parent, prefix_len = self.prefixes.split(call.episode_id, prompt)
            if status == "ok" and completion is not None:
                self.prefixes.remember(call.episode_id, call.call_id, prompt + completion)
        if response_json is None and call.stream is not None:
            response_json = redacted_json(call.stream.summary(), call.secrets)
        version, version_end = call.policy_version, self.policy_version or None
        served_by = sampled.model if sampled else None
        if served_by is not None and served_by != call.policy_model:  # the server-wide version is not its version
            version = version_end = None
            self.metrics.inc("calls_not_served_by_policy_total")
            call.version_why = f"served by {served_by!r}, not the policy {call.policy_model!r}"
        unknown = f"version unknown: {call.version_why}" if version is None and call.version_why else None
        if unknown and status == "ok":
            self.metrics.inc("calls_version_unknown_total")
        request = (
            self.requests.split(call.episode_id, call.request_json)
            if call.request_json is not None
            else RequestDelta(None, 0, 0, "")
        )
        row = call_row(
            call, status, sampled, prompt=prompt, completion=completion, parent=parent, prefix_len=prefix_len,
            request=request, response_json=response_json, version=version, version_end=version_end,
            note=note_of(call.continuation, moved_note(call, "; ".join(
                filter(None, [sampled.note if sampled else None, unknown])) or None)),
            http_status=flow.response.status_code if flow.response else None, finished_at=now_us(),
            sidecar_id=self.sidecar_id, sidecar_version=SIDECAR_VERSION,
        )  # fmt: skip
        # The version as the call ends is asked off the event loop (vLLM answers between engine steps): the row
        # is logged now and held in the WAL until the answer completes it (at most writer.HOLD_S).
        probe = version is not None and not self.policy_version and call.replica is not None
        checked = checked_row("calls", row)
        if call.group is not None:  # a whole answer: committed with the calls that end with it (``commit``)
            call.group.append((checked, probe, status))
            return
        self.logged(call, status, probe, self.writer.append("calls", checked, hold=probe))

    async def commit(self, call: Call, row: dict[str, Any], probe: bool, status: str) -> None:
        """Group commit: the records of whole answers whose hooks run in one turn of the event loop share one WAL
        transaction; each hook waits for it, so the harness gets no byte of an answer before its record is committed.
        A call alone (nothing else in flight) is committed at once, without waiting for the next turn."""
        assert self.writer is not None
        if not self.staged and not self.in_flight:  # nothing could end with it
            self.logged(call, status, probe, self.writer.append("calls", row, hold=probe))
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int | None] = loop.create_future()
        if not self.staged:
            loop.call_soon(self.commit_staged)
        self.staged.append((call, row, probe, status, done))
        row_id = await done
        self.logged(call, status, probe, row_id)

    def commit_staged(self) -> None:
        """Commit every staged record in one transaction and wake their hooks (an error: each hook's own)."""
        staged, self.staged = self.staged, []
        if not staged:
            return
        try:
            assert self.writer is not None
            results = self.writer.append_many([("calls", row, probe) for _, row, probe, _, _ in staged])
        except Exception as error:
            results = [error] * len(staged)
        for (*_, done), result in zip(staged, results, strict=True):
            if not done.done():
                done.set_exception(result) if isinstance(result, Exception) else done.set_result(result)

    def logged(self, call: Call, status: str, probe: bool, row_id: int | None) -> None:
        """What follows a call's record in the WAL (committed, or dropped at the disk bound: None)."""
        if row_id is not None:
            if call.moved_from is not None:
                self.metrics.inc("replica_moves_total")
            if call.request_json is not None:
                self.requests.remember(call.episode_id, call.call_id, call.request_json)
            self.metrics.inc(f'calls_total{{status="{status}"}}')
            if probe and call.replica is not None:
                self.after_call(call.replica, row_id)

    def internal_error(self, where: str, error: Exception) -> None:
        self.metrics.inc("internal_errors_total")
        log.error("recording failed in %s (%s: %s); the call went on unrecorded", where, type(error).__name__,
                  scrub_text(str(error), self.secrets))  # fmt: skip
