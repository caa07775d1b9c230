"""Tokens-in through vLLM's own chat path (sidecar/continuation.py): a prompt given as ids
(``kv_transfer_params.prompt_token_ids``) is answered as the same prompt given as messages on the normal path.

Against a real vLLM server run as `forge serve` runs it (hermes tool parser) plus a reasoning parser (``olmo3``: it
finds ``<think>`` as text, which SmolLM2's vocabulary has no token for), through the wire modules as the sidecar
uses them (``prepare_request``, then ``finish`` or ``stream_state``; tokens-in wrapped in ``ReusedIds``): content,
reasoning, tool calls, finish reason, completion ids and logprobs, for tools with ``tool_choice`` absent / null /
"none" / "auto" / named, streamed and not, greedy and sampled with a seed; and the completion bound vLLM derives
from the ids' length.
"""

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from forge.errors import ForgeError
from sidecar import continuation
from sidecar.apis import messages, openai
from sidecar.apis.base import Sampled
from trainer.model import PreparedModel
from trainer.serve import PolicyServer, default_checkpoint, free_port

pytestmark = pytest.mark.integration

CONTEXT = 4096
LOGPROB_TOLERANCE = 1e-3
READ_SCHEMA: dict = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
TOOLS = [{"type": "function", "function": {"name": "read", "description": "read a file", "parameters": READ_SCHEMA}}]


def _turn(name: str) -> list[dict[str, str]]:
    call = json.dumps({"name": "read", "arguments": {"path": name}})
    return [
        {"role": "user", "content": f"Read {name}"},
        {"role": "assistant", "content": f"<think>The user wants {name}.</think>\n<tool_call>\n{call}\n</tool_call>"},
    ]


# Worked turns whose answers think, then call the tool: greedy, the policy answers the last turn the same way.
HISTORY = [*_turn("a.txt"), *_turn("b.txt"), *_turn("c.txt"), {"role": "user", "content": "Read notes.txt"}]
ABSENT = object()
TOOL_CHOICES = {"absent": ABSENT, "null": None, "none": "none", "auto": "auto",
                "named": {"type": "function", "function": {"name": "read"}}}  # fmt: skip
SAMPLING: dict[str, dict[str, Any]] = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "seed": 1234}}


