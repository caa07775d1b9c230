"""Which harness made a call: every harness's signature, and where its quirks are handled, in one table.

A user agent alone mislabels harnesses built on an SDK (mini-swe-agent and smolagents send openai-python's,
OpenClaw openai-node's). So a call is attributed, first match wins, from:
1. the operator: ``FORGE_HARNESS`` in the sidecar's environment (in a pod, from its ``openforge.io/harness``
   annotation through the downward API) names the harness of every call;
2. what the harness says of itself: a user-agent fragment or a header only it sends;
3. the request's shape: the start of its system prompt (Chat ``system``/``developer`` message, Responses
   ``instructions`` or first developer/system item, Messages ``system``);
4. the SDK's user agent (``openai-python``, ``openai-node``, ``litellm``, ...): a client not known better;
5. ``other`` (a user agent nobody claims), or None (no user agent and no other sign).

Each harness's quirks, and the module that handles them (tests/sidecar/golden holds, per harness, a request as the
real harness sent it, redacted, beside what the policy server receives):
- claude-code: ``max_tokens: 128000`` (lowered: ``apis.bound_completion``); a per-call billing line in
  ``system[0]`` and a ``system`` role inside ``messages`` (``apis.messages``).
- codex: tools in an ``additional_tools`` input item, ``custom`` tools with a grammar (``apis.responses``); an
  installation id in ``client_metadata`` and headers (``redact``).
- mini-swe-agent, smolagents: plain Chat Completions through openai-python; nothing to rewrite.
- openclaw: tool-call ids rewritten between turns (its prompts fork; the collector reports it).
- qwen-code: Chat through openai-node with its own user agent; side calls (a memory-extraction subagent) under
  the same user agent, with another system prompt: conversations of their own (segments of their own).
- pi: its SDK's user agent on every API (openai-node, anthropic-node): known by its system prompt. Chat:
  ``store: false``, ``max_completion_tokens``; Responses: ``prompt_cache_key`` and a ``session_id`` header;
  Messages: ``cache_control`` on the user's text and an ``anthropic-beta`` header.
- opencode: Chat through the AI SDK's openai-compatible provider, ``max_tokens: 32000`` (``apis.bound_completion``);
  a title-generation side call with another system prompt.
- crush: known by its user agent only (``Charm-Crush/<version>``, from its source; its npm package fetches its
  binary from GitHub at install, which this machine cannot reach: no captured request).
- openai-agents (the OpenAI Agents SDK, Python ``Agents/Python``, JavaScript ``Agents/JavaScript``): Responses with
  ``instructions`` and ``include``; ``store`` left to the API's default (true), so a tool loop refers to earlier
  items by id (``apis.responses``); the JavaScript SDK resends its tool calls by value.
- the Vercel AI SDK (``ai-sdk``, a client known by its SDK): Responses by default (``openai(model)``), Chat with
  ``openai.chat``, Messages with ``@ai-sdk/anthropic`` (``max_tokens: 4096`` for an unknown model).
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar import apis

ENV = "FORGE_HARNESS"
SYSTEM_WINDOW = 400  # a signature is looked for in this many leading characters of the system prompt


@dataclass(frozen=True)
class Signature:
    name: str
    user_agents: tuple[str, ...] = ()  # lower-case fragments of its own user agent
    headers: tuple[str, ...] = ()  # header names only it sends
    system: tuple[str, ...] = ()  # phrases near the start of its default system prompt


HARNESSES = (
    Signature("claude-code", user_agents=("claude-cli", "claude-code"), system=("You are Claude Code",)),
    Signature("codex", user_agents=("codex_exec", "codex_cli", "codex-tui", "codex/"), headers=("originator",),
              system=("You are Codex",)),
    Signature("openclaw", user_agents=("openclaw",), system=("You are a personal assistant running inside OpenClaw",)),
    Signature("mini-swe-agent", user_agents=("mini-swe-agent",),
              system=("You are a helpful assistant that can interact with a computer",)),
    Signature("smolagents", user_agents=("smolagents",),
              system=("You are an expert assistant who can solve any task using",)),
    Signature("qwen-code", user_agents=("qwencode/",), system=("You are Qwen Code",)),
    Signature("pi", system=("operating inside pi, a coding agent harness",)),
    Signature("opencode", user_agents=("opencode/",), system=("You are opencode",)),
    Signature("crush", user_agents=("charm-crush/",)),
    Signature("openai-agents", user_agents=("agents/python", "agents/javascript")),
)  # fmt: skip
SDKS = (  # (user-agent fragment, client): a client known only by its SDK
    ("litellm", "litellm"),
    ("ai-sdk-provider-utils/", "ai-sdk"),  # the Vercel AI SDK 7 (ai/7.x ai-sdk-provider-utils/5.x)
    ("ai-sdk/provider-utils/", "ai-sdk"),  # earlier AI SDKs, and harnesses built on them that do not say more
    ("openai/python", "openai-python"),
    ("openai/js", "openai-node"),
    ("anthropic/python", "anthropic-python"),
    ("anthropic/js", "anthropic-node"),
    ("curl/", "curl"),
)
_SIGNED_HEADERS = {"originator": ("codex_exec", "codex_cli_rs", "codex_vscode")}  # header: values that sign it


def system_prompt(api: str, body: Mapping[str, Any]) -> str:
    """The leading characters of a request's system prompt, whatever the wire API (its module says where it is)."""
    known = apis.REGISTRY.get(api)
    texts = known.system_prompt(body) if known and known.system_prompt else apis.openai.system_prompt(body)
    return "\n".join(texts)[:SYSTEM_WINDOW]


def detect(
    api: str, headers: Mapping[str, str], body: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The harness of one call (see the module's docstring for the order of the evidence)."""
    if named := environ.get(ENV, "").strip():
        return named
    user_agent = (headers.get("user-agent") or "").lower()
    for harness in HARNESSES:
        if any(fragment in user_agent for fragment in harness.user_agents):
            return harness.name
        for header in harness.headers:
            if (headers.get(header) or "").lower() in _SIGNED_HEADERS.get(header, ()):
                return harness.name
    if body is not None:
        system = system_prompt(api, body)
        for harness in HARNESSES:
            if any(phrase in system for phrase in harness.system):
                return harness.name
    if not user_agent:
        return None
    return next((client for fragment, client in SDKS if fragment in user_agent), "other")
