"""A real harness end to end: Claude Code (npm @anthropic-ai/claude-code, pinned by scripts/harness.sh) runs a task
in print mode, with its defaults (its own model), through the real sidecar against the real vLLM, speaking Anthropic
Messages with streaming, then continues the conversation (``claude -p --continue``) until it made at least six calls;
its resent history does not fork the episode (tests/sidecar/sessions.py). The sidecar runs with no flags beyond its
endpoint (and the test's own plumbing: store, WAL, admin port to read them).

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

import pytest

from tests.sidecar.sessions import TURNS, assert_continued_exactly
from tests.support.harness import assert_harness_succeeded, installed_harness
from tests.support.sidecar import assert_all_sampled_by_vllm, assert_no_secret_anywhere, call_table

pytestmark = pytest.mark.integration
MAX_OUTPUT_TOKENS = 64  # Claude Code's CLAUDE_CODE_MAX_OUTPUT_TOKENS


@pytest.fixture(scope="module")
def claude() -> str:
    return installed_harness("claude-code")


@pytest.mark.timeout(1800)  # up to 12 invocations of a 4k-token-prompt harness on a loaded 2-core vLLM
def test_a_claude_code_session_through_the_sidecar_is_recorded_exactly_and_does_not_fork_on_retokenization(
    claude, policy_server, vllm, tokenizer, tmp_path
):
    """One Claude Code conversation (``claude -p``, then ``claude -p --continue``; bench/harness_session.py) of at
    least six calls through a sidecar with no flags beyond its endpoint (and the test's plumbing)."""
    from bench.harness_session import CLAUDE_MAX_OUTPUT_TOKENS, claude_code_session

    assert CLAUDE_MAX_OUTPUT_TOKENS == MAX_OUTPUT_TOKENS
    store = str(tmp_path / "store")
    session = claude_code_session(policy_server.base_url, store, TURNS, tmp_path, hunt=False)
    calls = session.calls
    assert all(c["harness"] == "claude-code" and c["api"] == "messages" for c in calls), call_table(calls)
    # SmolLM2-135M does not end a turn at Claude Code's 9k-token prompts (past its native 8k context; tried with
    # 64 and 384 tokens): every answer runs into the bound, and Claude Code then exits 1 saying so. That exit is
    # accepted only with those words and every record showing finish_reason "length"; any other is a failure.
    assert_harness_succeeded(session.first, calls[: session.n_first], explained_exit=(1, "output token maximum"))
    for call in calls:
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
            (earlier,) = [c for c in calls if c["call_id"] == call["parent_call_id"]]
            whole = earlier["prompt_token_ids"] + earlier["completion_token_ids"]
            added = len(prompt) - len(whole)
            # vLLM's own rendering spelled the same text as the earlier call's prompt + completion with other ids
            assert tokenizer.decode(rendered_ids[:-added]) == tokenizer.decode(whole)
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
    # One conversation: a later turn is stored as a reference to the earlier one, its whole prompt shared (the
    # billing line, different in every call, is normalised away), served tokens-in where the history re-tokenizes.
    extending = [
        later for earlier, later in itertools.pairwise(calls)
        if later["parent_call_id"] == earlier["call_id"] and later["prefix_len"] >= len(earlier["prompt_token_ids"])
    ]  # fmt: skip
    assert extending, [(c["call_id"], c["parent_call_id"], c["prefix_len"]) for c in calls]
    assert_all_sampled_by_vllm(vllm, policy_server, calls)  # every call teacher-forced, one request per chain
    assert_continued_exactly(calls, "claude-code", store, vllm, policy_server)
    assert_no_secret_anywhere(session.sidecar, session.secrets)
