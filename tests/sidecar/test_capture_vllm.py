"""The real sidecar in front of the real vLLM, driven by the official `openai` SDK: token-exact records."""

import itertools
import json
from typing import Any

import openai
import pytest

from tests.support.policy_server import TOOL_PROMPT, WEATHER_TOOL
from tests.support.sidecar import read_calls, wait_for

pytestmark = pytest.mark.integration

ADDED_KEYS = ("prompt_token_ids", "token_ids")


def client(base_url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="sk-test-not-a-real-key", max_retries=0, timeout=120, **kwargs
    )


def direct(vllm, policy_server, body: dict) -> dict:
    answer = vllm.post("/v1/chat/completions", json={**body, "model": policy_server.name, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("with_tool", [False, True], ids=["text", "tool"])
def test_recorded_ids_are_the_ids_vllm_sampled(start_sidecar, policy_server, vllm, tokenizer, stream, with_tool):
    sidecar = start_sidecar(policy_server.base_url)
    body: dict = {"messages": TOOL_PROMPT if with_tool else [{"role": "user", "content": "Name a colour."}],
                  "max_tokens": 40, "temperature": 0}  # fmt: skip
    if with_tool:
        body["tools"] = [WEATHER_TOOL]
    sdk = client(sidecar.url)
    if stream:
        chunks = list(sdk.chat.completions.create(model="gpt-4o", stream=True, **body))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        tool_args = "".join(
            tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []
        )
        for chunk in chunks:  # none of what the sidecar asked for reaches the harness
            extra = chunk.model_extra or {}
            assert extra.get("prompt_token_ids") is None and not any(
                (c.model_extra or {}).get("token_ids") for c in chunk.choices
            )
            assert all(c.logprobs is None for c in chunk.choices)
        assert all(c.choices for c in chunks), "the usage chunk the sidecar asked for reached the harness"
    else:
        reply = sdk.chat.completions.create(model="gpt-4o", **body)
        text = reply.choices[0].message.content or ""
        tool_args = "".join(tc.function.arguments for tc in reply.choices[0].message.tool_calls or [])
        assert (reply.model_extra or {}).get("prompt_token_ids") is None
        assert (reply.choices[0].model_extra or {}).get("token_ids") is None and reply.choices[0].logprobs is None

    expected = direct(vllm, policy_server, body)
    (call,) = wait_for(lambda: read_calls(sidecar.store), what="the call record")
    assert call["status"] == "ok", call
    assert call["completion_token_ids"] == expected["choices"][0]["token_ids"]
    assert call["prompt_token_ids"] == expected["prompt_token_ids"]
    assert len(call["completion_logprobs"]) == len(call["completion_token_ids"])
    decoded = tokenizer.decode(call["completion_token_ids"], skip_special_tokens=True)
    if with_tool:
        assert expected["choices"][0]["finish_reason"] == "tool_calls"
        assert (
            json.loads(tool_args) == json.loads(decoded.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]
        )
    else:
        assert decoded == text
    assert (call["model_requested"], call["model_served"], call["stream"]) == ("gpt-4o", policy_server.name, stream)
    assert call["api"] == "chat" and call["harness"] == "openai-python"


def test_the_harness_gets_what_vllm_sends_minus_the_added_fields(start_sidecar, policy_server, vllm):
    sidecar = start_sidecar(policy_server.base_url)
    body = {
        "model": policy_server.name,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    through = vllm.post(f"{sidecar.url}/v1/chat/completions", json=body).json()
    plain = vllm.post("/v1/chat/completions", json=body).json()
    for answer in (through, plain):
        answer.pop("id"), answer.pop("created")
    assert through == plain


def test_a_multi_turn_conversation_is_stored_as_references_and_read_back_whole(start_sidecar, policy_server, vllm):
    sidecar = start_sidecar(policy_server.base_url)
    sdk = client(sidecar.url)
    messages: list[Any] = [{"role": "system", "content": "You are terse."}]
    seen_prompts = []
    for question in ("Name a fruit.", "Name another one.", "And a vegetable?", "Thanks. One more?"):
        messages.append({"role": "user", "content": question})
        reply = sdk.chat.completions.create(model="policy", messages=messages, max_tokens=12, temperature=0)
        seen_prompts.append(direct(vllm, policy_server, {"messages": messages, "max_tokens": 1})["prompt_token_ids"])
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    calls = wait_for(lambda: len(read_calls(sidecar.store)) == 4 and read_calls(sidecar.store), what="4 records")
    assert [c["prompt_token_ids"] for c in calls] == seen_prompts
    assert [c["seq"] for c in calls] == [0, 1, 2, 3]
    assert calls[0]["parent_call_id"] is None
    for earlier, later in itertools.pairwise(calls):
        assert later["parent_call_id"] == earlier["call_id"] and later["prefix_len"] > 0
    stored = sum(len(r) for r in _suffixes(sidecar.store))
    assert stored < sum(len(p) for p in seen_prompts) / 2, "prompts were stored whole, not as references"


def _suffixes(store: str) -> list[list[int]]:
    from collector.sql import connect

    return [r[0] for r in connect(store).execute("SELECT prompt_suffix_ids FROM calls_raw").fetchall()]


def test_each_call_records_the_version_the_server_had_when_it_was_served(start_sidecar, policy_server, vllm):
    """No poll window: the call right after a publish is recorded with the new version (asked per call)."""
    sidecar = start_sidecar(policy_server.base_url)
    sdk = client(sidecar.url)
    for version in ("41", "42"):
        assert vllm.post("/update_weight_version", json={"new_version": version}).status_code == 200
        assert _versions_of_next_call(sdk, sidecar) == (version, version)


def _versions_of_next_call(sdk: openai.OpenAI, sidecar) -> tuple[str | None, str | None]:
    before = len(read_calls(sidecar.store))
    sdk.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    calls = wait_for(lambda: len(read_calls(sidecar.store)) > before and read_calls(sidecar.store), what="a record")
    latest = max(calls, key=lambda c: c["started_at"])
    return latest["policy_version"], latest["policy_version_end"]
