"""A real harness end to end: Codex CLI (npm @openai/codex, pinned by scripts/harness.sh) runs one task
non-interactively through the real sidecar against the real vLLM; every call it makes is recorded token-exact.

Codex runs with its defaults: no model in its config, so its own default model's request shape (its tools in an
``additional_tools`` input item, a ``custom`` tool with a grammar), which the sidecar normalises.

Codex samples (no temperature it lets us set), so the test checks exactness without replaying the sampling:
- prompt ids: vLLM renders the recorded request again, normalised as the sidecar normalises it
  (``enable_response_messages``), to exactly these ids;
- completion ids: their decoding is the text Codex received, and teacher-forcing them after the prompt gives
  vLLM's logprob of each one equal to the recorded behaviour logprob (a wrong id would get another logprob).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sidecar.apis.responses import normalise_request
from tests.sidecar.conftest import (
    assert_harness_succeeded,
    assert_no_secret_anywhere,
    assert_sampled_by_vllm,
    call_table,
    installed_harness,
    read_calls,
    wait_for,
)

pytestmark = pytest.mark.integration
CODEX_TIMEOUT_S = 420
MAX_COMPLETION_TOKENS = 96  # a rollout's response length: keeps a sampling 135M model from rambling for minutes


@pytest.fixture(scope="module")
def codex() -> str:
    return installed_harness("codex")


def codex_home(tmp_path: Path, sidecar_url: str) -> Path:
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model_provider = "forge"\n\n'
        "[model_providers.forge]\n"
        f'name = "OpenForge sidecar"\nbase_url = "{sidecar_url}/v1"\nwire_api = "responses"\n'
        'env_key = "OPENAI_API_KEY"\nrequest_max_retries = 0\nstream_max_retries = 0\n\n'
        "[features]\nplugins = false\n"
    )
    return home


def test_codex_runs_a_task_through_the_sidecar_and_every_call_is_exact(
    codex, start_sidecar, policy_server, vllm, tokenizer, tmp_path
):
    sidecar = start_sidecar(policy_server.base_url, extra=("--max-completion-tokens", str(MAX_COMPLETION_TOKENS)))
    home, work = codex_home(tmp_path, sidecar.url), tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("The answer is 42.\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home), "NO_COLOR": "1",
           "OPENAI_API_KEY": "sk-codex-test-not-a-real-key", "TMPDIR": str(tmp_path)}  # fmt: skip
    run = subprocess.run(
        [codex, "exec", "--skip-git-repo-check", "-s", "read-only", "What does notes.txt say? Use the shell."],
        cwd=work, env=env, capture_output=True, text=True, timeout=CODEX_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    calls = wait_for(lambda: read_calls(sidecar.store), what="Codex's call records")
    assert all(c["harness"] == "codex" and c["api"] == "responses" and c["stream"] for c in calls), call_table(calls)
    assert_harness_succeeded(run, calls)
    ok = calls
    for call in ok:
        request = json.loads(call["request_json"])
        assert any(item.get("type") == "additional_tools" for item in request["input"])  # the default model's shape
        normalise_request(request)
        rendered = vllm.post("/v1/responses", json={
            **request, "model": policy_server.name, "stream": False, "max_output_tokens": 1,
            "enable_response_messages": True,
        }).json()  # fmt: skip
        assert call["prompt_token_ids"] == [t for m in rendered["input_messages"] for t in m["tokens"]]
        ids = call["completion_token_ids"]
        assert 0 < len(ids) <= MAX_COMPLETION_TOKENS and len(call["completion_logprobs"]) == len(ids)
        received = json.loads(call["response_json"])
        if received.get("content"):
            assert tokenizer.decode(ids, skip_special_tokens=True).strip() == received["content"].strip()
        assert_sampled_by_vllm(vllm, policy_server, call)

    # Codex's installation id (in its home and in every request's metadata) and its API key are in no decoded
    # record, log line or WAL file.
    installation = (home / "installation_id").read_text().strip()
    assert len(installation) > 8
    sidecar.stop()
    assert_no_secret_anywhere(sidecar, [installation, env["OPENAI_API_KEY"]])
    shutil.rmtree(home, ignore_errors=True)
