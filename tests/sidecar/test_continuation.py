"""Tokens-in continuation (sidecar/continuation.py): a history resent as text that re-tokenizes differently is
served from the ids vLLM sampled, so the episode stays one segment; a history whose text changed forks.

The pure parts are checked on their own; the rest against the real vLLM server and the real sidecar (mitmdump),
with the records read back through the real collector (DuckDB over the Parquet store).
"""

import asyncio
import json
from array import array

import httpx
import pytest

from bench.tokens_in import render_request
from sidecar import continuation
from sidecar.apis import bound_completion, messages, openai
from sidecar.apis.base import Served
from tests.support.sidecar import assert_sampled_by_vllm, read_calls, wait_for

EOT = 2


# -- pure parts -------------------------------------------------------------------------------------------------
def test_split_finds_the_rerendered_copy_of_a_closed_turn():
    earlier = [1, 5, 6, 10, 11, EOT]  # prompt [1, 5, 6] + completion [10, 11, EOT]
    rendered = [1, 5, 6, 12, EOT, 198, 7]  # 10 + 11 came back as 12
    assert continuation.retokenized_split(earlier, rendered, EOT) == continuation.Split(3, 5)


def test_split_of_a_turn_cut_at_its_bound_leaves_the_closing_token_to_the_added_part():
    earlier = [1, 5, 6, 10, 11]  # no end of turn: finish_reason length
    rendered = [1, 5, 6, 12, EOT, 198, 7]
    assert continuation.retokenized_split(earlier, rendered, EOT) == continuation.Split(3, 4)


def test_split_counts_every_end_of_turn_after_the_divergence():
    earlier = [1, 10, 11, EOT, 198, 3, EOT, 20, EOT]  # diverges in turn 1; turn 2 follows
    rendered = [1, 12, EOT, 198, 3, EOT, 20, EOT, 198, 9]
    assert continuation.retokenized_split(earlier, rendered, EOT) == continuation.Split(1, 8)


def test_no_split_when_the_ids_extend_or_nothing_follows():
    assert continuation.retokenized_split([1, 2], [1, 2, 3], EOT) is None
    assert continuation.retokenized_split([1, 10, EOT], [1, 12, EOT], EOT) is None  # nothing added
    assert continuation.retokenized_split([1, 10, EOT], [1, 12, 13], EOT) is None  # no end of turn at all


class _CannedServer(continuation.Continuations):
    """vLLM's render and detokenize, canned: a context of 100 ids; the earlier answer's id 10 re-renders as 12 13."""

    def __init__(self, rendered_ids: list[int]) -> None:
        super().__init__("auto")
        self.end_of_turn = {"m": EOT}
        self.rendered_ids = rendered_ids

    async def _call(self, path: str, payload: dict) -> dict:
        self.asked = getattr(self, "asked", 0) + 1
        if path == continuation.RENDER_PATH:
            asked = payload.get("max_tokens") or 100
            return {"token_ids": self.rendered_ids, "sampling_params": {"max_tokens": min(asked, 100 - 8)}}
        return {"prompt": "the same text"}  # /detokenize: both spellings decode alike


@pytest.mark.parametrize("asked", [None, 128_000, 50])
def test_a_tokens_in_call_is_bounded_as_its_record_says(asked):
    """The completion bound (apis.bound_completion) is set before continuation renders the call; vLLM renders
    max_tokens for the re-tokenized prompt, whose length differs from the tokens-in prompt's. The tokens-in request
    is the call as prepared (the bound sent) with the ids given, and vLLM bounds the completion by the bound sent and
    the room the ids leave (``get_max_tokens``; checked against the real server in test_tokens_in_parity.py): the
    call's bound for the prompt it is sent (what ``max_tokens_served`` records)."""
    earlier = [1, 5, 6, 10, EOT]
    rendered = [1, 5, 6, 12, 13, EOT, 198, 7]  # 8 ids; the tokens-in prompt is 7
    body: dict = {
        "model": "m",
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"},
            {"role": "user", "content": "z"},
        ],
        **({"max_tokens": asked} if asked else {}),
    }
    bound = bound_completion("chat", body, cap=None, context=100)
    added = openai.prepare_request("chat", body)
    packed = array("i", earlier).tobytes()
    server = _CannedServer(rendered)
    found = asyncio.run(server.examine("chat", [("c0", packed)], body, added, "/v1/chat/completions", bound))
    assert found is not None
    decision, request = found
    assert decision.state == "tokens_in" and request is not None
    prompt = request["kv_transfer_params"][continuation.REUSED_IDS]
    assert prompt == [1, 5, 6, 10, EOT, 198, 7]
    assert request.get("max_tokens") == bound.sent == (min(asked, 100) if asked else None)
    assert {k: v for k, v in request.items() if k != "kv_transfer_params"} == body  # the call as prepared
    assert bound.served(len(prompt)) == min(asked or 100, 100 - 7)


