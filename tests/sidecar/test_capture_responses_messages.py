"""OpenAI Responses and Anthropic Messages through the real sidecar to the real vLLM, driven by the official SDKs.

How a test knows the recorded ids are the ids vLLM sampled (greedy, so a second computation must agree):
- Responses: the same request sent straight to vLLM with ``enable_response_messages`` gives the same prompt and
  output token ids; the recorded logprobs are the ones vLLM gives there.
- Messages: vLLM's own Anthropic layer renders the request (``/v1/messages/render``) to exactly the recorded
  prompt ids, and greedy tokens-in generation from those ids (``/v1/completions``) gives exactly the recorded
  completion ids.
"""

import json
import math
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.sidecar import read_calls, wait_for

pytestmark = pytest.mark.integration

SYSTEM = (
    "You can call one tool: get_weather(city). To call it, answer with exactly "
    '<tool_call>{"name": "get_weather", "arguments": {"city": CITY}}</tool_call> and nothing else.'
)
CALLED_BEFORE = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ADDED_RESPONSE_KEYS = ("input_messages", "output_messages")


def one_call(store: str) -> dict:
    (call,) = wait_for(lambda: read_calls(store), what="the call record")
    return call


# -- Responses ------------------------------------------------------------------------------------------------
def responses_body(with_tool: bool) -> dict:
    body: dict = {"max_output_tokens": 40, "temperature": 0}
    if with_tool:
        body["instructions"] = SYSTEM
        body["input"] = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": CALLED_BEFORE},
            {"role": "user", "content": "sunny. What is the weather in Berlin?"},
        ]
        body["tools"] = [
            {"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY_SCHEMA}
        ]
    else:
        body["input"] = "Name a colour."
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("with_tool", [False, True], ids=["text", "tool"])
def test_responses_records_the_ids_vllm_sampled(start_sidecar, policy_server, vllm, tokenizer, stream, with_tool):
    sidecar = start_sidecar(policy_server.base_url)
    body = responses_body(with_tool)
    sdk = openai.OpenAI(base_url=f"{sidecar.url}/v1", api_key="sk-test-not-real", max_retries=0, timeout=120)
    if stream:
        events = list(sdk.responses.create(model="gpt-5-codex", stream=True, **body))  # the SDK parses each event
        assert [e.type for e in events][-1] in ("response.completed", "response.incomplete")
        for event in events:
            assert event.model_extra is None or not any(event.model_extra.get(k) for k in ADDED_RESPONSE_KEYS)
            if event.type == "response.output_text.delta":
                assert event.logprobs == []  # what vLLM sends when logprobs were not asked for
        reply = events[-1].response
    else:
        reply = sdk.responses.create(model="gpt-5-codex", **body)
    assert not any((reply.model_extra or {}).get(k) for k in ADDED_RESPONSE_KEYS)
    for item in reply.output:
        for content in getattr(item, "content", None) or []:
            assert getattr(content, "logprobs", None) is None

    direct = vllm.post("/v1/responses", json={**body, "model": policy_server.name, "enable_response_messages": True,
                                              "include": ["message.output_text.logprobs"]}).json()  # fmt: skip
    expected_prompt = [t for m in direct["input_messages"] for t in m["tokens"]]
    expected_ids = [t for m in direct["output_messages"] for t in m["tokens"]]
    call = one_call(sidecar.store)
    assert call["api"] == "responses" and call["stream"] is stream and call["status"] == "ok"
    assert call["prompt_token_ids"] == expected_prompt and call["completion_token_ids"] == expected_ids
    assert len(call["completion_logprobs"]) == len(expected_ids)
    calls = [i for i in reply.output if i.type == "function_call"]
    decoded = tokenizer.decode(call["completion_token_ids"], skip_special_tokens=True)
    if calls:  # the ids hold the raw tool-call text vLLM parsed; vLLM gives no logprobs for it
        (function_call,) = calls
        assert (
            json.loads(function_call.arguments)
            == json.loads(decoded.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]
        )
        assert all(math.isnan(x) for x in call["completion_logprobs"]) and "function-call" in call["note"]
    else:
        assert decoded == reply.output_text
        direct_logprobs = [e["logprob"] for c in direct["output"][0]["content"] for e in c["logprobs"]]
        seen = [x for x in call["completion_logprobs"] if not math.isnan(x)]
        assert seen == pytest.approx(direct_logprobs[: len(seen)], abs=1e-3) and len(seen) >= len(expected_ids) - 1
    if with_tool:
        assert calls, "greedy SmolLM2 calls the tool on this prompt (as on the chat path)"


# Greedy SmolLM2 answers this with a sentence, then the tool call: a message item and a function_call item.
SPEAK_THEN_CALL: dict[str, Any] = {
    "max_output_tokens": 60, "temperature": 0,
    "instructions": "Before calling a tool, say one short sentence. " + SYSTEM,
    "input": [{"role": "user", "content": "What is the weather in Paris?"},
              {"role": "assistant", "content": "Let me check. " + CALLED_BEFORE},
              {"role": "user", "content": "sunny. What is the weather in Berlin?"}],
    "tools": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY_SCHEMA}],
}  # fmt: skip


