"""Tokens-in continuation for OpenAI Responses (Codex's API; sidecar/continuation.py): a history resent as text
that re-tokenizes differently is served by vLLM's own /v1/responses given the sampled ids (its decode-side token
reuse), so the episode stays one segment and the harness gets the answer the normal path would give.

The pure parts on their own; the rest against the real vLLM server and the real sidecar (mitmdump), the records
read back through the real collector.
"""

import asyncio
import copy
import json
from array import array

import httpx
import pytest

from sidecar import continuation
from sidecar.apis import responses
from sidecar.apis.base import Sampled, Served
from tests.sidecar.test_continuation import NEWLINE, _episode, assert_continued_exactly
from tests.support.sidecar import read_calls, wait_for

EOT = 2
READ_SCHEMA: dict = {"type": "object", "properties": {"path": {"type": "string"}}}
FUNCTION_TOOL = {"type": "function", "name": "read", "description": "read a file", "parameters": READ_SCHEMA}
CUSTOM_TOOL = {"type": "custom", "name": "read", "description": "read a file"}


def _few_shot(argument: str) -> list[dict]:
    """Two worked turns whose answers are hermes tool calls, then the turn the policy answers (greedy: a call)."""

    def call(path: str) -> str:
        return f'<tool_call>\n{{"name": "read", "arguments": {{"{argument}": "{path}"}}}}\n</tool_call>'

    return [
        {"role": "user", "content": "Read a.txt"}, {"role": "assistant", "content": call("a.txt")},
        {"role": "user", "content": "Read b.txt"}, {"role": "assistant", "content": call("b.txt")},
        {"role": "user", "content": "Read notes.txt"},
    ]  # fmt: skip


# -- pure parts -------------------------------------------------------------------------------------------------
class _CannedServer(continuation.Continuations):
    """vLLM's render and detokenize, canned: the earlier answer's id 10 re-renders as 12 13."""

    def __init__(self, rendered_ids: list[int], mode: str = "auto") -> None:
        super().__init__(mode)
        self.end_of_turn = {"m": EOT}
        self.rendered_ids = rendered_ids
        self.paths: list[str] = []

    async def _call(self, path: str, payload: dict) -> dict:
        self.paths.append(path)
        if path in (continuation.RENDER_PATH, continuation.RESPONSES_RENDER_PATH):
            return {"token_ids": self.rendered_ids, "sampling_params": {"max_tokens": 92}}
        return {"prompt": "the same text"}  # /detokenize: both spellings decode alike


def _examine(body: dict, mode: str = "auto"):
    added = responses.prepare_request("responses", body)
    server = _CannedServer([1, 5, 6, 12, 13, EOT, 198, 7], mode)
    packed = array("i", [1, 5, 6, 10, EOT]).tobytes()
    found = asyncio.run(server.examine("responses", [("c0", packed)], body, added, "/v1/responses"))
    return server, found


def test_a_responses_call_is_rendered_by_responses_and_served_by_its_own_endpoint_with_the_ids():
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "y"}]}
    history = [{"role": "user", "content": "x"}, said, {"role": "user", "content": "z"}]
    asked = {"model": "m", "input": history, "stream": True, "max_output_tokens": 50}
    body = copy.deepcopy(asked)
    server, found = _examine(body)
    assert found is not None
    decision, request = found
    assert server.paths[0] == continuation.RESPONSES_RENDER_PATH
    assert decision.state == "tokens_in" and request is not None
    # The prepared call as it was (stream, bound, ids and logprobs asked), with the prompt ids given.
    assert request["kv_transfer_params"] == {"prompt_token_ids": [1, 5, 6, 10, EOT, 198, 7]}
    assert {k: v for k, v in request.items() if k != "kv_transfer_params"} == body
    assert request["enable_response_messages"] and request["stream"] and request["max_output_tokens"] == 50
    _, observed = _examine(copy.deepcopy(asked), mode="observe")
    assert observed is not None and observed[0].state == "retokenized" and observed[1] is None


@pytest.mark.parametrize(
    "extra",
    [{"previous_response_id": "resp_1"}, {"enable_response_messages": True}, {"kv_transfer_params": {"a": 1}}],
)
def test_a_responses_call_whose_history_or_ids_are_not_all_in_the_request_is_not_examined(extra):
    """A stored history (previous_response_id) is not in what the render sees; a harness that asked for the
    message ids, or set reuse itself, gets the normal path."""
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "y"}]}
    body = {"model": "m", "input": [{"role": "user", "content": "x"}, said, {"role": "user", "content": "z"}], **extra}
    _, found = _examine(body)
    assert found is None


