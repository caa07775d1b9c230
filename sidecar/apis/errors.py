"""An error answer in the wire API's own format, for what the sidecar itself must refuse or cannot serve.

Harnesses parse their API's error JSON (the SDKs raise typed errors from it); mitmproxy's own HTML error page
would also name internal addresses. OpenAI's APIs (chat, completions, responses) answer
``{"error": {"message", "type", "code"}}``; Anthropic's Messages answers ``{"type": "error", "error": {...}}``.
"""

import json

from sidecar.apis.registry import REGISTRY, Dialect

# Status → (OpenAI type, Anthropic type), as the real services name them.
ERROR_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    502: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
    504: ("server_error", "api_error"),
}


def openai_error(status: int, message: str, code: str | None = None) -> bytes:
    """OpenAI's error body (chat, completions, responses, and any API the registry does not know)."""
    kind = ERROR_TYPES.get(status, ("server_error", "api_error"))[0]
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json.dumps(body, separators=(",", ":")).encode()


def anthropic_error(status: int, message: str, code: str | None = None) -> bytes:
    """Anthropic's error body (Messages); it has no code."""
    kind = ERROR_TYPES.get(status, ("server_error", "api_error"))[1]
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}, separators=(",", ":")).encode()


def dialect_of(api: str | None) -> Dialect:
    known = REGISTRY.get(api or "") or REGISTRY.get("chat")
    assert known is not None, "sidecar.apis registers its modules on import"
    return known.dialect


def error_body(api: str | None, status: int, message: str, code: str | None = None) -> bytes:
    """The JSON body of an error answer for ``api``, in its dialect (OpenAI's for an unknown api)."""
    return dialect_of(api).error_body(status, message, code)


def error_headers(api: str | None) -> dict[str, str]:
    """Headers of the error answer (Anthropic's SDK reads ``x-should-retry``; OpenAI's reads the status)."""
    return dict(dialect_of(api).error_headers)
