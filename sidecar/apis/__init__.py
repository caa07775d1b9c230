"""The wire APIs the sidecar understands, found from the request's method and path (``registry.api_for``).

Each module registers its routes (``sidecar/apis/registry.py``): ``openai`` (``chat``, ``completions``, the
``models`` list), ``responses`` (``responses``; ``responses_socket``: Codex's WebSocket upgrade on GET
/v1/responses, refused at once so it falls back to POST; ``responses_stored``: GET/DELETE /v1/responses/{id}, GET
.../input_items, answered from the answers this episode was served, ``sidecar/response_store.py``), ``messages``
(``messages``; ``count_tokens``, which vLLM answers). Importing this package registers them all.
"""

from dataclasses import dataclass
from typing import Any

from sidecar.apis import messages, openai, responses  # each registers its routes
from sidecar.apis.base import WireApi
from sidecar.apis.registry import RECORDED, REGISTRY, Api, api_for

__all__ = ["REGISTRY", "Api", "api_for", "messages", "openai", "responses"]

# Each recorded module as a WireApi: mypy checks every one against the contract (``register`` takes it as a module).
CONTRACT: tuple[WireApi, ...] = (openai, responses, messages)
# The request fields that bound the completion's length, per recorded API (the first is set when none is given).
MAX_TOKEN_FIELDS = {api.name: api.max_token_fields for api in REGISTRY.values() if api.serve == RECORDED}
# Request fields of vLLM's own that no OpenAI or Anthropic client sends and that steer its internals: the prompt
# (prompt ids given through kv_transfer_params, another chat template, no generation prompt), the prefix cache
# (cache_salt: the sidecar's per-version salt), scheduling, request ids, custom processors. The harness's are
# dropped before the sidecar adds its own (vLLM 0.32's ChatCompletionRequest/CompletionRequest/ResponsesRequest).
INTERNAL_FIELDS = frozenset({
    "kv_transfer_params", "ec_transfer_params", "cache_salt", "priority", "vllm_xargs", "request_id",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "mm_processor_kwargs", "media_io_kwargs", "mm_payload", "return_mm_kwargs", "routed_experts_prompt_start",
    "return_tokens_as_token_ids", "truncate_prompt_tokens", "truncation_side", "stream_interval",
})  # fmt: skip


def drop_internal_fields(body: dict[str, Any]) -> list[str]:
    """Remove (in place) the fields of ``INTERNAL_FIELDS`` a request carries; their names."""
    dropped = sorted(INTERNAL_FIELDS.intersection(body))
    for name in dropped:
        del body[name]
    return dropped


def spec(api: str) -> Api:
    """What the registry says of ``api`` (a name ``api_for`` gave)."""
    return REGISTRY[api]


def module_for(api: str) -> WireApi:
    module = REGISTRY[api].module
    if module is None:
        raise ValueError(f"{api} is not a recorded API")
    return module


@dataclass
class CompletionBound:
    """How a call's completion length was bounded: what the harness asked, and what the policy server was sent.

    vLLM (0.32, ``get_max_tokens``) serves ``min(max_tokens, context - prompt)`` for any ``max_tokens`` up to its
    context (``max_model_len``), and refuses anything above it. So a request is never refused for its bound once the
    bound is at most the context: the sidecar lowers it there (and to ``--max-completion-tokens``), with no extra
    round trip and no tokenizing; the bound the call was served with is ``served(prompt_len)``, exact once the
    prompt's ids are known.
    """

    requested: int | None  # the harness's own bound (the field the server obeys); None: it set none
    sent: int | None  # the bound the policy server was sent; None: none (the server's default, context - prompt)
    context: int | None  # the policy server's context (max_model_len); None: not known

    def served(self, prompt_len: int | None) -> int | None:
        """The bound the call was served with: the one sent, and the room the prompt left in the context."""
        room = self.context - prompt_len if self.context is not None and prompt_len is not None else None
        bounds = [b for b in (self.sent, room) if b is not None]
        return min(bounds) if bounds else None


def _bound(value: object) -> int | None:
    """A completion bound as vLLM reads it (pydantic's lax integer: 100, 100.0, "100", " 100 ", "100.0"); None when
    the value is not one (the server judges it)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        whole, _, fraction = value.strip().partition(".")
        try:
            return int(whole) if not fraction.strip("0") else None
        except ValueError:
            return None
    return None


def _effective(api: str, body: dict[str, Any]) -> int | None:
    """The bound the server obeys: the first integer field in its order of precedence."""
    values = (_bound(body.get(name)) for name in REGISTRY[api].effective_order or MAX_TOKEN_FIELDS[api])
    return next((value for value in values if value is not None), None)


def bound_completion(api: str, body: dict[str, Any], cap: int | None, context: int | None) -> CompletionBound:
    """Lower (in place) each completion-length field above what the policy can serve: the server's context and the
    rollout's ``cap`` (``--max-completion-tokens``). A field that is not an integer, or not positive, is left for
    the server to judge; with a cap and no field, the first field is set to the cap."""
    fields = MAX_TOKEN_FIELDS[api]
    requested = _effective(api, body)
    limit = min((b for b in (cap, context) if b), default=None)
    if limit is not None:
        for name in fields:
            value = _bound(body.get(name))
            if value is not None and value > limit:
                body[name] = limit
        if requested is None and cap:
            body[fields[0]] = limit
    return CompletionBound(requested=requested, sent=_effective(api, body), context=context)
