"""The Responses and Messages modules without a proxy: what is added and hidden, the Anthropic translation both
ways, and the events we emit checked against the official ``anthropic`` SDK's types."""

import json
import math
from pathlib import Path
from typing import Any

import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

import sidecar
from sidecar import apis
from sidecar.apis import messages, responses
from sidecar.redact import REDACTED, redacted_text, secrets_in_body, secrets_in_headers

EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)


@pytest.mark.parametrize(
    ("method", "path", "api"),
    [("POST", "/v1/chat/completions", "chat"), ("POST", "/v1/completions", "completions"),
     ("POST", "/v1/responses", "responses"), ("POST", "/v1/messages?beta=true", "messages"),
     ("POST", "/v1/messages/count_tokens?beta=true", "count_tokens"), ("GET", "/v1/models", "models"),
     ("GET", "/v1/responses", "responses_socket"), ("GET", "/v1/chat/completions", None),
     ("POST", "/v1/embeddings", None)],
)  # fmt: skip
def test_the_api_is_found_from_method_and_path(method, path, api):
    assert apis.api_for(method, path) == api


def test_every_registered_route_is_found_from_each_of_its_paths():
    """The registry is the only table: each route's own paths lead back to it (the longest suffix wins, so
    /v1/chat/completions is chat although it ends in /completions too)."""
    for api in apis.REGISTRY.values():
        for path in api.paths:
            assert apis.api_for(api.method, path) == api.name, (api.name, path)
            assert apis.api_for(api.method, f"/openai{path}/?x=1") == api.name, (api.name, path)
    assert apis.api_for("GET", "/v1/responses/resp_1") == apis.api_for("DELETE", "/v1/responses/resp_1")
    assert apis.api_for("GET", "/v1/responses/resp_1") == "responses_stored"


def test_a_route_is_registered_once_and_a_recorded_one_has_a_module_and_a_bound(monkeypatch):
    from sidecar.apis import registry

    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(apis.REGISTRY["chat"])
    with pytest.raises(ValueError, match="a recorded API"):
        registry.register(registry.Api("embeddings", "POST", ("/v1/embeddings",), registry.RECORDED,
                                       apis.openai.DIALECT))  # fmt: skip
    registry.register(registry.Api("embeddings", "POST", ("/v1/embeddings",), registry.ROUTED, apis.openai.DIALECT))
    assert registry.api_for("POST", "/v1/embeddings") == "embeddings"


def sse(data: dict | str, event: str | None = None) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


def parse_events(raw: list[bytes]) -> list[tuple[str, dict]]:
    out = []
    for event in raw:
        lines = event.decode().strip().split("\n")
        name = next(line[7:] for line in lines if line.startswith("event: "))
        data = json.loads(next(line[6:] for line in lines if line.startswith("data: ")))
        assert data["type"] == name  # Anthropic's event name and payload type agree
        out.append((name, data))
    return out


# -- Responses ----------------------------------------------------------------------------------------------
def test_responses_prepare_asks_for_ids_and_logprobs_and_keeps_the_harness_include():
    body: dict = {"input": "hi", "include": ["reasoning.encrypted_content"]}
    added = responses.prepare_request("responses", body)
    assert body["enable_response_messages"] is True
    assert body["include"] == ["reasoning.encrypted_content", responses.LOGPROBS_INCLUDE]
    assert not added.harness_logprobs and not added.harness_messages


def whole_response(
    logprobs: list[Any], tokens: list[int], function_call: bool = False, texts: list[str] | None = None,
    output_text: str | None = None,
) -> dict:  # fmt: skip
    """A Responses answer as vLLM 0.32 writes it: one output message with every id, the text's logprobs in a
    message item (``texts``: each logprob's token, default "x")."""
    texts = texts or ["x"] * len(logprobs)
    output: list[dict] = [{"type": "message", "content": [{"type": "output_text", "text": "hi", "logprobs": [
        {"token": t, "logprob": lp, "top_logprobs": []} for t, lp in zip(texts, logprobs, strict=True)]}]}]  # fmt: skip
    if function_call:
        output.append({"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c1"})
    raw = output_text if output_text is not None else "x" * len(tokens)
    return {"id": "resp_1", "model": "m", "status": "completed", "top_logprobs": 0, "output": output,
            "input_messages": [{"tokens": [1, 2, 3]}],
            "output_messages": [{"message": raw, "tokens": tokens}]}  # fmt: skip


