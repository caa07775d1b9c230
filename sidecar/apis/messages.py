"""Anthropic Messages (Claude Code's API), served through vLLM's Chat Completions so the sampled ids come back.

vLLM's own ``/v1/messages`` returns no token ids, so the sidecar translates the request to ``/v1/chat/completions``
the way vLLM's Anthropic layer does (``vllm/entrypoints/anthropic/serving.py``: the same system, content-block,
tool and tool-result mapping, so the prompt ids equal what ``/v1/messages/render`` gives), asks for ids and
logprobs there, and translates the answer back: a ``message`` object, or the full event sequence
(``message_start``, ``ping``, ``content_block_start/delta/stop``, ``message_delta``, ``message_stop``).

Normalised the same way on every call, so that a conversation's prompts extend each other:
- Claude Code's per-request ``x-anthropic-billing-header`` line in ``system`` is dropped (it changes every call);
- a ``system`` role inside ``messages`` stays where it is, as a system message (this chat template allows it);
- ``thinking`` and ``output_config.effort`` are ignored (SmolLM2 has no reasoning mode), ``metadata``,
  ``service_tier`` and cache-control markers are dropped; server tools without an ``input_schema`` are dropped.
"""

import json
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.apis import openai
from sidecar.apis.base import Prepared, Sampled, compact
from sidecar.apis.errors import anthropic_error
from sidecar.apis.registry import RECORDED, ROUTED, Api, Dialect, register
from sidecar.sse import parse_event

PATHS = ("/v1/messages", "/messages")
COUNT_TOKENS_PATHS = ("/v1/messages/count_tokens", "/messages/count_tokens")
CHAT_PATH = "/v1/chat/completions"
BILLING_PREFIX = "x-anthropic-billing-header"


@dataclass
class Additions(Prepared):
    """A Messages call served as chat: what the chat request gained, and Anthropic's stop sequences."""

    chat: openai.Additions  # what the chat request gained (ids, logprobs, usage chunk)
    stop_sequences: list[str]
    upstream_path: str | None = CHAT_PATH

    def finish(self, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
        return finish(self, answer)

    def stream_state(self) -> "StreamState":
        return StreamState(self)

    def error_event(self, message: str) -> bytes:
        return error_event(message)


class TranslationError(ValueError):
    """A Messages request that cannot be expressed as a chat request (the call goes to vLLM's /v1/messages)."""


def _text_of_system(content: Any) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING_PREFIX) else content
    parts = [
        block["text"]
        for block in content or []
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
        and block["text"] and not block["text"].startswith(BILLING_PREFIX)
    ]  # fmt: skip
    return "".join(parts) if parts else None


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    return str(source.get("url", ""))


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(
        item.get("text", "") for item in content or [] if isinstance(item, dict) and item.get("type") == "text"
    )


def _convert_message(message: dict[str, Any], out: list[dict[str, Any]]) -> None:
    role = message.get("role")
    content = message.get("content")
    if role == "system":
        text = _text_of_system(content)
        if text:
            out.append({"role": "system", "content": text})
        return
    converted: dict[str, Any] = {"role": role}
    if isinstance(content, str):
        converted["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        tool_calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for block in content or []:
            kind = block.get("type")
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and block.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
            elif kind == "thinking" and block.get("thinking") is not None:
                reasoning.append(block["thinking"])
            elif kind == "tool_use":
                tool_calls.append({
                    "id": block.get("id") or "", "type": "function",
                    "function": {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})},
                })  # fmt: skip
            elif kind == "tool_result":
                if role == "user":  # a tool message of its own, before the rest of this user turn
                    out.append({
                        "role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                        "content": _tool_result_text(block.get("content")),
                    })  # fmt: skip
                else:
                    parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
        if reasoning:
            converted["reasoning"] = "".join(reasoning)
        if tool_calls:
            converted["tool_calls"] = tool_calls
        if len(parts) == 1 and parts[0]["type"] == "text":
            converted["content"] = parts[0]["text"]
        elif parts:
            converted["content"] = parts
    if not (role == "user" and "content" not in converted):
        out.append(converted)


