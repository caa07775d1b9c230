"""What every wire API module gives the addon: the token-level view of an answer, and how it is gathered.

Each module (``openai`` for Chat Completions and Completions, ``responses``, ``messages``) has the same surface:

- ``prepare_request(api, body) -> Additions``: change the upstream request in place so vLLM returns the sampled ids
  and logprobs; the ``Additions`` say what was added (to take exactly that out again) and, where the call is
  served through another endpoint, which path (``upstream_path``).
- ``finish(added, answer) -> (Sampled, answer)``: a whole answer in; its ids out, and the answer the harness gets.
- ``StreamState(added)`` (most are a ``DataStream``): ``feed_event(raw)`` takes one complete SSE event and returns
  the events to send on now; ``done`` is set when the answer is complete (the record is written before that
  event goes on); ``sampled``.
"""

import json
import math
from dataclasses import dataclass, field
from typing import Any

from sidecar.sse import rewrite_event


@dataclass
class Sampled:
    """The token-level view of one answer (choice 0): what the record keeps."""

    prompt_ids: list[int] | None = None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    model: str | None = None
    response_id: str | None = None
    n_choices: int = 0
    note: str | None = None  # what the record must say about these ids (e.g. logprobs the upstream did not give)


def logprob(value: Any) -> float:
    """A logprob as vLLM wrote it; null (it writes -inf as null) is kept as -inf, never a crash."""
    return float(value) if value is not None else -math.inf


def clear(obj: dict[str, Any], key: str, value: Any = None) -> bool:
    """Set a key vLLM added back to what it writes when not asked (it always writes these keys); True if changed."""
    if key in obj and obj[key] != value:
        obj[key] = value
        return True
    return False


class DataStream:
    """A stream state whose events are rewritten one ``data:`` payload at a time, by ``on_event``."""

    def on_event(self, data: str) -> str | None:
        raise NotImplementedError

    def feed_event(self, raw: bytes) -> list[bytes]:
        out = rewrite_event(raw, self.on_event)
        return [out] if out is not None else []


def compact(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
