"""Conformance: what the sidecar answers is what the official SDKs' own types describe, and third-party clients with
strict schemas run their tool loops through it.

1. Each wire API the sidecar serves (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages), whole and
   streamed, with and without tools, through the real sidecar to the real vLLM: the raw answer and every stream event
   validated strictly against openai-python's ``ChatCompletion`` / ``ChatCompletionChunk`` / ``Response`` / the
   Responses stream event union and anthropic's ``Message`` / ``RawMessageStreamEvent`` (``tests/support/
   sdk_schemas.py``: no coercion, no missing required field, no field the SDK lacks at any depth), plus what the
   types cannot say (event names, order, sequence numbers). With tools it is a loop: the answer's tool call goes back
   with a tool result, twice at most, until the model answers in text.
2. The Vercel AI SDK (npm ``ai`` with ``@ai-sdk/openai`` and ``@ai-sdk/anthropic``, which validate every answer
   and chunk with their own zod schemas) over Chat, Responses with ``store`` unset (true, its default) and false, and
   Messages; and the OpenAI Agents SDK's (``@openai/agents``) default loop, Responses with one tool. Both pinned and
   installed once by scripts/harness.sh. Each loop: every step served, every call recorded ``ok``, the client's own
   token counts equal to the records.
"""

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from forge.paths import repo_root
from sidecar.apis import messages
from tests.support import sdk_schemas
from tests.support.sidecar import call_table, read_calls, wait_for

SYSTEM = (
    "You can call one tool: get_weather(city). To call it, answer with exactly "
    '<tool_call>{"name": "get_weather", "arguments": {"city": CITY}}</tool_call> and nothing else.'
)
CALLED_BEFORE = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
FIRST: list[dict[str, Any]] = [  # an example call in the history: the 135M model then calls the tool itself
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": CALLED_BEFORE},
    {"role": "user", "content": "sunny. What is the weather in Berlin?"},
]
PLAIN = [{"role": "user", "content": "Say hello in three words."}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}],
    "responses": [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": CITY}],
    "messages": [{"name": "get_weather", "description": "Weather", "input_schema": CITY}],
}
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
MAX_TOKENS = {"chat": "max_tokens", "responses": "max_output_tokens", "messages": "max_tokens"}
MAX_STEPS = 3
CLIENTS = Path(__file__).parent / "clients"


# --- the wire APIs, raw --------------------------------------------------------------------------------------------


def body_for(api: str, history: list[Any], tools: bool, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "policy", MAX_TOKENS[api]: 40, "temperature": 0, "stream": stream}
    if api == "chat":
        body["messages"] = [{"role": "system", "content": SYSTEM}, *history]
    elif api == "responses":
        body |= {"instructions": SYSTEM, "input": history}
    else:
        body |= {"system": SYSTEM, "messages": history}
    if tools:
        body["tools"] = TOOLS[api]
    return body


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event of an SSE body."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        name = next((line[6:].strip() for line in lines if line.startswith("event:")), None)
        data = "\n".join(line[5:].removeprefix(" ") for line in lines if line.startswith("data:"))
        events.append((name, data))
    return events


