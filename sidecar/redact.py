"""Secrets never reach a record or a log: credentials are never copied, and their values are scrubbed from
anything that is (request and response bodies), wherever a harness put them."""

import base64
import binascii
import functools
import json
import os
import re
from typing import Any

SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie", "x-goog-api-key",
     "openai-organization", "openai-project", "x-codex-turn-metadata", "chatgpt-account-id"}
)  # fmt: skip
# Credentials, and the ids that identify a person's installation or device (Codex sends its installation id in
# the body's client_metadata and in x-codex-turn-metadata).
_SECRET_KEY_NAMES = (
    r"(x-codex-)?(api[-_]?key|secret|password|token|access[-_]?token|authorization|installation[-_]?id|device[-_]?id)"
)
SECRET_KEYS = re.compile(rf"(?i)^{_SECRET_KEY_NAMES}$")
REDACTED = "[REDACTED]"
MIN_SECRET_LEN = 6  # shorter values would scrub ordinary words


def configured_secrets() -> list[str]:
    """Values the operator says are secret: FORGE_SECRETS (comma-separated) and the upstream API key."""
    values = [v for v in os.environ.get("FORGE_SECRETS", "").split(",") if v]
    if key := os.environ.get("FORGE_UPSTREAM_API_KEY"):
        values.append(key)
    return values


def secrets_in_headers(headers: Any) -> list[str]:
    """Credential values a request carries (whole header values, bearer tokens, basic-auth passwords)."""
    found = []
    # mitmproxy's Headers: the raw (name, value) byte pairs are read far faster than its multidict view.
    pairs = (
        ((n.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for n, v in headers.fields)
        if hasattr(headers, "fields")
        else headers.items()
    )
    for name, value in pairs:
        if name.lower() not in SECRET_HEADERS or not value:
            continue
        found.append(value)
        if name.lower() == "x-codex-turn-metadata":
            found += _ids_in_json(value)
        scheme, _, credential = value.partition(" ")
        if credential:
            found.append(credential)
            if scheme.lower() == "basic":
                try:
                    _user, _, password = (
                        base64.b64decode(credential, validate=True).decode("utf-8", "replace").partition(":")
                    )
                    found.append(password)  # the user name is the episode id in regular mode: not a secret
                except (binascii.Error, ValueError):
                    pass
    return found


def _ids_in_json(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if not isinstance(value, dict):
        return []
    return [str(v) for k, v in value.items() if SECRET_KEYS.match(str(k)) and v]


def secrets_in_body(body: dict[str, Any]) -> list[str]:
    """Identifying ids a harness puts in its request metadata (Codex: ``client_metadata``)."""
    found: list[str] = []
    for field in ("client_metadata", "metadata"):
        metadata = body.get(field)
        if not isinstance(metadata, dict):
            continue
        for key, value in metadata.items():
            if SECRET_KEYS.match(str(key)) and value:
                found.append(str(value))
            elif isinstance(value, str) and value.startswith("{"):
                found += _ids_in_json(value)
    return found


def scrub_text(text: str, secrets: list[str]) -> str:
    # JSON text may spell a secret with escapes (\u0073k-..., \/): decoded, it is the secret. The slower
    # escape-aware match runs only for a secret holding a character that the text escapes somewhere.
    escaped = _escaped_chars(text) if "\\" in text else set()
    for secret in sorted({s for s in secrets if len(s) >= MIN_SECRET_LEN}, key=len, reverse=True):
        if "\\" in text and (not escaped.isdisjoint(secret) or not secret.isascii()):
            text = _escaped_form(secret).sub(REDACTED, text)
        else:
            text = text.replace(secret, REDACTED)
    return text


_ASCII_ESCAPE = re.compile(r"\\u(00[2-7][0-9a-fA-F])")  # printable ASCII written as \u00XX (rare: fast to look for)


def _escaped_chars(text: str) -> set[str]:
    """Characters the text writes escaped; a non-ASCII one may be, always (a secret holding one takes the regex)."""
    chars = {chr(int(code, 16)) for code in set(_ASCII_ESCAPE.findall(text))}
    chars.update(char for char in '"\\/' if "\\" + char in text)
    return chars


@functools.lru_cache(maxsize=1024)
def _escaped_form(secret: str) -> re.Pattern[str]:
    """The secret, each character as itself or as any JSON escape of it."""
    parts = []
    for char in secret:
        options = [re.escape(char), rf"\\u(?i:{ord(char):04x})"] if ord(char) < 0x10000 else [re.escape(char)]
        if char in '"\\/':
            options.append(re.escape("\\" + char))
        parts.append(f"(?:{'|'.join(options)})")
    return re.compile("".join(parts))


def scrub_json(value: Any) -> Any:
    """A copy of a JSON value with secret-named keys' values replaced."""
    if isinstance(value, dict):
        return {k: REDACTED if SECRET_KEYS.match(str(k)) and v else scrub_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_json(v) for v in value]
    return value


def redacted_json(value: Any, secrets: list[str]) -> str:
    return scrub_text(json.dumps(scrub_json(value), ensure_ascii=False, separators=(",", ":")), secrets)


_SECRET_KEY_TEXT = re.compile(rf'(?i)"{_SECRET_KEY_NAMES}"\s*:')


def redacted_text(text: str, secrets: list[str]) -> str:
    """``redacted_json`` for JSON text, parsing it only when it names a secret-looking key (the hot path)."""
    if _SECRET_KEY_TEXT.search(text):
        try:
            return redacted_json(json.loads(text), secrets)
        except ValueError:
            pass
    return scrub_text(text, secrets)
