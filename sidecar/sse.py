"""Server-sent events cut out of a byte stream as they complete, so each can be passed on at once, and read as
the JSON chunks every wire API streams.

mitmproxy hands a streaming body over in arbitrary pieces; an event may be split across pieces or several may
share one. Only complete events are rewritten; an unchanged event goes on byte for byte. ``parse_data`` /
``parse_event`` read one event's data the way every streamed API here is read (the ``[DONE]`` sentinel, a JSON
object, vLLM's error chunk), so each module judges a chunk the same way.

Stdlib only: SSE client libraries (sseclient-py, httpx-sse) read a whole response through their own HTTP client
and give parsed events, not the bytes; the sidecar frames mitmproxy's pieces and must pass an event it does not
change on exactly as it came.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar import codec

_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


class EventFramer:
    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        """Append ``data``; return the events it completed, each with its blank-line terminator."""
        self.buffer += data
        events, start = [], 0
        for end in _END.finditer(self.buffer):
            events.append(self.buffer[start : end.end()])
            start = end.end()
        self.buffer = self.buffer[start:]
        return events

    def rest(self) -> bytes:
        """Bytes of an unfinished event (the stream ended inside it)."""
        rest, self.buffer = self.buffer, b""
        return rest


def _split(raw: bytes) -> tuple[list[bytes], bytes, str | None]:
    """An event's lines, its terminator, and its data (the ``data:`` lines joined; None without any)."""
    body = raw.rstrip(b"\r\n")
    lines = re.split(rb"\r\n|\n|\r", body)
    data_lines = [line for line in lines if line.startswith(b"data:")]
    data = (
        "\n".join(line[5:].removeprefix(b" ").decode("utf-8", "replace") for line in data_lines) if data_lines else None
    )
    return lines, raw[len(body) :], data


def event_data(raw: bytes) -> str | None:
    """The data of one complete event (None: it has no ``data:`` line)."""
    return _split(raw)[2]


def rewrite_event(raw: bytes, on_data: Callable[[str], str | None]) -> bytes | None:
    """Run ``on_data`` over an event's data; keep its other fields; None drops the event."""
    lines, terminator, data = _split(raw)
    if data is None:
        return raw
    new = on_data(data)
    if new is None:
        return None
    if new == data:
        return raw
    out, replaced = [], False
    for line in lines:
        if not line.startswith(b"data:"):
            out.append(line)
        elif not replaced:
            out.extend(b"data: " + part.encode() for part in new.split("\n"))
            replaced = True
    return b"\n".join(out) + terminator


DONE = "[DONE]"


@dataclass(frozen=True)
class Chunk:
    """One event's data as a streamed JSON API reads it."""

    data: str | None  # the data (None: the event has no ``data:`` line, e.g. a comment or keep-alive)
    done: bool = False  # the ``[DONE]`` sentinel (Chat Completions, Completions)
    payload: dict[str, Any] | None = None  # the data as a JSON object (None: not one; not ours to judge)

    @property
    def error(self) -> str | None:
        """The message of vLLM's error chunk (``{"error": ...}`` with no ``choices``: a stream that failed)."""
        if self.payload is None or "error" not in self.payload or "choices" in self.payload:
            return None
        failure = self.payload["error"]
        return str(failure.get("message") if isinstance(failure, dict) else failure)


def parse_data(data: str | None) -> Chunk:
    """One event's data (as ``event_data`` gives it) read: the sentinel, a JSON object, or neither."""
    if data is None:
        return Chunk(None)
    if data.strip() == DONE:
        return Chunk(data, done=True)
    try:
        payload = codec.loads(data)
    except ValueError:
        return Chunk(data)
    return Chunk(data, payload=payload if isinstance(payload, dict) else None)


def parse_event(raw: bytes) -> Chunk:
    """One complete event read (see ``parse_data``)."""
    return parse_data(event_data(raw))
