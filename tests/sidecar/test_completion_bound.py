"""A completion bound never fails the harness: a request asking more completion tokens than the policy server can
serve (Claude Code asks max_tokens=128000) is lowered to what it can, through the real sidecar (`forge sidecar`,
no flags) against the real vLLM, for every wire API; the record says what was asked and what was served.

vLLM refuses a bound above its context (``max_model_len``) and serves ``min(bound, context - prompt)`` below it:
the sidecar lowers the bound to the context (and to --max-completion-tokens), so the bound served is exactly
``context - prompt length`` (or the cap), known from the recorded prompt ids with no extra round trip.
"""

from typing import Any

import httpx
import pytest

from sidecar.apis import bound_completion
from tests.support.sidecar import read_calls, wait_for

ASKED = 128_000
CASES: dict[str, tuple[str, dict[str, Any], str]] = {  # api: (path, body, the field holding the bound)
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}]}, "max_tokens"),
    "chat-max_completion_tokens": (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "stream": True},
        "max_completion_tokens",
    ),
    "completions": ("/v1/completions", {"prompt": "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"},
                    "max_tokens"),
    "responses": ("/v1/responses", {"input": "Say hi.", "stream": True}, "max_output_tokens"),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Say hi."}], "stream": True},
                 "max_tokens"),
}  # fmt: skip


def test_the_bound_is_lowered_to_the_context_and_the_cap_and_anything_else_is_left_to_the_server():
    body: dict[str, Any] = {"max_tokens": ASKED}
    bound = bound_completion("messages", body, cap=None, context=16384)
    assert body == {"max_tokens": 16384} and (bound.requested, bound.sent) == (ASKED, 16384)
    assert bound.served(prompt_len=1000) == 15384 and bound.served(None) == 16384
    body = {"max_tokens": 100, "max_completion_tokens": 20_000}  # vLLM obeys max_completion_tokens
    bound = bound_completion("chat", body, cap=64, context=16384)
    assert body == {"max_tokens": 64, "max_completion_tokens": 64} and (bound.requested, bound.sent) == (20_000, 64)
    body = {}
    assert bound_completion("responses", body, cap=64, context=None).sent == 64 and body == {"max_output_tokens": 64}
    body = {}
    assert bound_completion("responses", body, cap=0, context=16384).requested is None and body == {}
    for odd in (True, 12.5, -1, None, "many"):  # not ours to judge: the server says what is wrong
        body = {"max_tokens": odd}
        bound_completion("chat", body, cap=None, context=16384)
        assert body == {"max_tokens": odd}


@pytest.mark.parametrize("asked", [128_000.0, "128000", " 128000 "])
def test_an_integral_float_or_a_numeric_string_is_a_bound(asked):
    """vLLM reads them as the integer they spell (pydantic's lax mode): left alone, they would be refused."""
    body: dict[str, Any] = {"max_tokens": asked}
    bound = bound_completion("chat", body, cap=None, context=16384)
    assert body == {"max_tokens": 16384} and (bound.requested, bound.sent) == (ASKED, 16384)
    body = {"max_tokens": 100.0}
    assert bound_completion("chat", body, cap=None, context=16384).requested == 100 and body == {"max_tokens": 100.0}


@pytest.mark.integration
def test_every_wire_api_is_served_when_the_harness_asks_more_than_the_context(start_sidecar, policy_server, vllm):
    refused = vllm.post("/v1/chat/completions", json={"model": policy_server.name, "max_tokens": ASKED,
                                                      **CASES["chat"][1]})  # fmt: skip
    assert refused.status_code == 400 and "max_model_len" in refused.text  # what the harness got before
    sidecar = start_sidecar(policy_server.base_url)  # no flags: the defaults a user starts with
    for name, (path, body, field) in CASES.items():
        answer = httpx.post(f"{sidecar.url}{path}", timeout=300, headers={"x-forge-episode-id": name},
                            json={"model": "claude-sonnet-4-5", "temperature": 0, **body, field: ASKED})  # fmt: skip
        assert answer.status_code == 200, (name, answer.text)
    calls = wait_for(lambda: (c := read_calls(sidecar.store)) and len(c) == len(CASES) and c, what="the records")
    context = policy_server.max_model_len
    for call in calls:
        assert call["status"] == "ok", call["error"]
        assert call["max_tokens_requested"] == ASKED
        assert call["max_tokens_served"] == context - len(call["prompt_token_ids"]) < ASKED  # lowered, said so


@pytest.mark.integration
def test_the_rollout_cap_bounds_what_the_harness_asks(start_sidecar, policy_server):
    sidecar = start_sidecar(policy_server.base_url, extra=("--max-completion-tokens", "5"))
    path, body, field = CASES["messages"]
    answer = httpx.post(f"{sidecar.url}{path}", timeout=300, json={"model": "m", **body, field: ASKED})
    assert answer.status_code == 200 and "max_tokens" in answer.text  # Anthropic's stop_reason: the bound was hit
    (call,) = wait_for(lambda: read_calls(sidecar.store), what="the record")
    assert (call["max_tokens_requested"], call["max_tokens_served"], call["finish_reason"]) == (ASKED, 5, "length")
    assert len(call["completion_token_ids"]) == 5