def streamed(api: str, text: str) -> dict[str, Any]:
    """Validate every event of a streamed answer (and what the types cannot say: names, order, numbering); the
    answer it adds up to, as a whole answer's JSON would have it (enough of it to go on with the loop)."""
    events = sse_events(text)
    assert events, "an empty stream"
    if api == "chat":
        assert events[-1][1] == "[DONE]", events[-1]
        chunks = [
            sdk_schemas.check(sdk_schemas.EVENT[api], data, f"chunk {i}") for i, (_, data) in enumerate(events[:-1])
        ]
        assert len({c.id for c in chunks}) == 1
        return chat_from_chunks([json.loads(data) for _, data in events[:-1]])
    for i, (name, data) in enumerate(events):
        kind = json.loads(data).get("type")
        assert name == kind, f"event {i} is named {name!r} but its type is {kind!r}"
        if api == "messages" and kind == "ping":
            assert json.loads(data) == {"type": "ping"}  # not in RawMessageStreamEvent: the API's keep-alive
            continue
        event = sdk_schemas.check(sdk_schemas.EVENT[api], data, f"event {i} ({name})")
        if api == "responses":
            assert event.sequence_number == i, f"event {i} has sequence_number {event.sequence_number}"
    kinds = [name for name, _ in events]
    if api == "responses":
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        final = json.loads(events[-1][1])["response"]
        # vLLM ends a cut-short answer with response.completed too (passed on so: pi reads only that one)
        assert kinds[-1] == "response.completed", f"the last event {kinds[-1]!r}: {final['status']}"
        assert all(json.loads(data).get("logprobs") in (None, []) for _, data in events)  # the sidecar's, hidden
        return final
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta", kinds
    return message_from_events([json.loads(data) for _, data in events])


def chat_from_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    text, calls = "", dict[int, dict[str, Any]]()
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert choice.get("logprobs") is None and choice.get("token_ids") is None  # the sidecar's, hidden
            delta = choice["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": None, "type": "function",
                                                        "function": {"name": "", "arguments": ""}})  # fmt: skip
                slot["id"] = slot["id"] or call.get("id")
                slot["function"]["name"] += (call.get("function") or {}).get("name") or ""
                slot["function"]["arguments"] += (call.get("function") or {}).get("arguments") or ""
    message = {"role": "assistant", "content": text or None, "tool_calls": [calls[i] for i in sorted(calls)] or None}
    return {"choices": [{"message": message}]}