@pytest.fixture(scope="module")
def reasoning_server(prepared_model: PreparedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`forge serve`'s vLLM with a reasoning parser (a second, small server: 4096 context). For development only,
    ``FORGE_TEST_REASONING_PORT`` names one already running on that loopback port."""
    if port := os.environ.get("FORGE_TEST_REASONING_PORT"):
        yield f"http://127.0.0.1:{port}"
        return
    server = PolicyServer(
        model=default_checkpoint(), port=free_port(), max_model_len=CONTEXT, start_timeout=300.0,
        run_dir=tmp_path_factory.mktemp("vllm-reasoning"), extra_args=["--reasoning-parser", "olmo3"],
    )  # fmt: skip
    try:
        server.start()
    except ForgeError as error:
        pytest.fail(f"the vLLM server did not start: {error}")
    yield server.base_url
    server.stop()


@pytest.fixture(scope="module")
def client(reasoning_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=reasoning_server, timeout=300.0) as http:
        yield http


@pytest.fixture(scope="module")
def model(client: httpx.Client) -> str:
    return str(client.get("/v1/models").json()["data"][0]["id"])


def _events(text: str) -> list[bytes]:
    return [event.encode() + b"\n\n" for event in text.split("\n\n") if event.strip()]


def _serve(client: httpx.Client, api: str, request: dict[str, Any], tokens_in: bool) -> tuple[Sampled, Any]:
    """One call as the sidecar serves it: prepared by its wire module, sent to vLLM's chat endpoint (tokens-in:
    with the ids of vLLM's own rendering of it), the answer taken back by the module: (ids, what the harness gets)."""
    body = json.loads(json.dumps(request))
    added: Any = (openai if api == "chat" else messages).prepare_request(api, body)
    if tokens_in:
        rendered = client.post(continuation.RENDER_PATH, json={**body, "stream": False, "stream_options": None})
        assert rendered.status_code == 200, rendered.text
        ids = rendered.json()["token_ids"]
        decision = continuation.Decision("tokens_in")
        added = continuation.ReusedIds(added, ids, decision)
        body = continuation.reused_ids_request(body, ids)
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    if added.stream:
        state = added.stream_state()
        out: Any = [e.decode() for raw in _events(answer.text) for e in state.feed_event(raw)]
        sampled = state.sampled
    else:
        sampled, out = added.finish(answer.json())
    if tokens_in:  # the ids were taken as given
        assert sampled.prompt_ids == ids and decision.state == "tokens_in", decision.note
    return sampled, out


def _chat_view(out: Any, stream: bool) -> dict[str, Any]:
    """What a Chat Completions harness reads: content, reasoning, tool calls (name, arguments), finish reason; for
    a stream, reassembled from its deltas, with the count of empty content deltas."""
    view: dict[str, Any] = {"content": None, "reasoning": None, "tools": [], "finish": None, "empty": 0}
    if not stream:
        choice = out["choices"][0]
        message = choice["message"]
        calls = message.get("tool_calls") or []
        view.update(content=message.get("content"), reasoning=message.get("reasoning"), finish=choice["finish_reason"],
                    tools=[[c["function"]["name"], json.loads(c["function"]["arguments"])] for c in calls])  # fmt: skip
        return view
    pieces: dict[str, list[str]] = {"content": [], "reasoning": []}
    arguments: list[list[Any]] = []
    for event in out:
        data = next((line[6:] for line in event.splitlines() if line.startswith("data: ")), None)
        if not data or data == "[DONE]":
            continue
        for choice in json.loads(data).get("choices") or []:
            delta = choice.get("delta") or {}
            if "content" in delta and delta["content"] == "" and delta.get("role") is None:
                view["empty"] += 1
            for key in pieces:
                if delta.get(key):
                    pieces[key].append(delta[key])
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if fn.get("name"):
                    arguments.append([fn["name"], ""])
                arguments[-1][1] += fn.get("arguments") or ""
            view["finish"] = choice.get("finish_reason") or view["finish"]
    view["content"] = "".join(pieces["content"]) or None
    view["reasoning"] = "".join(pieces["reasoning"]) or None
    view["tools"] = [[name, json.loads(args or "{}")] for name, args in arguments]
    return view


def _messages_view(out: Any, stream: bool) -> dict[str, Any]:
    """What an Anthropic Messages harness reads: its content blocks (type, text/thinking/name+input), stop reason."""
    if not stream:
        whole = [{k: v for k, v in b.items() if k not in ("id", "signature")} for b in out["content"]]
        return {"blocks": whole, "stop": out["stop_reason"]}
    blocks: list[dict[str, Any]] = []
    stop = None
    for event in out:
        data = next((line[6:] for line in event.splitlines() if line.startswith("data: ")), None)
        if not data:
            continue
        payload = json.loads(data)
        if payload["type"] == "content_block_start":
            block = {k: v for k, v in payload["content_block"].items() if k not in ("id", "signature")}
            blocks.append({**block, "partial": ""} if block["type"] == "tool_use" else block)
        delta = payload.get("delta") or {}
        if payload["type"] == "content_block_delta":
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}.get(delta["type"])
            if key:
                blocks[-1][key] = blocks[-1].get(key, "") + delta.get("partial_json" if key == "partial" else key, "")
        stop = delta.get("stop_reason") or stop
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial") or "{}")
    return {"blocks": blocks, "stop": stop}


def _assert_same(normal: Sampled, ours: Sampled) -> None:
    assert ours.completion_ids == normal.completion_ids and normal.completion_ids
    assert ours.finish_reason == normal.finish_reason
    assert len(ours.logprobs) == len(normal.logprobs)
    for a, b in zip(ours.logprobs, normal.logprobs, strict=True):
        assert math.isclose(a, b, abs_tol=LOGPROB_TOLERANCE), (ours.logprobs, normal.logprobs)


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", list(TOOL_CHOICES))
def test_chat_given_as_ids_is_answered_as_given_as_messages(client, model, tool_choice, stream, sampling):
    request: dict[str, Any] = {"model": model, "messages": HISTORY, "tools": TOOLS, "max_tokens": 48,
                               "stream": stream, **SAMPLING[sampling]}  # fmt: skip
    if TOOL_CHOICES[tool_choice] is not ABSENT:
        request["tool_choice"] = TOOL_CHOICES[tool_choice]
    (normal, normal_out), (ours, ours_out) = (_serve(client, "chat", request, t) for t in (False, True))
    _assert_same(normal, ours)
    expected = _chat_view(normal_out, stream)
    assert _chat_view(ours_out, stream) == expected
    if sampling == "greedy" and not stream:  # the case is what it is meant to be: the parsers ran or not
        # (vLLM's own stream differs from its whole answer here, both ways alike: it parses tool calls for an
        # explicit null and leaves olmo3's <think> in content next to a tool call)
        assert bool(expected["tools"]) == (tool_choice in ("absent", "auto", "named")), expected
        assert (expected["reasoning"] is not None) == (tool_choice != "named"), expected


