"""OpenAI Chat Completions and Completions as vLLM serves them: ask for the sampled ids, record them, hide them.

The upstream request gains ``return_token_ids``, ``logprobs`` and, when streaming, ``stream_options.include_usage``;
the answer the harness gets loses exactly what those added (the ids, the logprobs, the usage chunk) unless the
harness asked for them itself. Everything else is the upstream's, byte for byte where nothing was removed.
"""

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.apis.base import DataStream, Prepared, Sampled, clear, compact, logprob, text_of
from sidecar.apis.errors import openai_error
from sidecar.apis.registry import RECORDED, ROUTED, Api, Dialect, register
from sidecar.sse import Chunk, parse_data

CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
COMPLETIONS_PATHS = ("/v1/completions", "/completions")


@dataclass
class Additions(Prepared):
    """What the sidecar added to a request, so it can take exactly that out of the answer."""

    harness_ids: bool  # the harness asked for return_token_ids itself
    harness_logprobs: bool
    harness_usage: bool  # streaming: the harness asked for the usage chunk
    upstream_path: str | None = None  # served as it came

    def finish(self, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
        return finish(self, answer)

    def stream_state(self) -> "StreamState":
        return StreamState(self)

    def error_event(self, message: str) -> bytes:
        """vLLM's own way to end a stream that failed."""
        return (
            f"data: {compact({'error': {'message': message, 'type': 'InternalServerError', 'code': 500}})}\n\n".encode()
        )


def prepare_request(api: str, body: dict[str, Any]) -> Additions:
    """Add what token-exact recording needs to ``body`` (in place)."""
    stream = bool(body.get("stream"))
    added = Additions(
        api=api,
        stream=stream,
        harness_ids=bool(body.get("return_token_ids")),
        harness_logprobs=body.get("logprobs") not in (None, False),
        harness_usage=bool((body.get("stream_options") or {}).get("include_usage")),
    )
    body["return_token_ids"] = True
    if not added.harness_logprobs:
        body["logprobs"] = True if api == "chat" else 0  # completions: 0 = the sampled token's logprob only
    if stream:
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return added


def strip_choice(choice: dict[str, Any], added: Additions) -> None:
    if not added.harness_ids:
        clear(choice, "token_ids")
        clear(choice, "prompt_token_ids")
    if not added.harness_logprobs:
        clear(choice, "logprobs")


def strip_response(answer: dict[str, Any], added: Additions) -> None:
    """Undo in a whole (non-streamed) answer what ``prepare_request`` made the upstream add."""
    if not added.harness_ids:
        clear(answer, "prompt_token_ids")
    for choice in answer.get("choices") or []:
        strip_choice(choice, added)


def choice_logprobs(api: str, choice: dict[str, Any]) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    if api == "chat":
        return [logprob(entry.get("logprob")) for entry in logprobs.get("content") or []]
    return [logprob(x) for x in logprobs.get("token_logprobs") or []]


def sampled_from_response(api: str, answer: dict[str, Any]) -> Sampled:
    choices = answer.get("choices") or []
    first = next((c for c in choices if c.get("index", 0) == 0), choices[0] if choices else {})
    prompt_ids = answer.get("prompt_token_ids") or first.get("prompt_token_ids")
    return Sampled(
        prompt_ids=list(prompt_ids) if prompt_ids is not None else None,
        completion_ids=list(first.get("token_ids") or []),
        logprobs=choice_logprobs(api, first),
        finish_reason=first.get("finish_reason"),
        usage=answer.get("usage"),
        model=answer.get("model"),
        response_id=answer.get("id"),
        n_choices=len(choices),
    )


def finish(added: Additions, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
    sampled = sampled_from_response(added.api, answer)
    strip_response(answer, added)
    return sampled, answer


class StreamState(DataStream):
    """Gathers ids and logprobs from SSE chunks and strips them from each chunk on its way to the harness."""

    def __init__(self, added: Additions) -> None:
        self.added = added
        self.sampled = Sampled()
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.done = False  # saw [DONE]

    def on_event(self, data: str) -> str | None:
        """One SSE ``data:`` payload in; the payload to send on (None: drop the event)."""
        return self.on_chunk(parse_data(data))

    def on_chunk(self, parsed: Chunk) -> str | None:
        """``on_event`` for a payload already read (``sse.parse_data``)."""
        data, chunk = parsed.data or "", parsed.payload
        if parsed.done:
            self.done = True
            return data
        if chunk is None:
            return data  # not ours to judge: pass it on as it came
        self._gather(chunk)
        if parsed.error is not None:  # vLLM ends a failed stream with an error event
            self.sampled.upstream_error = f"the stream ended with an error event: {parsed.error}"
            return data
        if not self.added.harness_usage and not chunk.get("choices") and chunk.get("usage") is not None:
            return None  # the usage chunk exists only because we asked for it
        if not self.added.harness_ids:
            clear(chunk, "prompt_token_ids")
        for choice in chunk.get("choices") or []:
            strip_choice(choice, self.added)
        return compact(chunk)

    def _gather(self, chunk: dict[str, Any]) -> None:
        sampled = self.sampled
        sampled.model = sampled.model or chunk.get("model")
        sampled.response_id = sampled.response_id or chunk.get("id")
        if chunk.get("prompt_token_ids") is not None:
            sampled.prompt_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            sampled.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            sampled.n_choices = max(sampled.n_choices, choice.get("index", 0) + 1)
            if choice.get("index", 0) != 0:
                continue
            if choice.get("prompt_token_ids") is not None and sampled.prompt_ids is None:
                sampled.prompt_ids = list(choice["prompt_token_ids"])
            sampled.completion_ids += choice.get("token_ids") or []
            sampled.logprobs += choice_logprobs(self.added.api, choice)
            if choice.get("finish_reason"):
                sampled.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            piece = delta.get("content") if self.added.api == "chat" else choice.get("text")
            if piece:
                self.text.append(piece)
            for call in delta.get("tool_calls") or []:
                slot = self.tool_calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
                slot["id"] = slot["id"] or call.get("id")
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""

    def summary(self) -> dict[str, Any]:
        """The streamed answer reassembled, for ``response_json``."""
        out: dict[str, Any] = {
            "stream": True,
            "model": self.sampled.model,
            "finish_reason": self.sampled.finish_reason,
        }
        out["text" if self.added.api == "completions" else "content"] = "".join(self.text)
        if self.tool_calls:
            out["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return out


def system_prompt(body: Mapping[str, Any]) -> list[str]:
    """The system (or developer) message a chat request opens with."""
    messages = body.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    return [text_of(first.get("content"))] if isinstance(first, dict) and first.get("role") in SYSTEM_ROLES else []


SYSTEM_ROLES = ("system", "developer")
DIALECT = Dialect("openai", openai_error)
MODEL_LIST_PATHS = ("/v1/models", "/models")
# vLLM's chat obeys max_completion_tokens where a request sets both.
register(Api("chat", "POST", CHAT_PATHS, RECORDED, DIALECT, module=sys.modules[__name__], system_prompt=system_prompt,
             max_token_fields=("max_tokens", "max_completion_tokens"),
             effective_order=("max_completion_tokens", "max_tokens"), tokens_in="chat"))  # fmt: skip
register(Api("completions", "POST", COMPLETIONS_PATHS, RECORDED, DIALECT, module=sys.modules[__name__],
             max_token_fields=("max_tokens",)))  # fmt: skip
# The model list: served by the policy, in the dialect of the client that asks (sidecar/addon.py).
register(Api("models", "GET", MODEL_LIST_PATHS, ROUTED, DIALECT, lists_models=True))