def test_a_tokens_in_prompt_with_no_room_left_is_served_normally():
    """Ids that leave no room in the context for a completion: the normal path answers (vLLM's own error)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                       {"role": "user", "content": "z"}]}  # fmt: skip
    bound = bound_completion("chat", body, cap=None, context=7)
    added = openai.prepare_request("chat", body)
    packed = array("i", [1, 5, 6, 10, EOT]).tobytes()
    server = _CannedServer([1, 5, 6, 12, 13, EOT, 198, 7])
    found = asyncio.run(server.examine("chat", [("c0", packed)], body, added, "/v1/chat/completions", bound))
    assert found is not None and found[1] is None and found[0].state == "retokenized"
    assert "no room" in (found[0].note or "")


def test_a_call_with_no_answer_in_its_history_asks_the_server_nothing():
    """Only a sampled answer sent back as history can be re-tokenized: a call whose messages hold no assistant
    turn (a sub-agent's first call, a fresh question in the same episode) costs no render round trip."""
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x"}]}
    server = _CannedServer([1, 5, 6, 12, 13, EOT, 198, 7])
    packed = array("i", [1, 5, 6, 10, EOT]).tobytes()
    added = openai.prepare_request("chat", body)
    assert asyncio.run(server.examine("chat", [("c0", packed)], body, added, "/v1/chat/completions")) is None
    assert getattr(server, "asked", 0) == 0
    with_answer = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "y"}]}
    asyncio.run(server.examine("chat", [("c0", packed)], with_answer, added, "/v1/chat/completions"))
    assert server.asked >= 1


