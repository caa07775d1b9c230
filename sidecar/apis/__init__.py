"""The wire APIs the sidecar understands, found from the request's method and path.

Recorded (model calls): ``chat``, ``completions`` (module ``openai``), ``responses``, ``messages``.
Served from the policy but not recorded (no sampling): ``count_tokens`` (Anthropic, vLLM answers it),
``models`` (the model list; in Anthropic's format when the harness speaks Anthropic).
Answered by the sidecar itself: ``responses_socket`` (Codex's WebSocket upgrade on GET /v1/responses: refused
at once, so it falls back to POST).
"""

from types import ModuleType

from sidecar.apis import messages, openai, responses

RECORDED = {"chat": openai, "completions": openai, "responses": responses, "messages": messages}
MODEL_LIST_PATHS = ("/v1/models", "/models")
# The request fields that bound the completion's length, per API (the first is set when none is given).
MAX_TOKEN_FIELDS = {
    "chat": ("max_tokens", "max_completion_tokens"), "completions": ("max_tokens",),
    "responses": ("max_output_tokens",), "messages": ("max_tokens",),
}  # fmt: skip


def api_for(method: str, path: str) -> str | None:
    path = path.split("?", 1)[0].rstrip("/")
    if method == "POST":
        if api := openai.api_for_path(path):
            return api
        if path.endswith(responses.PATHS):
            return "responses"
        if path.endswith(messages.COUNT_TOKENS_PATHS):
            return "count_tokens"
        if path.endswith(messages.PATHS):
            return "messages"
    elif method == "GET":
        if path.endswith(MODEL_LIST_PATHS):
            return "models"
        if path.endswith(responses.PATHS):
            return "responses_socket"
    return None


def module_for(api: str) -> ModuleType:
    return RECORDED[api]


def cap_completion_tokens(api: str, body: dict, cap: int) -> bool:
    """Bound the completion to ``cap`` tokens (a rollout's response length); True if the request changed."""
    fields = MAX_TOKEN_FIELDS[api]
    changed = False
    for name in fields:
        value = body.get(name)
        if isinstance(value, int) and value > cap:
            body[name], changed = cap, True
    if not any(isinstance(body.get(name), int) for name in fields):
        body[fields[0]], changed = cap, True
    return changed