def to_chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions request vLLM's Anthropic layer would build from this Messages request."""
    if not isinstance(body.get("messages"), list):
        raise TranslationError("a Messages request needs a 'messages' list")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = _text_of_system(system)
        if text:
            messages.append({"role": "system", "content": text})
    for message in body["messages"]:
        if not isinstance(message, dict):
            raise TranslationError("each message must be an object")
        _convert_message(message, messages)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for ours, theirs in (("max_tokens", "max_tokens"), ("stop", "stop_sequences"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("top_k", "top_k")):  # fmt: skip
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if body.get("stream"):
        chat["stream"] = True
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("disable_parallel_tool_use") is not None:
            chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
        kind = choice.get("type")
        if kind in ("auto", "none"):
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    tools = [
        {"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"), "parameters": tool["input_schema"],
        }}
        for tool in body.get("tools") or [] if isinstance(tool, dict) and tool.get("input_schema") is not None
    ]  # fmt: skip
    if tools:
        chat["tools"] = tools
        chat.setdefault("tool_choice", "auto")
    return chat


def prepare_request(api: str, body: dict[str, Any]) -> Additions:
    """Replace ``body`` (in place) by the chat request that serves it, with ids and logprobs asked for."""
    chat = to_chat_request(body)
    stop = list(body.get("stop_sequences") or [])
    body.clear()
    body.update(chat)
    return Additions(api=api, stream=bool(chat.get("stream")), chat=openai.prepare_request("chat", body),
                     stop_sequences=stop)  # fmt: skip


def _stop_reason(finish_reason: str | None, stop_reason: Any, tool_used: bool) -> tuple[str | None, str | None]:
    """OpenAI finish reason → Anthropic (stop_reason, stop_sequence), as vLLM's Anthropic layer maps it."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _usage(usage: dict[str, Any] | None, prompt_len: int | None = None) -> dict[str, int]:
    usage = usage or {}
    input_tokens = usage.get("prompt_tokens")
    return {
        "input_tokens": int(input_tokens if input_tokens is not None else prompt_len or 0),
        "output_tokens": int(usage.get("completion_tokens") or 0),
    }


def message_id(chat_id: str | None) -> str:
    return "msg_" + (chat_id or uuid.uuid4().hex).removeprefix("chatcmpl-")


def _tool_input(arguments: str | None) -> dict[str, Any]:
    """A ``tool_use`` block's ``input``: always an object (the API's type); arguments that are not a JSON object
    (any JSON or none: the policy wrote them) are kept as their text under one key."""
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"_raw_arguments": arguments}


def finish(added: Additions, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
    """A whole chat answer in; its ids, and the Anthropic ``message`` the harness gets."""
    sampled = openai.sampled_from_response("chat", answer)
    choices = answer.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("reasoning"):
        content.append({"type": "thinking", "thinking": message["reasoning"], "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": _tool_input(function.get("arguments"))})  # fmt: skip
    if not content:
        content.append({"type": "text", "text": ""})
    stop_reason, stop_sequence = _stop_reason(
        choice.get("finish_reason"), choice.get("stop_reason"), bool(message.get("tool_calls"))
    )
    sampled.response_id = message_id(answer.get("id"))
    return sampled, {
        "id": sampled.response_id, "type": "message", "role": "assistant", "model": answer.get("model"),
        "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": _usage(answer.get("usage")),
    }  # fmt: skip


def error_body(status: int, upstream_text: str) -> bytes:
    """An upstream (chat) error in Anthropic's error format."""
    try:
        detail = json.loads(upstream_text)
        message = (detail.get("error") or {}).get("message") or detail.get("message") or upstream_text
    except (ValueError, AttributeError):
        message = upstream_text
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            529: "overloaded_error"}.get(status, "api_error")  # fmt: skip
    return compact({"type": "error", "error": {"type": kind, "message": str(message)}}).encode()


def _event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {compact(payload)}\n\n".encode()


def error_event(message: str) -> bytes:
    """A stream's end in Anthropic's own terms, when it cannot go on."""
    return _event("error", {"type": "error", "error": {"type": "api_error", "message": message}})