def teacher_forced(vllm, policy_server, prompt: list[int], ids: list[int]) -> list[float]:
    """vLLM's logprob of each id after the prompt and the ids before it (prompt_logprobs over prompt + ids)."""
    positions = vllm.post("/v1/completions", json={
        "model": policy_server.name, "prompt": prompt + ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0,
    }).json()["choices"][0]["prompt_logprobs"][len(prompt):]  # fmt: skip
    return [position[str(token)]["logprob"] for token, position in zip(ids, positions, strict=True)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_text_and_tool_call_logprobs_align_with_their_ids_position_by_position(
    start_sidecar, policy_server, vllm, tokenizer, stream
):
    """The answer holds a message item and a function_call item. Every recorded logprob is vLLM's logprob of the
    id at the same position (teacher-forced), so none is shifted: the whole answer gives one for every id; the
    stream gives those of the text's ids, and only the function call's (and end of turn's) are NaN."""
    sidecar = start_sidecar(policy_server.base_url)
    sdk = openai.OpenAI(base_url=f"{sidecar.url}/v1", api_key="sk-test-not-real", max_retries=0, timeout=120)
    if stream:
        reply = list(sdk.responses.create(model="gpt-5-codex", stream=True, **SPEAK_THEN_CALL))[-1].response
    else:
        reply = sdk.responses.create(model="gpt-5-codex", **SPEAK_THEN_CALL)
    kinds = [item.type for item in reply.output]
    assert kinds == ["message", "function_call"], kinds  # the case under test: text, then a tool call
    call = one_call(sidecar.store)
    ids, recorded = call["completion_token_ids"], call["completion_logprobs"]
    assert call["status"] == "ok" and call["error"] is None and len(recorded) == len(ids)
    forced = teacher_forced(vllm, policy_server, call["prompt_token_ids"], ids)
    known = [i for i, value in enumerate(recorded) if not math.isnan(value)]
    limit = 1e-3 if policy_server.dtype == "float32" else 0.1
    gaps = {i: abs(recorded[i] - forced[i]) for i in known}
    assert all(gap < limit for gap in gaps.values()), gaps  # position by position
    assert call["n_unknown_logprobs"] == len(ids) - len(known)
    text = reply.output[0].content[0].text
    if stream:  # the text's ids, from the first, without a gap; the function call's ids have none
        spoken = len(known)
        assert known == list(range(spoken)) and 0 < spoken < len(ids)
        assert tokenizer.decode(ids[:spoken]).startswith(text.rstrip())
        assert "<tool_call>" in tokenizer.decode(ids[spoken - 1 :]) and "NaN" in call["note"]
    else:
        assert known == list(range(len(ids))) and call["note"] is None  # every id, the function call's too


# -- Messages -------------------------------------------------------------------------------------------------
def messages_body(with_tool: bool) -> dict:
    if not with_tool:
        return {
            "max_tokens": 40,
            "system": "Answer briefly.",
            "messages": [{"role": "user", "content": "Name a colour."}],
        }
    return {
        "max_tokens": 60,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1a2b3c;"},
                   {"type": "text", "text": SYSTEM}],
        "messages": [{"role": "user", "content": "What is the weather in Paris?"},
                     {"role": "assistant", "content": CALLED_BEFORE},
                     {"role": "user", "content": [{"type": "text", "text": "sunny. What is the weather in Berlin?"}]}],
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": CITY_SCHEMA}],
    }  # fmt: skip