def test_responses_whole_answer_gives_ids_and_hides_them():
    added = responses.prepare_request("responses", {"input": "hi"})
    sampled, answer = responses.finish(added, whole_response([-0.5, -0.25], [7, 8]))
    assert sampled.prompt_ids == [1, 2, 3] and sampled.completion_ids == [7, 8]
    assert sampled.logprobs == [-0.5, -0.25] and sampled.note is None and sampled.problem() is None
    assert answer["input_messages"] is None and answer["output_messages"] is None and answer["top_logprobs"] is None
    assert answer["output"][0]["content"][0]["logprobs"] is None


# What vLLM 0.32 answers for "Let me check. <tool_call>...</tool_call>" (studied on the real server: the whole
# answer's message carries the logprobs of all ids; the stream's only those of the steps that produced text).
SPOKEN = ["Let", " me", " check", ".", " <"]
CALL = ["tool", "_", "call", ">", '{"', "name", '":', ' "', "f", '"}', "</", "tool", "_", "call", ">"]
RAW = "".join(SPOKEN + CALL)  # the output text vLLM keeps (the end-of-turn id adds none)
IDS = list(range(100, 100 + len(SPOKEN) + len(CALL) + 1))  # + <|im_end|>


def test_responses_text_and_function_call_whole_every_id_gets_its_own_logprob():
    values = [-0.1 * (i + 1) for i in range(len(IDS))]
    answer = whole_response(values, IDS, function_call=True, texts=[*SPOKEN, *CALL, "<|im_end|>"], output_text=RAW)
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), answer)
    assert sampled.logprobs == pytest.approx(values) and sampled.note is None and sampled.problem() is None


def test_responses_text_and_function_call_streamed_the_text_ids_get_theirs_the_rest_nan():
    values = [-0.1 * (i + 1) for i in range(len(SPOKEN))]
    answer = whole_response(values, IDS, function_call=True, texts=SPOKEN, output_text=RAW)
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), answer)
    placed = len(SPOKEN) - 1  # " <" could be a held-back tag start: not placed (see the next tests)
    assert sampled.logprobs[:placed] == pytest.approx(values[:placed])  # position by position, not shifted
    assert all(math.isnan(x) for x in sampled.logprobs[placed:]) and len(sampled.logprobs) == len(IDS)
    assert f"first {placed} are placed" in (sampled.note or "") and sampled.problem() is None


def test_responses_logprobs_missing_in_the_middle_are_never_shifted_but_unknown():
    """A step that sent no text (no logprob) then text again: which ids the later logprobs are for is unknown, so
    they are NaN (counted unknown, the call still ok); only more logprobs than ids are an error."""
    gap = ["Let", " me", ".", " <"]  # " check" has no logprob
    answer = whole_response([-0.1, -0.2, -0.3, -0.4], IDS, texts=gap, output_text=RAW)
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), answer)
    assert sampled.logprobs[:2] == pytest.approx([-0.1, -0.2]) and len(sampled.logprobs) == len(IDS)
    assert all(math.isnan(x) for x in sampled.logprobs[2:]) and sampled.problem() is None
    assert "the first 2 are placed" in (sampled.note or "")
    too_many = whole_response([-0.1] * 3, [7, 8], texts=["a", "b", "c"], output_text="abc")
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), too_many)
    assert "3 logprobs for 2 output ids" in (sampled.problem() or "")


