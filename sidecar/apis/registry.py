"""The wire APIs register themselves here (as veRL's advantage estimators do): each module under ``sidecar/apis/``
declares, in one ``Api`` per route, its name, method and paths, how the sidecar serves it, its token-bound fields,
its dialect (error body, model-list shape), and its tokens-in strategy. Everything else in the sidecar asks the
registry; adding an API is one new module (imported by ``sidecar/apis/__init__.py``).
"""

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.apis.base import WireApi

RECORDED, ROUTED, ANSWERED, REFUSED = "recorded", "routed", "answered", "refused"


@dataclass(frozen=True)
class Dialect:
    """A family of APIs that share their error format and model list (OpenAI's, Anthropic's)."""

    name: str
    error_body: Callable[[int, str, str | None], bytes]  # (status, message, code): the sidecar's own refusal
    error_headers: Mapping[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    # An upstream error answer (vLLM speaks OpenAI's format) rewritten in this dialect; None: passed on as it is.
    upstream_error: Callable[[int, str], bytes] | None = None
    # vLLM's (OpenAI-shaped) model list in this dialect, and the request header that says a client speaks it.
    model_list: Callable[[bytes], bytes | None] | None = None
    header: str | None = None


@dataclass(frozen=True)
class Api:
    """One route of a wire API and what the sidecar does with it."""

    name: str
    method: str  # "POST", "GET", or "*" (then ``matches`` decides)
    paths: tuple[str, ...]  # suffixes of the request path (the longest match wins)
    serve: str  # RECORDED (sampled by the policy, recorded) | ROUTED (served by the policy, not recorded) |
    # ANSWERED (by the sidecar, from what it recorded) | REFUSED (by the sidecar, at once)
    dialect: Dialect
    module: WireApi | None = None  # RECORDED: prepares the request and takes the answer back
    max_token_fields: tuple[str, ...] = ()  # the fields that bound the completion (the first is set when none is)
    effective_order: tuple[str, ...] = ()  # where a request sets several, the one the server obeys first
    system_prompt: Callable[[Mapping[str, Any]], list[str]] | None = None  # the texts a harness is known by
    stateful: bool = False  # earlier answers referred to by id (previous_response_id): resolved from the records
    tokens_in: str | None = None  # how tokens-in renders it: "chat" | "responses" (sidecar/continuation.py)
    maps_model: bool = False  # ROUTED with a model name in the body that the model map applies to
    lists_models: bool = False  # ROUTED: the model list, answered in the dialect of the client that asks
    matches: Callable[[str, str], bool] | None = None  # (method, path) -> whether this route is meant, beyond suffixes
    refusal: tuple[int, dict[str, Any], str] | None = None  # REFUSED: the status, JSON body and metric counted
    # ANSWERED: (the sidecar's stored responses, the episode, method, path) -> status and JSON body
    answer: Callable[..., tuple[int, bytes]] | None = None

    def upstream_path(self, path: str) -> str:
        """The path the policy server is sent for a request to ``path``: this route's own (its first path), with the
        request's query. Never the client's own path: a suffix match says nothing of what precedes it, and a path
        such as ``/pause#/v1/messages/count_tokens`` would reach vLLM's admin routes (it drops the ``#...`` part)."""
        _, mark, query = path.partition("?")
        return self.paths[0] + mark + query


REGISTRY: dict[str, Api] = {}


def register(api: Api) -> Api:
    if api.name in REGISTRY:
        raise ValueError(f"wire API {api.name!r} is registered twice")
    if api.serve in (RECORDED, ROUTED) and not (api.paths and api.paths[0].startswith("/v1/")):
        raise ValueError(f"wire API {api.name!r}: its first path is the one the policy server is sent: /v1/...")
    if (api.serve == RECORDED) != (api.module is not None) or (api.serve == RECORDED) != bool(api.max_token_fields):
        raise ValueError(f"wire API {api.name!r}: a recorded API (only) has a module and token-bound fields")
    REGISTRY[api.name] = api
    _api_for_cached.cache_clear()
    return api


def api_for(method: str, path: str) -> str | None:
    """The registered API a request is for: the longest path suffix of its method, else a route's own match."""
    path = path.split("?", 1)[0].rstrip("/")
    # Every call asks: a harness uses a few paths, found once. A long path (an agent's) is not kept: the cache
    # holds at most 4096 paths of at most 256 characters.
    return _api_for_cached(method, path) if len(path) <= 256 else _api_for(method, path)


@functools.lru_cache(maxsize=4096)
def _api_for_cached(method: str, path: str) -> str | None:
    return _api_for(method, path)


def _api_for(method: str, path: str) -> str | None:
    best, length = None, 0
    for api in REGISTRY.values():
        if api.method != method:
            continue
        for suffix in api.paths:
            if len(suffix) > length and path.endswith(suffix):
                best, length = api.name, len(suffix)
    if best is not None:
        return best
    return next((api.name for api in REGISTRY.values() if api.matches and api.matches(method, path)), None)