class _Inner:
    """A Responses module's additions, canned: the answer's prompt ids are ``seen``."""

    api, stream, upstream_path = "responses", False, None

    def __init__(self, seen: list[int]) -> None:
        self.seen = seen

    def finish(self, answer: dict) -> tuple[Sampled, dict]:
        return Sampled(prompt_ids=self.seen), answer

    def stream_state(self):
        raise NotImplementedError

    def error_event(self, message: str) -> bytes:
        return b"event: error\n\n"


@pytest.mark.parametrize("seen, state", [([1, 2, 3], "tokens_in"), ([1, 9], "retokenized")])
def test_a_call_vllm_rendered_itself_is_recorded_as_served_normally(seen, state):
    """vLLM renders the prompt instead of taking the ids for non-text content: the answer's prompt ids say which."""
    decision = continuation.Decision("tokens_in", note="served tokens-in")
    served: Served = continuation.ReusedIds(_Inner(seen), [1, 2, 3], decision)
    served.finish({})
    assert decision.state == state and ("rendered the prompt" in (decision.note or "")) == (state != "tokens_in")


# -- against the real vLLM: the tokens-in answer is the normal path's ------------------------------------------
def _serve(vllm, request: dict, tokens_in: bool) -> tuple[Sampled, object]:
    """Serve a Responses request by the normal path or tokens-in (vLLM's own rendering of it as the ids given):
    the sampled view and what the harness gets (a whole answer, or its stream's event payloads)."""
    body = copy.deepcopy(request)
    added: Served = responses.prepare_request("responses", body)
    decision = continuation.Decision("tokens_in")
    if tokens_in:
        rendered = vllm.post(continuation.RESPONSES_RENDER_PATH, json={**body, "stream": False}).json()["token_ids"]
        added = continuation.ReusedIds(added, rendered, decision)
        body = continuation.reused_ids_request(body, rendered)
    answer = vllm.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    out: object
    if not body.get("stream"):
        sampled, out = added.finish(answer.json())
    else:
        state = added.stream_state()
        raw = [event.encode() + b"\n\n" for event in answer.text.split("\n\n") if event.strip()]
        out = [json.loads(e.decode().split("data: ", 1)[1]) for r in raw for e in state.feed_event(r)]
        assert state.done
        sampled = state.sampled
    assert decision.state == "tokens_in", decision.note  # vLLM took the ids
    return sampled, out


VARYING = ("id", "created_at", "call_id", "item_id")  # differ between any two answers


def _comparable(out: object) -> object:
    if isinstance(out, dict):
        return {k: _comparable(v) for k, v in out.items() if k not in VARYING}
    if isinstance(out, list):
        return [_comparable(v) for v in out]
    return out


def _reassembled(events: object) -> dict:
    """A stream as the harness reads it: event kinds in order (a run of deltas as one), the text and arguments,
    the finished items, the final response. How the deltas are cut depends on engine timing."""
    assert isinstance(events, list)
    kinds: list[str] = []
    text = arguments = ""
    for event in events:
        if not kinds or kinds[-1] != event["type"]:
            kinds.append(event["type"])
        if event["type"] == "response.output_text.delta":
            text += event["delta"]
        if event["type"] in ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta"):
            arguments += event["delta"]
    done = [_comparable(e["item"]) for e in events if e["type"] == "response.output_item.done"]
    return {"kinds": kinds, "text": text, "arguments": arguments, "items": done,
            "final": _comparable(events[-1]["response"])}  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("tool", ["function", "custom"])
