"""What every wire API module gives the addon: the token-level view of an answer, and how it is gathered.

The contract is ``WireApi`` (a ``typing.Protocol``; each module registers itself as one, so mypy checks
every module against it). Each module (``openai`` for Chat Completions and Completions, ``responses``,
``messages``) has the same surface:

- ``prepare_request(api, body) -> Served``: change the upstream request in place so vLLM returns the sampled ids
  and logprobs; its ``Additions`` (a ``Served``) say what was added (to take exactly that out again) and, where
  the call is served through another endpoint, which path (``upstream_path``). They carry the rest:
- ``added.finish(answer) -> (Sampled, answer)``: a whole answer in; its ids out, and the answer the harness gets.
- ``added.stream_state()`` (a ``StreamState``; most are a ``DataStream``): ``feed_event(raw)`` takes one complete
  SSE event and returns the events to send on now; ``done`` is set when the answer is complete (the record is
  written before that event goes on); ``sampled``.
- ``added.error_event(message)``: the end of a stream in the API's own terms, when it cannot go on.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from sidecar import codec
from sidecar.sse import rewrite_event

# vLLM writes a logprob it does not have, and -inf, as max(x, -9999.0) (chat's field default is -9999.0 too),
# Completions a missing one as null, and NaN logits pass through as NaN. None of these is a sampled token's
# logprob (a token at or below -9999 nats is never sampled).
VLLM_LOGPROB_FLOOR = -9999.0


@dataclass
class Sampled:
    """The token-level view of one answer (choice 0): what the record keeps."""

    prompt_ids: list[int] | None = None
    completion_ids: list[int] = field(default_factory=list)
    # One per completion id: the behaviour logprob; NaN where the upstream gives none by design (the record's
    # ``note`` says why); -inf where it gave an invalid one (``problem`` turns the call into an error).
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    response_id: str | None = None
    n_choices: int = 0
    note: str | None = None  # what the record must say about these ids (e.g. logprobs the upstream did not give)
    error: str | None = None  # the ids and logprobs cannot be trusted as recorded (e.g. not alignable): why
    upstream_error: str | None = None  # the upstream ended the answer with an error (a failed stream): its words

    def problem(self) -> str | None:
        """Why this answer cannot be recorded as ``ok`` (None: it can). Invalid logprobs become NaN (unknown)."""
        if self.error:
            return self.error
        invalid = [i for i, value in enumerate(self.logprobs) if value == -math.inf]
        if invalid:
            self.logprobs = [math.nan if value == -math.inf else value for value in self.logprobs]
            shown = ", ".join(map(str, invalid[:10])) + (", ..." if len(invalid) > 10 else "")
            return (
                f"the upstream gave no valid logprob (null, -inf/{VLLM_LOGPROB_FLOOR:g} or NaN) for {len(invalid)} "
                f"of {len(self.logprobs)} sampled ids, at completion position(s) {shown}"
            )
        if len(self.logprobs) != len(self.completion_ids):
            given = len(self.logprobs)
            self.logprobs = [math.nan] * len(self.completion_ids)
            return f"{given} logprobs for {len(self.completion_ids)} completion ids: they cannot be aligned"
        return None


def logprob(value: Any) -> float:
    """A sampled token's logprob as vLLM wrote it; anything that is not one (null, vLLM's -9999.0 floor, NaN, a
    non-number) is kept as -inf, never a crash, and ``Sampled.problem`` reports it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return -math.inf
    value = float(value)
    return value if math.isfinite(value) and value > VLLM_LOGPROB_FLOOR else -math.inf


def clear(obj: dict[str, Any], key: str, value: Any = None) -> bool:
    """Set a key vLLM added back to what it writes when not asked (it always writes these keys); True if changed."""
    if key in obj and obj[key] != value:
        obj[key] = value
        return True
    return False


@dataclass
class Prepared:
    """What each wire API's ``Additions`` begin with: which API it is served as, and whether the harness streams."""

    api: str
    stream: bool


class StreamState(Protocol):
    """One streamed answer being passed on: each event fed in turn, then what the addon reads of it."""

    def feed_event(self, raw: bytes) -> list[bytes]: ...
    @property
    def done(self) -> bool: ...
    @property
    def sampled(self) -> Sampled: ...
    def summary(self) -> dict[str, Any]: ...


class Served(Protocol):
    """What a wire API added to one request (its ``Additions``), and how the answer is taken back."""

    @property
    def api(self) -> str: ...
    @property
    def stream(self) -> bool: ...
    @property
    def upstream_path(self) -> str | None: ...
    def finish(self, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]: ...
    def stream_state(self) -> StreamState: ...
    def error_event(self, message: str) -> bytes: ...


class WireApi(Protocol):
    """A wire API module (``sidecar.apis.openai``, ``responses``, ``messages``)."""

    def prepare_request(self, api: str, body: dict[str, Any]) -> Served: ...


class DataStream:
    """A stream state whose events are rewritten one ``data:`` payload at a time, by ``on_event``."""

    def on_event(self, data: str) -> str | None:
        raise NotImplementedError

    def feed_event(self, raw: bytes) -> list[bytes]:
        out = rewrite_event(raw, self.on_event)
        return [out] if out is not None else []


def compact(obj: Any) -> str:
    return codec.dumps_text(obj)


def text_of(content: Any) -> str:
    """The text of a message's content: a string, or the ``text`` of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(text for part in content if isinstance(part, dict) and isinstance(text := part.get("text"), str))
    return ""
