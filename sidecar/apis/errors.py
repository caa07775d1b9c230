"""An error answer in the wire API's own format, for what the sidecar itself must refuse or cannot serve.

Harnesses parse their API's error JSON (the SDKs raise typed errors from it); mitmproxy's own HTML error page
would also name internal addresses. OpenAI's APIs (chat, completions, responses) answer
``{"error": {"message", "type", "code"}}``; Anthropic's Messages answers ``{"type": "error", "error": {...}}``.
"""

import json

OPENAI_APIS = ("chat", "completions", "responses")
ANTHROPIC_APIS = ("messages",)

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


def error_type(api: str | None, status: int) -> str:
    openai_type, anthropic_type = ERROR_TYPES.get(status, ("server_error", "api_error"))
    return anthropic_type if api in ANTHROPIC_APIS else openai_type


def error_body(api: str | None, status: int, message: str, code: str | None = None) -> bytes:
    """The JSON body of an error answer for ``api`` (OpenAI's format for an unknown api)."""
    kind = error_type(api, status)
    if api in ANTHROPIC_APIS:
        body: dict = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json.dumps(body, separators=(",", ":")).encode()


def error_headers(api: str | None) -> dict[str, str]:
    """Headers of the error answer (Anthropic's SDK reads ``x-should-retry``; OpenAI's reads the status)."""
    headers = {"content-type": "application/json"}
    if api in ANTHROPIC_APIS:
        headers["x-should-retry"] = "true"
    return headers