def vllm_sampled(vllm, policy_server, body: dict) -> tuple[list[int], list[int]]:
    """vLLM's own rendering of a Messages request, and the greedy ids it generates from it (tokens in)."""
    rendered = vllm.post("/v1/messages/render", json={**body, "model": policy_server.name}).json()["token_ids"]
    generated = vllm.post("/v1/completions", json={
        "model": policy_server.name, "prompt": rendered, "max_tokens": body["max_tokens"], "temperature": 0,
        "return_token_ids": True,
    }).json()["choices"][0]["token_ids"]  # fmt: skip
    return rendered, generated


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("with_tool", [False, True], ids=["text", "tool"])
def test_messages_are_served_with_ids_and_translated_back(
    start_sidecar, policy_server, vllm, tokenizer, stream, with_tool
):
    sidecar = start_sidecar(policy_server.base_url)
    body = messages_body(with_tool)
    sdk = anthropic.Anthropic(base_url=sidecar.url, api_key="sk-ant-test-not-real", max_retries=0, timeout=120)
    greedy: dict[str, Any] = {"extra_body": {"temperature": 0}}
    if stream:
        with sdk.messages.stream(model="claude-sonnet-4-5", **body, **greedy) as events:
            kinds = [event.type for event in events]  # the SDK parses and accumulates every event
            message = events.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    else:
        message = sdk.messages.create(model="claude-sonnet-4-5", **body, **greedy)
    prompt, expected = vllm_sampled(vllm, policy_server, body)
    call = one_call(sidecar.store)
    assert call["api"] == "messages" and call["stream"] is stream and call["status"] == "ok"
    assert call["prompt_token_ids"] == prompt and call["completion_token_ids"] == expected
    assert len(call["completion_logprobs"]) == len(expected) and not any(map(math.isnan, call["completion_logprobs"]))
    assert call["response_id"] == message.id and message.id.startswith("msg_")
    assert message.usage.input_tokens == len(prompt) and message.usage.output_tokens == len(expected)
    decoded = tokenizer.decode(expected, skip_special_tokens=True)
    if with_tool:
        (tool_use,) = [block for block in message.content if block.type == "tool_use"]
        raw = json.loads(decoded.split("<tool_call>")[1].split("</tool_call>")[0])
        assert tool_use.name == raw["name"] and tool_use.input == raw["arguments"] and message.stop_reason == "tool_use"
    else:
        assert "".join(b.text for b in message.content if b.type == "text") == decoded
        assert message.stop_reason in ("end_turn", "max_tokens")


def test_a_messages_stream_cut_by_the_client_is_recorded_truncated_with_the_ids_seen(
    start_sidecar, policy_server, vllm
):
    sidecar = start_sidecar(policy_server.base_url)
    body = {"model": "claude-sonnet-4-5", "max_tokens": 300, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}  # fmt: skip
    deltas = 0
    with httpx.stream("POST", f"{sidecar.url}/v1/messages", json=body, timeout=120) as answer:
        for line in answer.iter_lines():
            deltas += line.startswith("event: content_block_delta")
            if deltas == 5:
                break  # hang up mid-answer
    call = one_call(sidecar.store)
    _, greedy = vllm_sampled(vllm, policy_server, {k: v for k, v in body.items() if k not in ("model", "stream")})
    seen = call["completion_token_ids"]
    assert call["status"] == "truncated" and 5 <= len(seen) < len(greedy)
    assert seen == greedy[: len(seen)] and len(call["completion_logprobs"]) == len(seen)