def test_responses_a_held_back_tag_start_is_not_shifted():
    """Seen on vLLM 0.32 (stream, hermes parser): "<b>Hello,</b>" is 9 ids and 7 logprobs; the "<" step sent no
    text (it could start <tool_call>), its text went out with the "b" step's logprob. The token "b" does not spell
    the text at its place: nothing from there on is placed."""
    tokens = ["b", ">", "Hello", ",", "</", "b", ">"]  # "<" and the end of turn have none
    answer = whole_response([-0.1] * 7, list(range(9)), texts=tokens, output_text="<b>Hello,</b>")
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), answer)
    assert all(math.isnan(x) for x in sampled.logprobs) and sampled.problem() is None and len(sampled.logprobs) == 9


def test_responses_characters_split_across_ids_are_not_shifted():
    """Seen on vLLM 0.32 (stream): each emoji is 3 ids and one logprob whose token is the whole emoji, so the
    tokens spell the text exactly while two of every three ids have no logprob: a non-ASCII token stops placing.
    (The same with U+FFFD tokens, a character's pieces decoded alone.)"""
    answer = whole_response(
        [-0.1, -0.2, -0.3], list(range(7)), texts=["a", "\U0001f600", "b"], output_text="a\U0001f600b"
    )
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), answer)
    assert sampled.logprobs[0] == pytest.approx(-0.1) and all(math.isnan(x) for x in sampled.logprobs[1:])
    assert sampled.problem() is None and "the first 1 are placed" in (sampled.note or "")
    answer = whole_response([-0.1, -0.2, -0.3], [7, 8, 9, 10], texts=["a", "\ufffd", "\ufffd"], output_text="a你b")
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), answer)
    assert sampled.problem() is None and sampled.logprobs[0] == pytest.approx(-0.1)
    assert all(math.isnan(x) for x in sampled.logprobs[1:])


def test_responses_a_function_call_alone_has_no_logprobs_and_says_so():
    answer = whole_response([], [7, 8, 9], function_call=True)
    answer["output"] = answer["output"][1:]  # vLLM writes no message item when there is no text
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), answer)
    assert len(sampled.logprobs) == 3 and all(math.isnan(x) for x in sampled.logprobs)
    assert sampled.note == responses.NO_LOGPROBS_NOTE and sampled.problem() is None


@pytest.mark.parametrize("bad", [None, -9999.0, float("nan"), "x"])
def test_an_invalid_logprob_from_vllm_makes_the_call_an_error_naming_its_position(bad):
    answer = whole_response([-0.5, bad, -0.25], [7, 8, 9])
    sampled, _ = responses.finish(responses.prepare_request("responses", {"input": "hi"}), answer)
    problem = sampled.problem()
    assert problem is not None and "1 of 3" in problem and "position(s) 1" in problem
    assert sampled.logprobs[0] == -0.5 and math.isnan(sampled.logprobs[1]) and sampled.logprobs[2] == -0.25


@pytest.mark.parametrize(
    "event",
    [{"type": "response.failed", "response": {**whole_response([-1.0], [9]), "status": "failed",
                                              "error": {"code": "server_error", "message": "engine died"}}},
     {"type": "error", "code": "server_error", "message": "engine died", "param": None}],
    ids=["response.failed", "error"],
)  # fmt: skip
def test_a_failed_responses_stream_is_the_upstreams_error_not_ok(event):
    state = responses.StreamState(responses.prepare_request("responses", {"input": "hi", "stream": True}))
    state.feed_event(sse({"type": "response.output_text.delta", "delta": "h", "logprobs": []}))
    state.feed_event(sse(event, event["type"]))
    assert state.done and "engine died" in (state.sampled.upstream_error or "")


def test_a_chat_stream_ending_with_an_error_event_is_the_upstreams_error():
    from sidecar.apis import openai

    state = openai.StreamState(openai.prepare_request("chat", {"messages": [], "stream": True}))
    logprobs = {"content": [{"token": "h", "logprob": -1.0}]}
    chunk = {"id": "c", "model": "m",
             "choices": [{"index": 0, "delta": {"content": "h"}, "token_ids": [5], "logprobs": logprobs}]}  # fmt: skip
    state.feed_event(sse(chunk))
    state.feed_event(sse({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}))
    state.feed_event(sse("[DONE]"))
    assert state.done and "engine died" in (state.sampled.upstream_error or "")