@pytest.mark.parametrize("stream", [False, True])
def test_tokens_in_answer_equals_the_normal_path(tool, stream, policy_server, vllm):
    """Greedy, on a canonically tokenized history with a tool call in the answer: served tokens-in, the harness
    gets what the normal path gives it (whole, or the streamed events), and the same ids are recorded."""
    request = {"model": policy_server.name, "input": _few_shot("path" if tool == "function" else "input"),
               "tools": [FUNCTION_TOOL if tool == "function" else CUSTOM_TOOL], "max_output_tokens": 40,
               "temperature": 0, "stream": stream}  # fmt: skip
    (normal_sampled, normal), (ours_sampled, ours) = (_serve(vllm, request, t) for t in (False, True))
    assert ours_sampled.completion_ids == normal_sampled.completion_ids and normal_sampled.completion_ids
    assert ours_sampled.prompt_ids == normal_sampled.prompt_ids
    assert ours_sampled.logprobs == pytest.approx(normal_sampled.logprobs, abs=1e-3, nan_ok=True)
    assert "prompt_token_ids" not in json.dumps(ours)  # the ids given are never shown to the harness
    if stream:
        normal, ours = _reassembled(normal), _reassembled(ours)
    item = "function_call" if tool == "function" else "custom_tool_call"
    assert f'"{item}"' in json.dumps(normal) and "notes.txt" in json.dumps(normal), normal  # a tool call, both ways
    assert _comparable(ours) == _comparable(normal)


# -- against the real sidecar: one segment, exact ids; a changed text forks ------------------------------------
def _respond(client: httpx.Client, items: list[dict], **extra) -> str:
    """One Responses call through the sidecar; the answer's text."""
    answer = client.post("/v1/responses", json={"model": "any", "input": items, "tools": [FUNCTION_TOOL], **extra})
    assert answer.status_code == 200, answer.text
    assert "prompt_token_ids" not in answer.text and 'input_messages":[' not in answer.text
    if extra.get("stream"):
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    output = answer.json()["output"]
    return "".join(c["text"] for i in output if i["type"] == "message" for c in i["content"])


@pytest.mark.integration
def test_retokenized_responses_history_is_served_tokens_in_and_stays_one_segment(
    start_sidecar, policy_server, vllm, tokenizer
):  # fmt: skip
    """A first answer of newline ids that re-tokenize differently (a chat call: only it can hold the sampling to
    one id), then two Responses turns resending the history as text (whole, then streamed) are served tokens-in;
    a turn whose earlier answer was edited forks as a rewrite."""
    sidecar = start_sidecar(policy_server.base_url, episode_id=None, extra=("--trust-episode-header",))
    with httpx.Client(base_url=sidecar.url, headers={"x-forge-episode-id": "ep-resp"}, timeout=300) as client:
        first = [{"role": "user", "content": "Write six empty lines."}]
        forced = {"max_tokens": 6, "temperature": 1.0, "allowed_token_ids": [NEWLINE]}
        answer = client.post("/v1/chat/completions", json={"model": "any", "messages": first, **forced})
        assert answer.status_code == 200, answer.text
        text1 = answer.json()["choices"][0]["message"]["content"]
        second = [*first, {"role": "assistant", "content": text1}, {"role": "user", "content": "Again, shorter."}]
        text2 = _respond(client, second, max_output_tokens=8, temperature=1.0)
        third = [*second, {"role": "assistant", "content": text2}, {"role": "user", "content": "Once more."}]
        _respond(client, third, max_output_tokens=8, temperature=1.0, stream=True)
        edited = [*first, {"role": "assistant", "content": "Something else entirely."},
                  {"role": "user", "content": "Again, shorter."}]  # fmt: skip
        _respond(client, edited, max_output_tokens=4, temperature=1.0)
    calls = wait_for(lambda: (c := read_calls(sidecar.store)) and len(c) == 4 and c, what="4 records", timeout=60)
    assert all(c["status"] == "ok" for c in calls), [(c["status"], c["error"]) for c in calls]
    first_call, second_call, third_call, edited_call = calls
    assert [c["continuation"] for c in calls] == [None, "tokens_in", "tokens_in", "rewrite"], [c["note"] for c in calls]
    for earlier, call in ((first_call, second_call), (second_call, third_call)):
        # the record keeps the request as the harness sent it
        assert "kv_transfer_params" not in json.loads(call["request_json"])
        assert_continued_exactly(vllm, policy_server, tokenizer, earlier, call)
    segments, causes = _episode(sidecar.store, "ep-resp")
    assert [s["n_calls"] for s in segments] == [3, 1], [(s["fork_reason"], s["call_ids"]) for s in segments]
    assert [c["cause"] for c in causes] == ["rewrite"] and causes[0]["call_id"] == edited_call["call_id"]
