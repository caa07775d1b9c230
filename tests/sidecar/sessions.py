"""What a real harness's multi-turn session must show (tests/sidecar/test_harness_codex.py,
test_harness_claude_code.py): one conversation, its calls' prompts extending earlier calls' prompt + completion
exactly; where the harness resent SmolLM2's answers as text that re-tokenizes differently, the call was served
tokens-in (its prompt: the earlier call's prompt + completion + vLLM's rendering of what was added; the normal path
would have re-tokenized it); no fork of the episode is caused by re-tokenization.

Whether a sampled answer re-tokenizes differently is chance (12 Codex calls in a row once all re-tokenized
canonically): tests/sidecar/test_continuation.py forces it with ``allowed_token_ids``; here a session shows it where
it happens, and the episode must not fork either way. The callers teacher-force every call (assert_all_sampled_by_vllm).
"""

import json

from bench.tokens_in import render_request
from tests.sidecar.test_continuation import _episode
from tests.support.sidecar import call_table

TURNS = 6  # a session is driven (bench/harness_session.py, hunt=False) until it has this many calls


def assert_continued_exactly(calls: list[dict], harness: str, store: str, vllm, policy_server) -> None:
    assert all(c["status"] == "ok" and c["harness"] == harness for c in calls), call_table(calls)
    assert len(calls) >= TURNS, call_table(calls)
    by_id = {c["call_id"]: c for c in calls}
    extending = 0  # calls whose prompt is an earlier call's prompt + completion, exactly, + what was added
    for call in calls:
        parent = by_id.get(call["parent_call_id"])
        whole = parent["prompt_token_ids"] + parent["completion_token_ids"] if parent else []
        added = len(call["prompt_token_ids"]) - len(whole)
        exact = parent is not None and call["prompt_token_ids"][: len(whole)] == whole and added > 0
        extending += exact
        if call["continuation"] == "tokens_in":
            assert exact and call["prefix_len"] == len(whole), call_table(calls)
            path, request = render_request(call, policy_server.name)
            rendered = vllm.post(path, json=request)
            assert rendered.status_code == 200, rendered.text
            rendered_ids = rendered.json()["token_ids"]
            assert call["prompt_token_ids"][len(whole) :] == rendered_ids[-added:]
            assert rendered_ids != call["prompt_token_ids"]  # the normal path would have re-tokenized the history
            assert "served tokens-in" in call["note"]
    assert extending >= TURNS // 2, call_table(calls)  # one conversation, not unrelated calls
    served = sum(c["continuation"] == "tokens_in" for c in calls)
    print(f"{served} of {len(calls)} calls served tokens-in (their history re-tokenized differently)")
    _, causes = _episode(store, calls[0]["episode_id"])
    print(json.dumps(causes, default=str))
    assert not [c for c in causes if c["cause"] == "retokenization"], causes