def test_tokens_in_additions_are_the_wire_apis_own():
    """A call served tokens-in keeps the harness's format: a failed stream ends in its API's error event."""
    body = {"model": "m", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    inner = messages.prepare_request("messages", body)
    served: Served = continuation.ReusedIds(inner, [1, 2], continuation.Decision("tokens_in"))
    assert served.api == "messages" and served.upstream_path == messages.CHAT_PATH and served.stream
    assert served.error_event("broken") == inner.error_event("broken")
    assert b"event: error" in served.error_event("broken")


# -- against the real vLLM: the tokens-in answer is the normal path's ------------------------------------------
READ_SCHEMA: dict = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "read", "description": "read a file", "parameters": READ_SCHEMA}}]
FEW_SHOT = [
    {"role": "user", "content": "Read a.txt"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'},
    {"role": "user", "content": "Read b.txt"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "read", "arguments": {"path": "b.txt"}}\n</tool_call>'},
    {"role": "user", "content": "Read notes.txt"},
]


def _sse_events(text: str) -> list[bytes]:
    return [event.encode() + b"\n\n" for event in text.split("\n\n") if event.strip()]


def _serve(vllm, module, added, body: dict, tokens_in: bool) -> tuple[list[int], object]:
    """Serve a prepared request by the normal path or tokens-in (from vLLM's own rendering of it): the completion
    ids and what the harness gets (a whole answer, or the list of its stream's event payloads)."""
    path, payload = "/v1/chat/completions", body
    if tokens_in:
        rendered = vllm.post("/v1/chat/completions/render", json={**body, "stream": False, "stream_options": None})
        ids = rendered.json()["token_ids"]
        decision = continuation.Decision("tokens_in")
        added = continuation.ReusedIds(added, ids, decision)
        payload = continuation.reused_ids_request(body, ids)
    answer = vllm.post(path, json=payload)
    assert answer.status_code == 200, answer.text
    if not added_stream(added):
        sampled, out = added.finish(answer.json())
    else:
        state = added.stream_state()
        out = [e.decode() for raw in _sse_events(answer.text) for e in state.feed_event(raw)]
        sampled = state.sampled
    if tokens_in:  # vLLM took the ids given (ReusedIds compares the answer's prompt ids with them)
        assert sampled.prompt_ids == ids and decision.state == "tokens_in"
    return sampled.completion_ids, out


def added_stream(added) -> bool:
    return bool(added.stream)


def _comparable(out: object) -> object:
    """What the harness gets, without what differs between any two answers (ids, times, tool-call ids)."""
    if isinstance(out, dict):
        return {k: _comparable(v) for k, v in out.items() if k not in ("id", "created", "system_fingerprint")}
    if isinstance(out, list):
        return [_comparable(v) for v in out]
    return out


@pytest.mark.integration
@pytest.mark.parametrize("api", ["chat", "messages"])
@pytest.mark.parametrize("stream", [False, True])
def test_tokens_in_answer_equals_the_normal_path(api, stream, policy_server, vllm):
    """Greedy, on a canonically tokenized history with a tool call in the answer: served tokens-in (vLLM's own
    rendering of the request as the token prompt) the harness gets what the normal path gives it."""
    if api == "chat":
        request = {"model": policy_server.name, "messages": FEW_SHOT, "tools": TOOLS, "max_tokens": 40,
                   "temperature": 0, "stream": stream}  # fmt: skip
    else:
        request = {"model": policy_server.name, "max_tokens": 40, "temperature": 0, "stream": stream,
                   "tools": [{"name": "read", "description": "read a file", "input_schema": READ_SCHEMA}],
                   "messages": [{"role": m["role"], "content": m["content"]} for m in FEW_SHOT]}  # fmt: skip
    results = []
    for tokens_in in (False, True):
        body = json.loads(json.dumps(request))
        module = openai if api == "chat" else messages
        added = module.prepare_request(api, body)
        results.append(_serve(vllm, module, added, body, tokens_in))
    (normal_ids, normal), (ours_ids, ours) = results
    assert ours_ids == normal_ids and normal_ids
    if stream:  # chunking may differ: compare what the harness reassembles
        normal, ours = _reassembled(api, normal), _reassembled(api, ours)
    assert "notes.txt" in json.dumps(normal), normal  # a tool call, both ways
    assert _comparable(ours) == _comparable(normal)


def _reassembled(api: str, events: object) -> dict:
    assert isinstance(events, list)
    out: dict = {"text": "", "tools": [], "finish": None, "types": []}
    for event in events:
        data = next((line[6:] for line in event.splitlines() if line.startswith("data: ")), None)
        if not data or data == "[DONE]":
            continue
        payload = json.loads(data)
        if api == "chat":
            for choice in payload.get("choices") or []:
                delta = choice.get("delta") or {}
                out["text"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if fn.get("name"):
                        out["tools"].append([fn["name"], ""])
                    out["tools"][-1][1] += fn.get("arguments") or ""
                out["finish"] = choice.get("finish_reason") or out["finish"]
        else:
            if not out["types"] or out["types"][-1] != payload["type"]:
                out["types"].append(payload["type"])
            delta = payload.get("delta") or {}
            out["text"] += delta.get("text") or ""
            if payload["type"] == "content_block_start" and payload["content_block"]["type"] == "tool_use":
                out["tools"].append([payload["content_block"]["name"], ""])
            if delta.get("partial_json"):
                out["tools"][-1][1] += delta["partial_json"]
            out["finish"] = delta.get("stop_reason") or out["finish"]
    out["tools"] = [[name, json.loads(args or "{}")] for name, args in out["tools"]]
    return out


# -- against the real sidecar: one segment, exact ids; a changed text forks ------------------------------------
NEWLINE = 198  # "\n": sampled six times in a row, the template re-tokenizes the text as longer newline tokens


def _chat(client: httpx.Client, messages_: list[dict], **extra) -> str:
    answer = client.post("/v1/chat/completions", json={"model": "any", "messages": messages_, **extra})
    assert answer.status_code == 200, answer.text
    if extra.get("stream"):
        text = ""
        for line in answer.text.splitlines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    text += (choice.get("delta") or {}).get("content") or ""
        return text
    return answer.json()["choices"][0]["message"]["content"]


def assert_continued_exactly(vllm, policy_server, tokenizer, earlier: dict, call: dict) -> None:
    """A call recorded as served tokens-in: its prompt is the earlier call's prompt + completion, exactly, then the
    template's rendering of what was added, where vLLM's own rendering of the request re-tokenized the same text
    differently; its completion passes teacher forcing."""
    whole = earlier["prompt_token_ids"] + earlier["completion_token_ids"]
    path, request = render_request(call, policy_server.name)
    rendered = vllm.post(path, json=request).json()["token_ids"]
    prompt = call["prompt_token_ids"]
    added = len(prompt) - len(whole)
    assert prompt[: len(whole)] == whole and added > 0 and prompt[len(whole) :] == rendered[-added:]
    assert rendered != prompt and rendered[:-added] != whole
    assert tokenizer.decode(rendered[:-added]) == tokenizer.decode(whole)
    assert call["parent_call_id"] == earlier["call_id"] and call["prefix_len"] == len(whole)
    assert "served tokens-in" in call["note"]
    assert_sampled_by_vllm(vllm, policy_server, call)


def _episode(store: str, episode: str) -> tuple[list[dict], list[dict]]:
    from collector.report import fork_causes
    from collector.sql import connect

    con = connect(store, episodes=True, idle_seconds=0)
    query = "SELECT * EXCLUDE (input_ids, loss_mask, behaviour_logprobs) FROM segments WHERE episode_id = ?"
    segments = con.execute(query + " ORDER BY segment", [episode]).arrow().read_all().to_pylist()
    return segments, [c for c in fork_causes(con) if c["episode_id"] == episode]


def _conversation(sidecar_url: str, episode: str, *, rewrite: bool) -> list[str]:
    """Four calls: a sampled answer of ids that re-tokenize differently, two turns resending the history as text
    (one streamed, one through Anthropic Messages), then (``rewrite``) a turn whose earlier answer was edited."""
    headers = {"x-forge-episode-id": episode}
    with httpx.Client(base_url=sidecar_url, headers=headers, timeout=300) as client:
        first = [{"role": "user", "content": "Write six empty lines."}]
        text1 = _chat(client, first, max_tokens=6, temperature=1.0, allowed_token_ids=[NEWLINE])
        second = [*first, {"role": "assistant", "content": text1}, {"role": "user", "content": "Again, shorter."}]
        text2 = _chat(client, second, max_tokens=8, temperature=1.0, stream=True)
        third = [*second, {"role": "assistant", "content": text2}, {"role": "user", "content": "Once more."}]
        answer = client.post("/v1/messages", json={"model": "claude-x", "max_tokens": 8, "temperature": 1.0,
                                                   "messages": third, "stream": True})  # fmt: skip
        assert answer.status_code == 200 and "message_stop" in answer.text, answer.text
        texts = [text1, text2]
        if rewrite:
            edited = [*first, {"role": "assistant", "content": "Something else entirely."},
                      {"role": "user", "content": "Again, shorter."}]  # fmt: skip
            _chat(client, edited, max_tokens=4, temperature=1.0)
    return texts


@pytest.mark.integration
def test_retokenized_history_is_served_tokens_in_and_stays_one_segment(
    start_sidecar, policy_server, vllm, tokenizer
):  # fmt: skip
    sidecar = start_sidecar(policy_server.base_url, episode_id=None, extra=("--trust-episode-header",))
    _conversation(sidecar.url, "ep-retok", rewrite=True)
    calls = wait_for(lambda: (c := read_calls(sidecar.store)) and len(c) == 4 and c, what="4 records", timeout=60)
    assert all(c["status"] == "ok" for c in calls), [(c["status"], c["error"]) for c in calls]
    first, second, third, edited = calls
    assert first["continuation"] is None  # nothing before it to compare with
    assert [second["continuation"], third["continuation"], edited["continuation"]] == ["tokens_in"] * 2 + ["rewrite"]
    for earlier, call in ((first, second), (second, third)):
        assert_continued_exactly(vllm, policy_server, tokenizer, earlier, call)
    segments, causes = _episode(sidecar.store, "ep-retok")
    assert [s["n_calls"] for s in segments] == [3, 1], [(s["fork_reason"], s["call_ids"]) for s in segments]
    assert [c["cause"] for c in causes] == ["rewrite"]
    assert segments[0]["call_ids"] == [first["call_id"], second["call_id"], third["call_id"]]


@pytest.mark.integration
def test_observed_retokenization_forks_and_is_reported_as_such(start_sidecar, policy_server):
    """`--tokens-in observe` serves every call normally: the same conversation forks where the history was
    re-tokenized (the second call; later ones only if a later answer happens to re-tokenize too: the prompts are
    canonical from then on), and the report names the cause."""
    sidecar = start_sidecar(policy_server.base_url, episode_id=None,
                            extra=("--trust-episode-header", "--tokens-in", "observe"))  # fmt: skip
    _conversation(sidecar.url, "ep-observed", rewrite=False)
    calls = wait_for(lambda: (c := read_calls(sidecar.store)) and len(c) == 3 and c, what="3 records", timeout=60)
    found = [c["continuation"] for c in calls]
    assert found[:2] == [None, "retokenized"] and found[2] in (None, "retokenized"), found
    assert all(c["status"] == "ok" and c["prompt_token_ids"] for c in calls)
    segments, causes = _episode(sidecar.store, "ep-observed")
    retokenized = found.count("retokenized")
    assert len(segments) == 1 + retokenized and [c["cause"] for c in causes] == ["retokenization"] * retokenized
    assert [c["call_id"] for c in causes] == [c["call_id"] for c in calls if c["continuation"] == "retokenized"]


@pytest.mark.integration
def test_a_call_served_tokens_in_keeps_the_completion_bound(start_sidecar, policy_server):
    """--max-completion-tokens and a harness's bound above the context (Claude Code's max_tokens=128000) bound a
    streamed Messages call served tokens-in as they bound the normal path; the record says what was served."""
    sidecar = start_sidecar(policy_server.base_url, episode_id=None,
                            extra=("--trust-episode-header", "--max-completion-tokens", "7"))  # fmt: skip
    with httpx.Client(base_url=sidecar.url, headers={"x-forge-episode-id": "ep-bound"}, timeout=300) as client:
        first = [{"role": "user", "content": "Write six empty lines."}]
        text1 = _chat(client, first, max_tokens=6, temperature=1.0, allowed_token_ids=[NEWLINE])
        second = [*first, {"role": "assistant", "content": text1}, {"role": "user", "content": "Again, shorter."}]
        answer = client.post("/v1/messages", json={"model": "claude-x", "max_tokens": 128_000, "temperature": 1.0,
                                                   "messages": second, "stream": True})  # fmt: skip
        assert answer.status_code == 200 and "message_stop" in answer.text, answer.text
    calls = wait_for(lambda: (c := read_calls(sidecar.store)) and len(c) == 2 and c, what="2 records", timeout=60)
    first_call, call = calls
    assert call["status"] == "ok" and call["continuation"] == "tokens_in", (call["error"], call["note"])
    assert call["parent_call_id"] == first_call["call_id"]
    assert (call["max_tokens_requested"], call["max_tokens_served"]) == (128_000, 7)
    assert 0 < len(call["completion_token_ids"]) <= 7


def test_only_a_request_that_sends_an_answer_back_is_rendered_for_tokens_in():
    user = {"role": "user", "content": "x"}
    assert not continuation.answers_in_history("chat", {"messages": [user]})
    assert continuation.answers_in_history("chat", {"messages": [user, {"role": "assistant", "content": "y"}, user]})
    assert not continuation.answers_in_history("responses", {"input": "x"})
    assert not continuation.answers_in_history("responses", {"input": [{"type": "message", **user}]})
    call = {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"}
    assert continuation.answers_in_history("responses", {"input": [user, call]})
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "y"}]}
    assert continuation.answers_in_history("responses", {"input": [user, said]})
