"""Tokens-in continuation with real harnesses: a multi-turn session of Claude Code and one of Codex, each driven over
several invocations of one conversation (bench/harness_session.py) to at least 6 calls, sampling at the harness's
own temperature, through the real sidecar (``--tokens-in auto``) and vLLM.

The harnesses resend SmolLM2's answers as text; without tokens-in those re-tokenize differently and the episode
forks. Here: no fork is caused by re-tokenization, every call served tokens-in has as prompt the previous call's
prompt + completion + vLLM's rendering of what was added, and its completion passes the teacher-forcing check.
"""

import json
from pathlib import Path

import pytest

from bench.tokens_in import render_request
from tests.sidecar.conftest import assert_sampled_by_vllm, call_table
from tests.sidecar.test_continuation import _episode

pytestmark = pytest.mark.integration
TURNS = 6


def _assert_continued_exactly(calls: list[dict], harness: str, store: str, vllm, policy_server) -> None:
    assert all(c["status"] == "ok" and c["harness"] == harness for c in calls), call_table(calls)
    assert len(calls) >= TURNS, call_table(calls)
    by_id = {c["call_id"]: c for c in calls}
    served = [c for c in calls if c["continuation"] == "tokens_in"]
    assert served, "no call was served tokens-in: " + json.dumps([c["continuation"] for c in calls])
    for call in served:
        parent = by_id[call["parent_call_id"]]
        whole = parent["prompt_token_ids"] + parent["completion_token_ids"]
        path, request = render_request(call, policy_server.name)
        rendered = vllm.post(path, json=request)
        assert rendered.status_code == 200, rendered.text
        rendered_ids = rendered.json()["token_ids"]
        added = len(call["prompt_token_ids"]) - len(whole)
        assert call["prefix_len"] == len(whole) and call["prompt_token_ids"][: len(whole)] == whole
        assert added > 0 and call["prompt_token_ids"][len(whole) :] == rendered_ids[-added:]
        assert rendered_ids != call["prompt_token_ids"]  # the normal path would have re-tokenized the history
        assert_sampled_by_vllm(vllm, policy_server, call)
    _, causes = _episode(store, calls[0]["episode_id"])
    print(json.dumps(causes, default=str))
    assert not [c for c in causes if c["cause"] == "retokenization"], causes


@pytest.mark.timeout(1800)  # up to 12 invocations of a 4k-token-prompt harness on a loaded 2-core vLLM
def test_claude_code_session_does_not_fork_on_retokenization(policy_server, vllm, tmp_path: Path):
    """Claude Code (its defaults, its own CLAUDE_CODE_MAX_OUTPUT_TOKENS bound): ``claude -p``, then
    ``claude -p --continue``."""
    from bench.harness_session import claude_code_session

    store, session = str(tmp_path / "store"), tmp_path / "session"
    session.mkdir()
    calls = claude_code_session(policy_server.base_url, store, TURNS, session)
    assert all(c["api"] == "messages" for c in calls), call_table(calls)
    _assert_continued_exactly(calls, "claude-code", store, vllm, policy_server)


def test_codex_session_does_not_fork_on_retokenization(policy_server, vllm, tmp_path: Path):
    """Codex (its defaults): ``codex exec``, then ``codex exec resume --last``."""
    from bench.harness_session import codex_session

    store, session = str(tmp_path / "store"), tmp_path / "session"
    session.mkdir()
    calls = codex_session(policy_server.base_url, store, TURNS, session)
    _assert_continued_exactly(calls, "codex", store, vllm, policy_server)