class StreamState:
    """Chat-completion chunks in (ids gathered by the chat stream state), Anthropic events out, one for one."""

    def __init__(self, added: Additions) -> None:
        self.added = added
        self.chat = openai.StreamState(added.chat)
        self.started = False
        self.block: str | None = None  # type of the open content block
        self.index = -1
        self.tool_ids: dict[int, str] = {}
        self.tool_used = False
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.gather_error: str | None = None  # set when the ids could not be gathered (the record says so)

    @property
    def sampled(self) -> Sampled:
        sampled = self.chat.sampled
        if sampled.response_id and not sampled.response_id.startswith("msg_"):
            sampled.response_id = message_id(sampled.response_id)
        return sampled

    def feed_event(self, raw: bytes) -> list[bytes]:
        parsed = parse_event(raw)
        if not parsed.data:
            return []
        try:
            self.chat.on_chunk(parsed)  # gathers ids, logprobs, usage, text, tool calls
        except Exception as error:  # recording broke: the harness still gets its translated stream
            self.gather_error = self.gather_error or f"{type(error).__name__}: {error}"
        if parsed.done:
            self.done = True
            return self._close()
        chunk = parsed.payload
        if chunk is None:
            return []
        if parsed.error is not None:
            return [error_event(parsed.error)]
        out: list[bytes] = []
        if not self.started:
            self.started = True
            prompt = self.chat.sampled.prompt_ids
            out.append(_event("message_start", {"type": "message_start", "message": {
                "id": message_id(chunk.get("id")), "type": "message", "role": "assistant", "model": chunk.get("model"),
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(prompt) if prompt is not None else 0, "output_tokens": 0},
            }}))  # fmt: skip
            out.append(_event("ping", {"type": "ping"}))
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                out += self._open("thinking", {"type": "thinking", "thinking": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
            if delta.get("content"):
                out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                slot = call.get("index", 0)
                if call.get("id") and self.tool_ids.get(slot) != call["id"]:
                    self.tool_ids[slot] = call["id"]
                    self.tool_used = True
                    block = {"type": "tool_use", "id": call["id"], "name": function.get("name") or "", "input": {}}
                    out += self._open("tool_use", block, force=True)
                if function.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def _open(self, kind: str, block: dict[str, Any], force: bool = False) -> list[bytes]:
        if self.block == kind and not force:
            return []
        out = self._stop_block()
        self.index += 1
        self.block = kind
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))  # fmt: skip
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def _stop_block(self) -> list[bytes]:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.block = None
        return out

    def _close(self) -> list[bytes]:
        out = []
        if self.index < 0:  # an empty completion still has one (empty) text block
            out += self._open("text", {"type": "text", "text": ""})
        out += self._stop_block()
        stop_reason, stop_sequence = _stop_reason(self.finish_reason or "stop", self.stop_reason, self.tool_used)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = {"output_tokens": _usage(self.usage)["output_tokens"]}
        out.append(_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return out

    def summary(self) -> dict[str, Any]:
        return {**self.chat.summary(), "translated_from": "chat"}


def model_list(openai_list: bytes) -> bytes | None:
    """vLLM lists models in OpenAI's shape; an Anthropic client gets Anthropic's (None: not a model list)."""
    try:
        listed = json.loads(openai_list or b"")["data"]
        data = [
            {"type": "model", "id": m.get("id"), "display_name": m.get("id"),
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.get("created") or 0))}
            for m in listed
        ]  # fmt: skip
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return json.dumps(
        {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
         "last_id": data[-1]["id"] if data else None}
    ).encode()  # fmt: skip


def system_prompt(body: Mapping[str, Any]) -> list[str]:
    """The system blocks' texts, but for Claude Code's billing header."""
    system = body.get("system")
    blocks = system if isinstance(system, list) else [{"text": system}] if isinstance(system, str) else []
    texts = [t for b in blocks if isinstance(b, dict) and isinstance(t := b.get("text"), str)]
    return [t for t in texts if not t.startswith(BILLING_PREFIX)]


DIALECT = Dialect("anthropic", anthropic_error, {"content-type": "application/json", "x-should-retry": "true"},
                  upstream_error=error_body, model_list=model_list, header="anthropic-version")  # fmt: skip
register(Api("messages", "POST", PATHS, RECORDED, DIALECT, module=sys.modules[__name__], tokens_in="chat",
             max_token_fields=("max_tokens",), system_prompt=system_prompt))  # fmt: skip
# Served by the policy (vLLM answers it), not recorded; the requested model name is mapped as for a call.
register(Api("count_tokens", "POST", COUNT_TOKENS_PATHS, ROUTED, DIALECT, maps_model=True))