def message_from_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks), f"block {event['index']} started after {len(blocks)} blocks"
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta, block = event["delta"], blocks[event["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text)
    return {"content": blocks}


def answer(sidecar, api: str, episode: str, body: dict[str, Any]) -> dict[str, Any]:
    """One call through the sidecar, validated whole or event by event; the answer as JSON."""
    headers = {"x-forge-episode-id": episode, "x-api-key": "sk-ant-test", "anthropic-version": "2023-06-01"}
    reply = httpx.post(sidecar.url + PATHS[api], json=body, timeout=120, headers=headers)
    assert reply.status_code == 200, reply.text
    if body["stream"]:
        return streamed(api, reply.text)
    sdk_schemas.check(sdk_schemas.WHOLE[api], reply.text)
    whole = reply.json()
    if api == "chat":
        assert all(c["logprobs"] is None and c.get("token_ids") is None for c in whole["choices"])
    return whole


def tool_calls(api: str, whole: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(id, name, input) of each tool call in an answer."""
    if api == "chat":
        calls = whole["choices"][0]["message"].get("tool_calls") or []
        return [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    if api == "responses":
        return [(i["call_id"], i["name"], json.loads(i["arguments"])) for i in whole["output"]
                if i["type"] == "function_call"]  # fmt: skip
    return [(b["id"], b["name"], b["input"]) for b in whole["content"] if b["type"] == "tool_use"]


def continued(api: str, history: list[Any], whole: dict[str, Any], step: int) -> list[Any]:
    """The history with the answer and a result for each of its tool calls, in the API's own terms."""
    calls = tool_calls(api, whole)
    results = [(call_id, f"sunny, {20 + step} C in {arguments.get('city')}") for call_id, _, arguments in calls]
    if api == "chat":
        message = {k: v for k, v in whole["choices"][0]["message"].items() if k in ("role", "content", "tool_calls")}
        return [*history, message, *({"role": "tool", "tool_call_id": i, "content": r} for i, r in results)]
    if api == "responses":
        outputs = [{"type": "function_call_output", "call_id": i, "output": r} for i, r in results]
        return [*history, *whole["output"], *outputs]
    content = [{"type": "tool_result", "tool_use_id": i, "content": r} for i, r in results]
    return [*history, {"role": "assistant", "content": whole["content"]}, {"role": "user", "content": content}]


def episode_calls(store: str, episode: str, n: int) -> list[dict]:
    return wait_for(lambda: (calls := read_calls(store, f"episode_id = '{episode}'")) and len(calls) >= n and calls,
                    what=f"{n} call records of {episode}")  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_every_answer_and_event_is_the_sdks_own_type(start_sidecar, policy_server, api, stream):
    sidecar = start_sidecar(policy_server.base_url, episode_id=None)
    cut = answer(sidecar, api, "plain", body_for(api, PLAIN, tools=False, stream=stream) | {MAX_TOKENS[api]: 3})
    if api == "responses":
        assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    history, steps = list(FIRST), 0
    while steps < MAX_STEPS:
        whole = answer(sidecar, api, "loop", body_for(api, history, tools=True, stream=stream))
        steps += 1
        if not tool_calls(api, whole):
            break
        history = continued(api, history, whole, steps)
    assert steps >= 2, "the model answered the first step without a tool call: no tool loop"
    calls = episode_calls(sidecar.store, "plain", 1) + episode_calls(sidecar.store, "loop", steps)
    assert len(calls) == 1 + steps and all(c["status"] == "ok" for c in calls), call_table(calls)
    assert {c["api"] for c in calls} == {api}


# --- the strict check itself, and one fix it led to ----------------------------------------------------------------

A_TOOL_USE = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
A_USAGE = {"input_tokens": 3, "output_tokens": 1}
A_MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [A_TOOL_USE],
             "stop_reason": "end_turn", "stop_sequence": None, "usage": A_USAGE}  # fmt: skip


@pytest.mark.parametrize("wrong, complaint, sdk_accepts", [
    ({"service": "x"}, "$.service: no such field in Message", True),
    ({"content": [{"type": "text", "text": "hi", "logprobs": None}]}, "$.content[0].logprobs: no such field", True),
    ({"usage": {"input_tokens": "3", "output_tokens": 1}}, "usage.input_tokens", True),  # no coercion here
    ({"usage": {"input_tokens": 3}}, "usage.output_tokens", False),  # a required field missing
    ({"stop_reason": "finished"}, "stop_reason", False),
    ({"content": [{"type": "tool_use", "id": "t", "name": "f", "input": "Paris"}]}, "input", False),
])  # fmt: skip
def test_the_strict_check_refuses_what_the_sdks_own_models_let_through(wrong, complaint, sdk_accepts):
    from anthropic.types import Message

    sdk_schemas.check(Message, json.dumps(A_MESSAGE))
    broken = json.dumps(A_MESSAGE | wrong)
    if sdk_accepts:  # the SDK's own validation lets it through
        Message.model_validate_json(broken)
    with pytest.raises(sdk_schemas.NotConformant, match=complaint.replace("[", r"\[").replace("$", r"\$")):
        sdk_schemas.check(Message, broken)


def test_the_policy_servers_own_fields_pass_only_empty():
    chat = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "prompt_token_ids": None,
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None, "stop_reason": None, "token_ids": None,
                         "message": {"role": "assistant", "content": "hi", "reasoning": None}}]}  # fmt: skip
    sdk_schemas.check(sdk_schemas.WHOLE["chat"], json.dumps(chat))
    leaked = json.dumps(chat | {"prompt_token_ids": [1, 2, 3]})
    with pytest.raises(sdk_schemas.NotConformant, match=r"\$\.prompt_token_ids: the policy server's field, but not"):
        sdk_schemas.check(sdk_schemas.WHOLE["chat"], leaked)


def test_a_stream_event_is_checked_against_the_member_its_type_names():
    """The event unions are discriminated by ``type``: a wrong field is named on that event's own type."""
    with pytest.raises(sdk_schemas.NotConformant, match=r"\$\.index: no such field in RawMessageStopEvent"):
        sdk_schemas.check(sdk_schemas.EVENT["messages"], '{"type": "message_stop", "index": 0}')
    wrong_delta = r"(?s)not a ResponseTextDeltaEvent: .*\ndelta\n  Input should be a valid string"
    with pytest.raises(sdk_schemas.NotConformant, match=wrong_delta):
        sdk_schemas.check(sdk_schemas.EVENT["responses"], '{"type": "response.output_text.delta", "delta": 1}')
    with pytest.raises(sdk_schemas.NotConformant, match="none of the stream's event types"):
        sdk_schemas.check(sdk_schemas.EVENT["responses"], '{"type": "response.finished"}')


