"""A real harness end to end: Codex CLI (npm @openai/codex, pinned by scripts/harness.sh) runs a task
non-interactively through the real sidecar against the real vLLM, then continues the conversation over further
invocations (``codex exec resume --last``) until it made at least six calls; every call it makes is recorded
token-exact, and its resent history (SmolLM2's answers as text, which re-tokenize differently) does not fork the
episode: such calls are served tokens-in (tests/sidecar/sessions.py).

Codex runs with its defaults: no model in its config, so its own default model's request shape (its tools in an
``additional_tools`` input item, a ``custom`` tool with a grammar), which the sidecar normalises. The sidecar runs
with no flags beyond its endpoint (and the test's own plumbing: store, WAL, admin port to read them).

Test-only: Codex has no setting for its answers' length, and SmolLM2-135M does not end its turn at Codex's prompt
(each answer would run to the server's context: minutes per call on a CPU). So a separate test-only reverse proxy
(``tests/support/harness_output_bound.py``, a mitmdump script) between Codex and the sidecar adds
``max_output_tokens`` to each request, as a harness with that setting would; nothing else is changed, and the sidecar
takes it as the harness's.

Codex samples (no temperature it lets us set), so the test checks exactness without replaying the sampling:
- prompt ids: vLLM renders the recorded request again, normalised as the sidecar normalises it
  (``enable_response_messages``), to exactly these ids;
- completion ids: their decoding is the text Codex received, and teacher-forcing them after the prompt gives
  vLLM's logprob of each one equal to the recorded behaviour logprob (a wrong id would get another logprob).
"""

import json
import shutil
import tomllib

import pytest

from sidecar.apis.responses import normalise_request
from tests.sidecar.sessions import TURNS, assert_continued_exactly
from tests.support.harness import OUTPUT_BOUND, assert_harness_succeeded, installed_harness
from tests.support.sidecar import assert_all_sampled_by_vllm, assert_no_secret_anywhere, call_table

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def codex() -> str:
    return installed_harness("codex")


@pytest.mark.timeout(1800)  # up to 12 invocations of Codex on a loaded 2-core vLLM
def test_a_codex_session_through_the_sidecar_is_recorded_exactly_and_does_not_fork_on_retokenization(
    codex, policy_server, vllm, tokenizer, tmp_path
):
    """One Codex conversation (``codex exec``, then ``codex exec resume --last``; bench/harness_session.py) of at
    least six calls through a sidecar with no flags beyond its endpoint (and the test's plumbing)."""
    from bench.harness_session import codex_session

    store = str(tmp_path / "store")
    session = codex_session(policy_server.base_url, store, TURNS, tmp_path, hunt=False)
    calls = session.calls
    assert all(c["harness"] == "codex" and c["api"] == "responses" and c["stream"] for c in calls), call_table(calls)
    assert_harness_succeeded(session.first, calls[: session.n_first])
    assert session.home is not None
    assert "model" not in tomllib.loads((session.home / "config.toml").read_text())  # no model set: Codex's own
    for call in calls:
        request = json.loads(call["request_json"])
        assert any(item.get("type") == "additional_tools" for item in request["input"])  # the default model's shape
        # The test-only bound (the one field added in front of the sidecar), served as the harness's own.
        assert request["max_output_tokens"] == OUTPUT_BOUND
        assert (call["max_tokens_requested"], call["max_tokens_served"]) == (OUTPUT_BOUND, OUTPUT_BOUND)
        if call["continuation"] != "tokens_in":  # tokens-in calls: assert_continued_exactly, below
            normalise_request(request)
            rendered = vllm.post("/v1/responses", json={
                **request, "model": policy_server.name, "stream": False, "max_output_tokens": 1,
                "enable_response_messages": True,
            }).json()  # fmt: skip
            assert call["prompt_token_ids"] == [t for m in rendered["input_messages"] for t in m["tokens"]]
        ids = call["completion_token_ids"]
        assert 0 < len(ids) <= OUTPUT_BOUND and len(call["completion_logprobs"]) == len(ids)
        received = json.loads(call["response_json"])
        if received.get("content"):
            assert tokenizer.decode(ids, skip_special_tokens=True).strip() == received["content"].strip()
    assert_all_sampled_by_vllm(vllm, policy_server, calls)  # every call teacher-forced, one request per chain
    assert_continued_exactly(calls, "codex", store, vllm, policy_server)

    # Codex's installation id (in its home and in every request's metadata) and its API key are in no decoded
    # record, log line or WAL file.
    assert len(session.secrets[0]) > 8
    assert_no_secret_anywhere(session.sidecar, session.secrets)
    shutil.rmtree(session.home, ignore_errors=True)