def _two_calls(a: str, b: str) -> list[dict[str, str]]:
    calls = [json.dumps({"name": "read", "arguments": {"path": name}}) for name in (a, b)]
    return [{"role": "user", "content": f"Read {a} and {b}"},
            {"role": "assistant", "content": "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)}]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "one"])
def test_parallel_tool_calls_are_obeyed_as_on_the_normal_path(client, model, parallel, stream):
    """Greedy, the policy calls the tool twice; ``parallel_tool_calls: false`` keeps the first call only."""
    history = [*_two_calls("a.txt", "b.txt"), *_two_calls("c.txt", "d.txt"),
               {"role": "user", "content": "Read e.txt and f.txt"}]  # fmt: skip
    request = {"model": model, "messages": history, "tools": TOOLS, "max_tokens": 90, "temperature": 0,
               "stream": stream, "parallel_tool_calls": parallel}  # fmt: skip
    (normal, normal_out), (ours, ours_out) = (_serve(client, "chat", request, t) for t in (False, True))
    _assert_same(normal, ours)
    expected = _chat_view(normal_out, stream)
    assert _chat_view(ours_out, stream) == expected
    if not stream:
        assert len(expected["tools"]) == (2 if parallel else 1), expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", ["absent", "auto", "named", "none"])
def test_messages_given_as_ids_are_answered_as_given_as_messages(client, model, tool_choice, stream):
    """Greedy only: the Anthropic API has no seed (sidecar/apis/messages.py sends none), so two sampled answers
    differ whichever way the prompt is given."""
    choices = {"auto": {"type": "auto"}, "named": {"type": "tool", "name": "read"}, "none": {"type": "none"}}
    request: dict[str, Any] = {
        "model": model, "max_tokens": 48, "stream": stream, "temperature": 0,
        "tools": [{"name": "read", "description": "read a file", "input_schema": READ_SCHEMA}],
        "messages": HISTORY, **({"tool_choice": choices[tool_choice]} if tool_choice in choices else {}),
    }  # fmt: skip
    (normal, normal_out), (ours, ours_out) = (_serve(client, "messages", request, t) for t in (False, True))
    _assert_same(normal, ours)
    assert _messages_view(ours_out, stream) == _messages_view(normal_out, stream)


def test_the_completion_bound_follows_the_ids_given(client, model):
    """vLLM bounds a call given as ids by the room the ids leave (``get_max_tokens``), not by the rendered text's:
    ids far longer than the rendering leave a few; the bound sent still bounds a shorter prompt."""
    request = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "temperature": 0,
               "ignore_eos": True, "stream": False}  # fmt: skip
    rendered = client.post(continuation.RENDER_PATH, json=request).json()["token_ids"]
    for ids, max_tokens, served in (
        (rendered[:-3] + [198] * (CONTEXT - 5 - len(rendered)) + rendered[-3:], None, 5),  # longer: the room left
        (rendered[:-3] + [198] * (CONTEXT - 5 - len(rendered)) + rendered[-3:], 9, 5),  # the room, below the bound
        (rendered, 4, 4),  # the bound sent
    ):
        body = {**request, **({"max_tokens": max_tokens} if max_tokens else {})}
        answer = client.post("/v1/chat/completions", json=continuation.reused_ids_request(body, ids)).json()
        assert answer["usage"]["prompt_tokens"] == len(ids), answer
        assert answer["usage"]["completion_tokens"] == served and answer["choices"][0]["finish_reason"] == "length"