def test_count_tokens_and_the_model_list_are_answered_in_anthropics_format(start_sidecar, policy_server, vllm):
    sidecar = start_sidecar(policy_server.base_url)
    sdk = anthropic.Anthropic(base_url=sidecar.url, api_key="sk-ant-test-not-real", max_retries=0, timeout=60)
    question: Any = [{"role": "user", "content": "How many tokens is this?"}]
    counted = sdk.messages.count_tokens(model="claude-sonnet-4-5", messages=question)
    rendered = vllm.post("/v1/messages/render", json={"model": policy_server.name, "max_tokens": 1,
                                                      "messages": question}).json()["token_ids"]  # fmt: skip
    assert counted.input_tokens == len(rendered)
    assert [m.id for m in sdk.models.list()] == [policy_server.name]
    assert read_calls(sidecar.store) == []  # neither samples anything: nothing recorded


def test_an_upstream_error_reaches_an_anthropic_client_in_anthropics_format(start_sidecar, policy_server):
    sidecar = start_sidecar(policy_server.base_url)
    sdk = anthropic.Anthropic(base_url=sidecar.url, api_key="sk-ant-test-not-real", max_retries=0, timeout=60)
    # A bound above the context is lowered by the sidecar (never refused), so the error is a sampling parameter
    # vLLM 0.32 refuses on its own /v1/messages and on the translated chat call alike: a negative temperature
    # (sent as extra_body: anthropic 2.x has no sampling arguments any more).
    with pytest.raises(anthropic.BadRequestError) as raised:
        sdk.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": "x"}],
                            extra_body={"temperature": -1.0})  # fmt: skip
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "temperature" in raised.value.body["error"]["message"]  # type: ignore[index]  # vLLM's own reason, passed on
    call = one_call(sidecar.store)
    assert call["status"] == "upstream_error" and call["http_status"] == 400 and call["api"] == "messages"


def test_codex_websocket_upgrade_is_refused_at_once_and_post_still_served(start_sidecar, policy_server):
    sidecar = start_sidecar(policy_server.base_url)
    upgrade = {"connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
               "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ=="}  # fmt: skip
    refused = httpx.get(f"{sidecar.url}/v1/responses", headers=upgrade, timeout=10)
    assert refused.status_code == 426 and refused.json()["error"]["code"] == "websocket_not_supported"
    assert sidecar.metrics()["websocket_refused_total"] == 1
    served = httpx.post(f"{sidecar.url}/v1/responses", json={"model": "gpt-5-codex", "input": "hi",
                                                             "max_output_tokens": 4}, timeout=60)  # fmt: skip
    assert served.status_code == 200 and one_call(sidecar.store)["status"] == "ok"


def test_claude_code_turns_share_their_prefix_despite_the_billing_line(start_sidecar, policy_server):
    """Claude Code changes the billing line in system[0] on every call and puts system turns inside messages;
    normalised the same way each time, the second turn's prompt still extends the first (a stored reference)."""
    sidecar = start_sidecar(policy_server.base_url)
    sdk = anthropic.Anthropic(base_url=sidecar.url, api_key="sk-ant-test-not-real", max_retries=0, timeout=120)

    def system(cch: str) -> Any:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={cch};"},
                {"type": "text", "text": "You are a coding agent."}]  # fmt: skip

    history: Any = [{"role": "user", "content": "Say hello."}]
    first = sdk.messages.create(model="claude-sonnet-4-5", max_tokens=12, system=system("a1"), messages=history)
    history += [
        {"role": "assistant", "content": [{"type": "text", "text": b.text} for b in first.content if b.type == "text"]},
        {"role": "system", "content": "<system-reminder>Keep answers short.</system-reminder>"},
        {"role": "user", "content": "Now say goodbye."},
    ]
    sdk.messages.create(model="claude-sonnet-4-5", max_tokens=12, system=system("b2"), messages=history)
    one, two = wait_for(lambda: len(calls := read_calls(sidecar.store)) == 2 and calls, what="two records")
    assert two["parent_call_id"] == one["call_id"] and two["prefix_len"] >= len(one["prompt_token_ids"])
    assert two["prompt_token_ids"][: len(one["prompt_token_ids"])] == one["prompt_token_ids"]