@pytest.mark.parametrize("arguments", ['"Paris"', "[1, 2]", "3", "null", "not json"])
def test_a_tool_call_whose_arguments_are_no_object_is_still_a_tool_use_block(arguments):
    """Anthropic's ``tool_use.input`` is an object; a policy can write any JSON (or none) as a tool call's
    arguments, and the answer must stay a ``Message`` (the arguments kept, as text, under one key)."""
    call = {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    chat = {"id": "chatcmpl-1", "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 2},
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "tool_calls": [call]}}]}  # fmt: skip
    added = messages.prepare_request("messages", {"model": "m", "max_tokens": 5, "messages": PLAIN})
    _, whole = added.finish(chat)
    sdk_schemas.check(sdk_schemas.WHOLE["messages"], json.dumps(whole))
    assert whole["content"][0]["input"] == {"_raw_arguments": arguments}


# --- third-party clients: the Vercel AI SDK and the OpenAI Agents SDK ---------------------------------------------


def js_client(package: str, script: str, tmp_path: Path) -> list[str]:
    """The command that runs one of ``clients/``'s scripts against the pinned package (scripts/harness.sh installs
    it once; a script imports it from a ``node_modules`` link beside it)."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the JS clients cannot run")
    found = subprocess.run([str(repo_root() / "scripts" / "harness.sh"), package], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip(f"{package} cannot be installed (scripts/harness.sh {package}): {found.stderr.strip()[-500:]}")
    work = tmp_path / package
    work.mkdir()
    (work / "node_modules").symlink_to(found.stdout.strip())
    shutil.copy(CLIENTS / script, work / script)
    return ["node", str(work / script)]


def run_client(command: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    run = subprocess.run([*command, json.dumps(spec)], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert run.returncode == 0, f"the client failed ({run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def segment_breaks(calls: list[dict]) -> list[dict]:
    """The calls that start a new segment: a prompt that extends no earlier call's prompt and completion ids (a
    prompt that extends an earlier call other than the one before it is a branch the client made, not a break)."""
    breaks = []
    for index, after in enumerate(calls[1:], start=1):
        prompt = list(after["prompt_token_ids"])
        sequences = [list(c["prompt_token_ids"]) + list(c["completion_token_ids"]) for c in calls[:index]]
        if not any(prompt[: len(s)] == s for s in sequences):
            breaks.append(after)
    return breaks


def assert_one_segment(calls: list[dict]) -> None:
    """One segment per conversation: every prompt extends an earlier call's ids exactly, nothing re-tokenized or
    rendered anew (with ``store`` on, the AI SDK's later turn refers to the earlier turn's answer and leaves out its
    tool call and result: its prompt extends the turn's first call, a branch). Known gap (xfail, said): a client
    that resends the model's tool call by value with no stored response to name it (Chat, Messages, ``store``
    off) makes the prompt re-render without the sampled call text (SmolLM2's template renders no tool call), and
    tokens-in continuation (sidecar/continuation.py) finds no earlier call's text there: ``rewrite``, a fork. Any
    other break fails."""
    breaks = segment_breaks(calls)
    shown = [f"seq {c['seq']}: prefix {c['prefix_len']} ({c['continuation']}: {c['note']})" for c in breaks]
    assert all(c["continuation"] == "rewrite" for c in breaks), shown
    if breaks:
        pytest.xfail(f"served and recorded ok, but not one segment (tokens-in finds a rewrite): {shown}")


def assert_served_and_recorded(sidecar, episode: str, answers: int) -> list[dict]:
    """Every step the client made was served and recorded ok, one record per step."""
    calls = episode_calls(sidecar.store, episode, answers)
    assert len(calls) == answers and all(c["status"] == "ok" for c in calls), call_table(calls)
    assert all(c["prompt_token_ids"] and c["completion_token_ids"] for c in calls)
    return calls


AI_SDK_CASES = {  # id: (api, stream, store)
    "chat-whole": ("chat", False, None), "chat-stream": ("chat", True, None),
    "responses-store-default-whole": ("responses", False, None),
    "responses-store-default-stream": ("responses", True, None),
    "responses-store-false": ("responses", False, False),
    "messages-whole": ("messages", False, None), "messages-stream": ("messages", True, None),
}  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("case", list(AI_SDK_CASES))
def test_the_ai_sdks_tool_loop_is_served_and_recorded(start_sidecar, policy_server, tmp_path, case):
    """Two user turns, each a tool loop (the tool call, its result, the answer); the second turn sends the first's
    history as the SDK keeps it (with ``store`` on, Responses refers to the earlier answer's items by id)."""
    api, stream, store = AI_SDK_CASES[case]
    command = js_client("ai-sdk", "ai_sdk_loop.mjs", tmp_path)
    sidecar = start_sidecar(policy_server.base_url, episode_id=None)
    result = run_client(command, {"api": api, "baseURL": f"{sidecar.url}/v1", "episode": case, "stream": stream,
                                  "store": store, "system": SYSTEM, "messages": FIRST,
                                  "turns": ["And the weather in Rome?"], "maxSteps": MAX_STEPS})  # fmt: skip
    steps = result["steps"]
    assert steps[0]["toolCalls"] == [{"name": "get_weather", "input": {"city": "Berlin"}}] and steps[0]["toolResults"]
    calls = assert_served_and_recorded(sidecar, case, len(steps))
    assert [c["response_id"] for c in calls] == [s["responseId"] for s in steps]
    assert [s["usage"]["inputTokens"] for s in steps] == [c["prompt_len"] for c in calls]
    assert [s["usage"]["outputTokens"] for s in steps] == [len(c["completion_token_ids"]) for c in calls]
    assert {c["harness"] for c in calls} == {"ai-sdk"}
    if api == "responses":  # with store on, the SDK's later requests refer to earlier output; with it off, never
        referred = ['"item_reference"' in c["request_json"] for c in calls]
        assert any(referred) == (store is None), referred
    assert_one_segment(calls)


@pytest.mark.integration
def test_the_openai_agents_sdks_default_loop_is_served_and_recorded(start_sidecar, policy_server, tmp_path):
    command = js_client("openai-agents", "openai_agents_loop.mjs", tmp_path)
    sidecar = start_sidecar(policy_server.base_url, episode_id=None)
    assistant = {"type": "message", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": CALLED_BEFORE}]}  # fmt: skip
    result = run_client(command, {"baseURL": f"{sidecar.url}/v1", "episode": "agents", "system": SYSTEM,
                                  "input": [FIRST[0], assistant, FIRST[2]], "maxTurns": 4})  # fmt: skip
    responses = result["responses"]
    # A final answer, or every turn a tool call (SmolLM2 shown its own call text, tokens-in, calls the tool again)
    assert result["toolRuns"] >= 1 and len(responses) >= 2, result
    assert result.get("finalOutput") or result.get("maxTurnsExceeded"), result
    calls = assert_served_and_recorded(sidecar, "agents", len(responses))
    assert [c["response_id"] for c in calls] == [r["responseId"] for r in responses]
    assert [r["usage"]["inputTokens"] for r in responses] == [c["prompt_len"] for c in calls]
    assert [r["usage"]["outputTokens"] for r in responses] == [len(c["completion_token_ids"]) for c in calls]
    assert {c["harness"] for c in calls} == {"openai-agents"}  # its user agent: Agents/JavaScript <version>
    assert_one_segment(calls)
