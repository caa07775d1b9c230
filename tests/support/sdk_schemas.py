"""Strict validation of wire answers against the official SDKs' own types (openai-python, anthropic-sdk-python).

The SDKs' models accept anything extra (``extra="allow"``) and coerce what they can, so an answer that "parses"
says little. Here the raw JSON is validated with pydantic in strict mode (no coercion: a string where a number
belongs fails), every required field must be there, and then the parsed value is walked: any field the SDK's
model lacks is an error, at every depth, with its path.

The one exception is the policy server's own additions (``POLICY_SERVER_FIELDS``, vLLM 0.32): fields OpenAI's
API does not have, that vLLM writes in every answer whether or not anyone asks. They are the policy server's
answer, not the sidecar's, and the sidecar passes them on as vLLM wrote them; each is allowed only by name on its
own model and only empty (null, 0, ``[]``, ``{}``): what vLLM writes there when not asked. So the sidecar's own
additions (the token ids, logprobs and rendered messages it asks vLLM for) showing through fail here too. Two carry
a value by design, checked for its type (``VALUED_FIELDS``): chat's ``stop_reason`` (vLLM: the stop string or token
id that ended the answer) and ``name`` on ``response.function_call_arguments.done`` (in OpenAI's OpenAPI spec for
that event, not yet in openai-python's type).
"""

import json
import typing
from typing import Any

import pydantic
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

# What each wire API answers, whole and per stream event.
WHOLE: dict[str, Any] = {"chat": ChatCompletion, "responses": Response, "messages": Message}
EVENT: dict[str, Any] = {
    "chat": ChatCompletionChunk,
    "responses": ResponseStreamEvent,
    "messages": RawMessageStreamEvent,
}

_VLLM_CHAT = {"prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params"} | {
    "metrics"
}
_VLLM_CHOICE = {"stop_reason", "token_ids", "routed_experts"}
# Model class name → the vLLM fields it may carry (empty). vLLM's chat message also has ``reasoning`` (a reasoning
# model's thinking); SmolLM2 has none, so here it is always null.
POLICY_SERVER_FIELDS: dict[str, set[str]] = {
    "ChatCompletion": _VLLM_CHAT,
    "Choice": _VLLM_CHOICE,  # chat's whole choice and a chunk's choice alike
    "ChatCompletionMessage": {"reasoning"},
    "ChatCompletionChunk": _VLLM_CHAT,
    "ChoiceDelta": {"reasoning"},
    "Response": {"presence_penalty", "frequency_penalty", "kv_transfer_params", "ec_transfer_params"}
    | {"input_messages", "output_messages"},
    "InputTokensDetails": {"cache_write_tokens", "input_tokens_per_turn", "cached_tokens_per_turn"},
    "OutputTokensDetails": {"tool_output_tokens", "output_tokens_per_turn", "tool_output_tokens_per_turn"},
}
EMPTY: tuple[Any, ...] = (None, 0, [], {})
VALUED_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "Choice": {"stop_reason": (str, int, type(None))},
    "ResponseFunctionCallArgumentsDoneEvent": {"name": (str,)},
}


class NotConformant(AssertionError):
    """An answer or event that is not what the official SDK's type describes."""


def check(kind: Any, raw: str | bytes, where: str = "$") -> Any:
    """Validate one JSON document against an SDK type (``WHOLE[api]`` or ``EVENT[api]``), strictly; the parsed
    value. Raises ``NotConformant`` naming every problem. A stream event is checked against the member of the
    union its ``type`` names (the SDKs' discriminator), so a wrong field is named, not 200 union members'."""
    member = member_for(kind, raw)
    if member is None:
        raise NotConformant(f"{where}: its type is none of the stream's event types\n{_short(raw)}")
    kind = member
    try:
        value = pydantic.TypeAdapter(kind).validate_json(raw, strict=True)
    except pydantic.ValidationError as error:
        raise NotConformant(f"{where}: not a {_name(kind)}: {error}\n{_short(raw)}") from None
    problems = list(extra_fields(value, where))
    if problems:
        raise NotConformant(f"{where}: not a {_name(kind)}: " + "; ".join(problems) + f"\n{_short(raw)}")
    return value


def member_for(kind: Any, raw: str | bytes) -> Any | None:
    """The union member whose ``type`` literal is the document's ``type`` (None: no member has it); ``kind`` itself
    when it is no union of models."""
    members = [
        m for m in typing.get_args(_unannotated(kind)) if isinstance(m, type) and issubclass(m, pydantic.BaseModel)
    ]
    if not members:
        return kind
    try:
        name = json.loads(raw).get("type")
    except (ValueError, AttributeError):
        return None
    for member in members:
        field = member.model_fields.get("type")
        if field is not None and name in typing.get_args(field.annotation):
            return member
    return None


def _unannotated(kind: Any) -> Any:
    return typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind


def extra_fields(value: Any, where: str = "$") -> list[str]:
    """Every field the SDK's models lack, at any depth (the policy server's own, empty, excepted)."""
    problems: list[str] = []
    if isinstance(value, pydantic.BaseModel):
        model = type(value).__name__
        allowed = POLICY_SERVER_FIELDS.get(model, set())
        valued = VALUED_FIELDS.get(model, {})
        for name, extra in (value.model_extra or {}).items():
            if name in valued:
                if not isinstance(extra, valued[name]) or isinstance(extra, bool):
                    problems.append(f"{where}.{name}: not a {' or '.join(t.__name__ for t in valued[name])}: {extra!r}")
            elif name not in allowed:
                problems.append(f"{where}.{name}: no such field in {model}")
            elif extra not in EMPTY:
                problems.append(f"{where}.{name}: the policy server's field, but not empty: {extra!r}")
        for name, field in type(value).model_fields.items():
            problems += extra_fields(getattr(value, name), f"{where}.{field.alias or name}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            problems += extra_fields(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            problems += extra_fields(item, f"{where}.{key}")
    return problems


def _name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind).split("[", 1)[0]


def _short(raw: str | bytes, limit: int = 600) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    return text if len(text) <= limit else text[:limit] + "..."
