"""Tokens-in continuation with a real harness: a multi-turn Claude Code session (two `claude -p` runs, the second
`--continue`-ing the first, sampling at Claude Code's own temperature) through the real sidecar and vLLM.

Claude Code resends SmolLM2's answers as text; without tokens-in those re-tokenize differently and the episode
forks. Here: no fork is caused by re-tokenization, every call served tokens-in has as prompt the previous call's
prompt + completion + vLLM's rendering of what was added, and its completion passes the teacher-forcing check.
"""

import json
import subprocess

import pytest

from sidecar.apis.responses import normalise_request
from tests.sidecar.conftest import (
    assert_sampled_by_vllm,
    call_table,
    claude_code_env,
    installed_harness,
    read_calls,
    wait_for,
)
from tests.sidecar.test_continuation import _episode

pytestmark = pytest.mark.integration
CLAUDE_TIMEOUT_S = 900
MAX_COMPLETION_TOKENS = 48


def test_claude_code_session_does_not_fork_on_retokenization(start_sidecar, policy_server, vllm, tmp_path):
    claude = installed_harness("claude-code")
    sidecar = start_sidecar(policy_server.base_url, episode_id="claude-session",
                            extra=("--max-completion-tokens", str(MAX_COMPLETION_TOKENS)))  # fmt: skip
    print(f"store: {sidecar.store}")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("The answer is 42.\n")
    env = claude_code_env(tmp_path, sidecar.url, MAX_COMPLETION_TOKENS)
    for prompt, more in (("What does notes.txt say?", []), ("And what is the answer, in one word?", ["--continue"])):
        subprocess.run(
            [claude, "-p", prompt, *more, "--model", "claude-sonnet-4-5", "--max-turns", "4",
             "--dangerously-skip-permissions"],
            cwd=work, env=env, capture_output=True, text=True, timeout=CLAUDE_TIMEOUT_S, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    calls = wait_for(lambda: read_calls(sidecar.store), what="Claude Code's call records", timeout=60)
    print(call_table(calls))
    print(json.dumps([[c["seq"], c["continuation"], c["parent_call_id"], c["prefix_len"]] for c in calls]))
    assert all(c["status"] == "ok" for c in calls), call_table(calls)
    if len(calls) < 6:  # SmolLM2 sometimes ends both turns at once; the judgement needs a longer session
        pytest.skip(f"Claude Code made {len(calls)} calls (< 6): too short a session to judge")
    by_id = {c["call_id"]: c for c in calls}
    served = [c for c in calls if c["continuation"] == "tokens_in"]
    assert served, "no call was served tokens-in: " + json.dumps([c["continuation"] for c in calls])
    for call in served:
        parent = by_id[call["parent_call_id"]]
        whole = parent["prompt_token_ids"] + parent["completion_token_ids"]
        request = json.loads(call["request_json"])
        unthinking = {k: v for k, v in request.items() if k != "thinking"}
        rendered = vllm.post("/v1/messages/render", json={**unthinking, "model": policy_server.name, "stream": False})
        rendered_ids = rendered.json()["token_ids"]
        added = len(call["prompt_token_ids"]) - len(whole)
        assert call["prefix_len"] == len(whole) and call["prompt_token_ids"][: len(whole)] == whole
        assert added > 0 and call["prompt_token_ids"][len(whole) :] == rendered_ids[-added:]
        assert_sampled_by_vllm(vllm, policy_server, call)
    _, causes = _episode(sidecar.store, "claude-session")
    print(json.dumps(causes, default=str))
    assert not [c for c in causes if c["cause"] == "retokenization"], causes


def test_codex_session_does_not_fork_on_retokenization(policy_server, vllm, tmp_path):
    """Codex (its defaults, sampling at its own temperature) driven over several invocations of one conversation
    (``codex exec``, then ``codex exec resume --last``: bench/harness_session.py) to at least 6 calls."""
    from bench.harness_session import codex_session

    store, session = str(tmp_path / "store"), tmp_path / "session"
    session.mkdir()
    calls = codex_session(policy_server.base_url, store, 6, session)
    assert all(c["status"] == "ok" and c["harness"] == "codex" for c in calls), call_table(calls)
    assert len(calls) >= 6, call_table(calls)
    by_id = {c["call_id"]: c for c in calls}
    served = [c for c in calls if c["continuation"] == "tokens_in"]
    assert served, "no call was served tokens-in: " + json.dumps([c["continuation"] for c in calls])
    for call in served:
        parent = by_id[call["parent_call_id"]]
        whole = parent["prompt_token_ids"] + parent["completion_token_ids"]
        request = json.loads(call["request_json"])
        normalise_request(request)
        rendered = vllm.post("/v1/responses/render", json={**request, "model": policy_server.name, "stream": False})
        rendered_ids = rendered.json()["token_ids"]
        added = len(call["prompt_token_ids"]) - len(whole)
        assert call["prefix_len"] == len(whole) and call["prompt_token_ids"][: len(whole)] == whole
        assert added > 0 and call["prompt_token_ids"][len(whole) :] == rendered_ids[-added:]
        assert rendered_ids != call["prompt_token_ids"]  # the normal path would have re-tokenized the history
        assert_sampled_by_vllm(vllm, policy_server, call)
    _, causes = _episode(store, calls[0]["episode_id"])
    print(json.dumps(causes, default=str))
    assert not [c for c in causes if c["cause"] == "retokenization"], causes