def test_responses_stream_hides_delta_logprobs_and_takes_ids_from_completed():
    state = responses.StreamState(responses.prepare_request("responses", {"input": "hi", "stream": True}))
    delta = {"type": "response.output_text.delta", "delta": "hi", "logprobs": [{"token": "hi", "logprob": -1.0}]}
    (out,) = state.feed_event(sse(delta, "response.output_text.delta"))
    assert out.startswith(b"event: response.output_text.delta\n")
    assert json.loads(out.split(b"data: ", 1)[1])["logprobs"] == [] and not state.done
    unchanged = sse({"type": "response.output_item.added", "item": {"type": "message", "content": []}}, "x")
    assert state.feed_event(unchanged) == [unchanged]  # byte for byte
    completed = {"type": "response.completed", "response": whole_response([-1.0], [9])}
    (out,) = state.feed_event(sse(completed, "response.completed"))
    assert state.done and state.sampled.completion_ids == [9] and state.sampled.prompt_ids == [1, 2, 3]
    sent = json.loads(out.split(b"data: ", 1)[1])["response"]
    assert sent["input_messages"] is None and sent["output"][0]["content"][0]["logprobs"] is None


def test_responses_stream_passes_an_incomplete_answers_last_event_on_as_vllm_sends_it():
    """vLLM ends a cut-short answer's stream with ``response.completed`` (status incomplete); passed on so (pi reads
    the usage from ``response.completed`` only), the ids taken from it."""
    state = responses.StreamState(responses.prepare_request("responses", {"input": "hi", "stream": True}))
    cut = {**whole_response([-1.0], [9]), "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    (out,) = state.feed_event(sse({"type": "response.completed", "response": cut}, "response.completed"))
    assert out.startswith(b"event: response.completed\n")
    assert state.done and state.sampled.finish_reason == "max_output_tokens" and state.sampled.completion_ids == [9]


# -- Messages: request translation --------------------------------------------------------------------------
CLAUDE_CODE_LIKE = {
    "model": "claude-sonnet-4-5", "max_tokens": 64, "stream": True, "stop_sequences": ["END"],
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=9f8e7;"},
               {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "List files."}]},
        {"role": "system", "content": "x-anthropic-billing-header: again"},
        {"role": "system", "content": [{"type": "text", "text": "Reminder: be careful."}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Running ls."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                           "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a.txt"}]},
                                     {"type": "text", "text": "Now read it."}]},
    ],
    "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {"type": "object"}},
              {"type": "web_search_20250305", "name": "web_search"}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"},
}  # fmt: skip


def test_a_claude_code_request_becomes_the_chat_request_vllm_would_build():
    chat = messages.to_chat_request(json.loads(json.dumps(CLAUDE_CODE_LIKE)))
    assert chat["messages"] == [
        {"role": "system", "content": "You are Claude Code."},  # the billing line is gone
        {"role": "user", "content": "List files."},
        {"role": "system", "content": "Reminder: be careful."},  # kept in place; the billing-only one dropped
        {"role": "assistant", "reasoning": "hmm", "content": "Running ls.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "user", "content": "Now read it."},
    ]  # fmt: skip
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "Bash", "description": "Run a command", "parameters": {"type": "object"}}}]  # fmt: skip
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["stop"] == ["END"] and chat["max_tokens"] == 64 and chat["stream"] is True
    assert "thinking" not in chat and "metadata" not in chat and "reasoning_effort" not in chat


