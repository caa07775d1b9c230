"""A real harness end to end: Claude Code (npm @anthropic-ai/claude-code, pinned by scripts/harness.sh) runs one
task in print mode, with its defaults (its own model), through the real sidecar against the real vLLM, speaking
Anthropic Messages with streaming. The sidecar runs with no flags beyond its endpoint (and the test's own plumbing:
store, WAL, admin port to read them).

Its answers are bounded by Claude Code's own setting, ``CLAUDE_CODE_MAX_OUTPUT_TOKENS`` (a user's, documented by
Claude Code; it sends that as ``max_tokens``): SmolLM2-135M does not end its turn at Claude Code's prompt, and each
answer would otherwise run to the server's context, minutes per call on a CPU. Its default ``max_tokens`` (128000,
past the server's context) being lowered is checked on the request Claude Code sends by default
(``golden/claude-code``, test_harness_golden.py) and through the real sidecar (test_completion_bound.py).

Its calls are served through Chat Completions with ids and recorded token-exact: the prompt ids are vLLM's own
rendering of the recorded request (``/v1/messages/render``) — or, for a call served tokens-in (Claude Code resent
an earlier answer as text that the template re-tokenizes), the earlier call's exact prompt + completion followed by
that rendering's new part, the same text —, the completion ids pass the teacher-forcing check, and its per-call
billing line does not stop the second call from extending the first.
"""

import itertools
import json
import subprocess

import pytest

from tests.sidecar.conftest import (
    assert_harness_succeeded,
    assert_no_secret_anywhere,
    assert_sampled_by_vllm,
    call_table,
    claude_code_env,
    installed_harness,
    read_calls,
    wait_for,
)

pytestmark = pytest.mark.integration
CLAUDE_TIMEOUT_S = 420
MAX_OUTPUT_TOKENS = 64  # Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS


@pytest.fixture(scope="module")
def claude() -> str:
    return installed_harness("claude-code")


def test_claude_code_runs_a_task_through_the_sidecar_and_every_call_is_exact(
    claude, start_sidecar, policy_server, vllm, tokenizer, tmp_path
):
    sidecar = start_sidecar(policy_server.base_url)  # no flags beyond the endpoint (and the test's plumbing)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("The answer is 42.\n")
    env = claude_code_env(tmp_path, sidecar.url, MAX_OUTPUT_TOKENS)
    run = subprocess.run(
        [claude, "-p", "What does notes.txt say?", "--max-turns", "2",
         "--dangerously-skip-permissions"],
        cwd=work, env=env, capture_output=True, text=True, timeout=CLAUDE_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    calls = wait_for(lambda: read_calls(sidecar.store), what="Claude Code's call records")
    assert all(c["harness"] == "claude-code" and c["api"] == "messages" for c in calls), call_table(calls)
    # SmolLM2-135M does not end a turn at Claude Code's 9k-token prompts (past its native 8k context; tried with
    # 64 and 384 tokens): every answer runs into the bound, and Claude Code then exits 1 saying so. That exit is
    # accepted only with those words and every record showing finish_reason "length"; any other is a failure.
    assert_harness_succeeded(run, calls, explained_exit=(1, "output token maximum"))
    ok = calls
    for call in ok:
        assert call["stream"] and call["path"] == "/v1/messages"  # as Claude Code called it (served through chat)
        request = json.loads(call["request_json"])
        assert request["system"][0]["text"].startswith("x-anthropic-billing-header")  # recorded as sent
        # The sidecar ignores `thinking` (SmolLM2 cannot think; Claude Code's budget can even exceed max_tokens,
        # which vLLM's own /v1/messages refuses); without it vLLM renders exactly the prompt that was served.
        unthinking = {k: v for k, v in request.items() if k != "thinking"}
        rendered = vllm.post("/v1/messages/render", json={**unthinking, "model": policy_server.name, "stream": False})
        assert rendered.status_code == 200, rendered.text
        rendered_ids, prompt = rendered.json()["token_ids"], call["prompt_token_ids"]
        if call["continuation"] == "tokens_in":  # Claude Code resent an answer as text the template re-tokenizes
            (earlier,) = [c for c in ok if c["call_id"] == call["parent_call_id"]]
            whole = earlier["prompt_token_ids"] + earlier["completion_token_ids"]
            added = len(prompt) - len(whole)
            # the earlier call's prompt + completion, exactly, then the template's rendering of what was added,
            # where vLLM's own rendering spelled the same text with other ids
            assert prompt[: len(whole)] == whole and added > 0 and prompt[len(whole) :] == rendered_ids[-added:]
            assert tokenizer.decode(rendered_ids[:-added]) == tokenizer.decode(whole)
            assert "served tokens-in" in call["note"] and call["prefix_len"] == len(whole)
        else:
            assert prompt == rendered_ids
        assert 0 < len(call["completion_token_ids"]) <= MAX_OUTPUT_TOKENS
        # Claude Code sent its own setting as max_tokens; the sidecar served it as asked, and the record says so.
        assert request["max_tokens"] == MAX_OUTPUT_TOKENS
        assert (call["max_tokens_requested"], call["max_tokens_served"]) == (MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS)
        received = json.loads(call["response_json"])
        if received.get("content") and not received.get("tool_calls"):
            decoded = tokenizer.decode(call["completion_token_ids"], skip_special_tokens=True)
            assert decoded.strip() == received["content"].strip()
        assert_sampled_by_vllm(vllm, policy_server, call)
    # One conversation: a later turn is stored as a reference to the earlier one, its whole prompt shared (the
    # billing line, different in every call, is normalised away).
    extending = [
        later for earlier, later in itertools.pairwise(ok)
        if later["parent_call_id"] == earlier["call_id"] and later["prefix_len"] >= len(earlier["prompt_token_ids"])
    ]  # fmt: skip
    assert len(ok) == 1 or extending, [(c["call_id"], c["parent_call_id"], c["prefix_len"]) for c in ok]
    sidecar.stop()
    assert_no_secret_anywhere(sidecar, [env["ANTHROPIC_API_KEY"]])