def test_the_billing_line_changes_nothing_between_calls():
    first, second = (json.loads(json.dumps(CLAUDE_CODE_LIKE)) for _ in range(2))
    second["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.3; cch=00000;"
    assert messages.to_chat_request(first) == messages.to_chat_request(second)


def test_prepare_replaces_the_body_and_asks_chat_for_ids():
    body = json.loads(json.dumps(CLAUDE_CODE_LIKE))
    added = messages.prepare_request("messages", body)
    assert added.upstream_path == "/v1/chat/completions" and added.stream
    assert body["return_token_ids"] is True and body["logprobs"] is True and "system" not in body


def test_a_request_that_is_not_messages_is_refused_for_translation():
    with pytest.raises(messages.TranslationError):
        messages.prepare_request("messages", {"model": "m"})


# -- Messages: answers ----------------------------------------------------------------------------------------
def chat_answer(content: str | None, tool_calls: list | None = None, finish: str = "stop", stop_reason=None):
    return {
        "id": "chatcmpl-abc", "model": "policy", "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "finish_reason": finish, "stop_reason": stop_reason, "token_ids": [5, 6],
                     "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]},
                     "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or []}}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "stop_reason", "kinds"),
    [(chat_answer("hello"), "end_turn", ["text"]),
     (chat_answer("he", finish="length"), "max_tokens", ["text"]),
     (chat_answer("x", stop_reason="END"), "stop_sequence", ["text"]),
     (chat_answer(None, [{"id": "c1", "type": "function", "function": {"name": "Bash", "arguments": '{"a": 1}'}}],
                  finish="tool_calls"), "tool_use", ["tool_use"]),
     (chat_answer(""), "end_turn", ["text"])],
)  # fmt: skip
def test_a_whole_chat_answer_becomes_an_anthropic_message(answer, stop_reason, kinds):
    added = messages.prepare_request("messages", {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    sampled, message = messages.finish(added, answer)
    parsed = Message.model_validate(message)  # the SDK's own type
    assert parsed.stop_reason == stop_reason and [block.type for block in parsed.content] == kinds
    assert parsed.usage.input_tokens == 2 and parsed.usage.output_tokens == 2 and parsed.id.startswith("msg_")
    assert sampled.prompt_ids == [1, 2] and sampled.completion_ids == [5, 6] and sampled.logprobs == [-0.1, -0.2]
    if stop_reason == "stop_sequence":
        assert parsed.stop_sequence == "END"
    if kinds == ["tool_use"]:
        assert parsed.content[0].input == {"a": 1}  # type: ignore[union-attr]


def chat_stream_chunks() -> list[dict]:
    def chunk(delta: dict, token_ids: list[int], finish: str | None = None, **extra) -> dict:
        logprobs = {"content": [{"logprob": -0.5} for _ in token_ids]}
        return {"id": "chatcmpl-1", "model": "policy", "choices": [
            {"index": 0, "delta": delta, "token_ids": token_ids, "logprobs": logprobs, "finish_reason": finish}
        ], **extra}  # fmt: skip

    return [
        chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[1, 2, 3]),
        chunk({"content": "Let me"}, [10, 11]),
        chunk({"content": " check."}, [12]),
        chunk(
            {
                "tool_calls": [
                    {"index": 0, "id": "call_1", "type": "function", "function": {"name": "Bash", "arguments": ""}}
                ]
            },
            [13],
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command":'}}]}, [14]),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "ls"}'}}]}, [15], finish="tool_calls"),
        {"id": "chatcmpl-1", "model": "policy", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}},
    ]


def test_a_chat_stream_becomes_the_full_anthropic_event_sequence():
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    state = messages.StreamState(messages.prepare_request("messages", body))
    raw = [event for chunk in chat_stream_chunks() for event in state.feed_event(sse(chunk))]
    assert not state.done
    raw += state.feed_event(sse("[DONE]"))
    assert state.done
    events = parse_events(raw)
    for name, data in events:  # every event is one the official SDK knows (it reads pings and skips them)
        assert data == {"type": "ping"} if name == "ping" else EVENT.validate_python(data)
    names = [name for name, _ in events]
    assert names == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[0][1]["message"]["usage"]["input_tokens"] == 3
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "Bash", "input": {}}
    arguments = "".join(d["delta"]["partial_json"] for _, d in events if d.get("delta", {}).get("partial_json"))
    assert json.loads(arguments) == {"command": "ls"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-2][1]["usage"]["output_tokens"] == 6
    sampled = state.sampled
    assert sampled.prompt_ids == [1, 2, 3] and sampled.completion_ids == [10, 11, 12, 13, 14, 15]
    assert len(sampled.logprobs) == 6 and sampled.response_id == "msg_1"


def test_the_sdk_accumulates_our_stream_into_the_message_it_describes():
    from anthropic.lib.streaming._messages import accumulate_event

    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    state = messages.StreamState(messages.prepare_request("messages", body))
    raw = [event for chunk in chat_stream_chunks() for event in state.feed_event(sse(chunk))]
    raw += state.feed_event(sse("[DONE]"))
    snapshot, json_bufs = None, {}  # type: ignore[var-annotated]
    for name, data in parse_events(raw):
        if name != "ping":
            event = EVENT.validate_python(data)
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    assert [block.type for block in snapshot.content] == ["text", "tool_use"]
    assert snapshot.content[0].text == "Let me check."  # type: ignore[union-attr]
    assert snapshot.content[1].input == {"command": "ls"}  # type: ignore[union-attr]


def test_an_upstream_error_is_said_in_anthropics_format():
    body = json.loads(messages.error_body(400, json.dumps({"error": {"message": "too long", "code": 400}})))
    assert body == {"type": "error", "error": {"type": "invalid_request_error", "message": "too long"}}


# -- Codex's identifying ids ----------------------------------------------------------------------------------
def test_codex_installation_ids_never_reach_a_record():
    installation = "8043f8d7-e3f3-4643-987c-011d005824bd"
    turn = json.dumps({"installation_id": installation, "session_id": "s-1", "turn_id": "t-1"})
    body = {"input": "hi", "client_metadata": {"x-codex-installation-id": installation,
                                               "x-codex-turn-metadata": turn, "session_id": "s-1"}}  # fmt: skip
    text = json.dumps(body)
    for secrets in (secrets_in_body(body), secrets_in_headers({"x-codex-turn-metadata": turn})):
        scrubbed = redacted_text(text, secrets)
        assert installation not in scrubbed and REDACTED in scrubbed and "s-1" in scrubbed


def test_a_secret_spelled_with_json_escapes_is_scrubbed_too():
    """JSON may write any character as \\uXXXX (and / as \\/): decoded, that text is the secret itself."""
    secret = "sk-pl/anted-0123"
    text = '{"content": "a \\u0073k-pl\\/anted-0123 b \\u0053K-pl/anted-0123 c sk-pl/anted-0123 \\u001b"}'
    scrubbed = json.loads(redacted_text(text, [secret]))["content"]
    assert secret not in scrubbed and scrubbed.count(REDACTED) == 2 and "SK-pl/anted-0123" in scrubbed


def api_name_branches(source: str) -> list[int]:
    """Lines comparing an API's name (``api``, ``x.api``) with a string, or with strings in a tuple/list/set."""
    import ast

    def is_api(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("api", "served_api")) or (
            isinstance(node, ast.Attribute) and node.attr == "api"
        )

    def literal(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(literal(e) for e in node.elts)

    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
            and is_api(node.left) and any(literal(c) for c in node.comparators)]  # fmt: skip


def test_no_branch_on_an_apis_name_outside_the_apis_package():
    """Facts about a wire API live in its module (the registry); the rest of the sidecar asks, never names it."""
    root = Path(sidecar.__file__).resolve().parent
    found = {
        str(path.relative_to(root)): lines
        for path in sorted(root.rglob("*.py"))
        if "apis" not in path.relative_to(root).parts and (lines := api_name_branches(path.read_text()))
    }
    assert found == {}
    assert api_name_branches('if call.api == "messages":\n    pass\nok = api in ("chat", "x")\n') == [1, 3]
