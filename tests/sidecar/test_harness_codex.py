"""A real harness end to end: Codex CLI (npm @openai/codex, pinned by scripts/harness.sh) runs one task
non-interactively through the real sidecar against the real vLLM; every call it makes is recorded token-exact.

Codex runs with its defaults: no model in its config, so its own default model's request shape (its tools in an
``additional_tools`` input item, a ``custom`` tool with a grammar), which the sidecar normalises. The sidecar runs
with no flags beyond its endpoint (and the test's own plumbing: store, WAL, admin port to read them).

Test-only: Codex has no setting for its answers' length, and SmolLM2-135M does not end its turn at Codex's prompt
(each answer would run to the server's context: minutes per call on a CPU). So a separate test-only reverse proxy
(``harness_output_bound.py``, a mitmdump script) between Codex and the sidecar adds ``max_output_tokens`` to each
request, as a harness with that setting would; nothing else is changed, and the sidecar takes it as the harness's.

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
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sidecar.apis.responses import normalise_request
from sidecar.cli import sidecar_python_bin
from tests.sidecar.conftest import (
    assert_harness_succeeded,
    assert_no_secret_anywhere,
    assert_sampled_by_vllm,
    call_table,
    installed_harness,
    read_calls,
    wait_for,
)
from trainer.serve import free_port

pytestmark = pytest.mark.integration
CODEX_TIMEOUT_S = 420
OUTPUT_BOUND = 96  # test-only (harness_output_bound.py): keeps a sampling 135M model from rambling for minutes


@pytest.fixture(scope="module")
def codex() -> str:
    return installed_harness("codex")


@contextmanager
def output_bound(sidecar_url: str, tmp_path: Path) -> Iterator[str]:
    """The test-only bound in front of the sidecar (see the module's docstring): its URL."""
    port = free_port()
    log = (tmp_path / "output-bound.log").open("wb")
    process = subprocess.Popen(
        [str(sidecar_python_bin() / "mitmdump"), "--mode", f"reverse:{sidecar_url}", "--listen-host", "127.0.0.1",
         "--listen-port", str(port), "-s", str(Path(__file__).with_name("harness_output_bound.py")),
         "--set", f"output_bound={OUTPUT_BOUND}", "--set", "connection_strategy=lazy"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/v1/models", timeout=2).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"the test-only output bound did not start: {(tmp_path / 'output-bound.log').read_text()}"
                    )
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()


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
    sidecar = start_sidecar(policy_server.base_url)  # no flags beyond the endpoint (and the test's plumbing)
    with output_bound(sidecar.url, tmp_path) as bounded_url:
        home, work = codex_home(tmp_path, bounded_url), tmp_path / "work"
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
        assert "model" not in tomllib.loads((home / "config.toml").read_text())  # no model set: Codex's own
        # The test-only bound (the one field added in front of the sidecar), served as the harness's own.
        assert request["max_output_tokens"] == OUTPUT_BOUND
        assert (call["max_tokens_requested"], call["max_tokens_served"]) == (OUTPUT_BOUND, OUTPUT_BOUND)
        normalise_request(request)
        rendered = vllm.post("/v1/responses", json={
            **request, "model": policy_server.name, "stream": False, "max_output_tokens": 1,
            "enable_response_messages": True,
        }).json()  # fmt: skip
        rendered_ids = [t for m in rendered["input_messages"] for t in m["tokens"]]
        if call["continuation"] == "tokens_in":  # the earlier call's exact ids + the rendering of what was added
            parent = next(c for c in calls if c["call_id"] == call["parent_call_id"])
            whole = parent["prompt_token_ids"] + parent["completion_token_ids"]
            added = len(call["prompt_token_ids"]) - len(whole)
            assert call["prompt_token_ids"][: len(whole)] == whole and added > 0
            assert call["prompt_token_ids"][len(whole) :] == rendered_ids[-added:]
        else:
            assert call["prompt_token_ids"] == rendered_ids
        ids = call["completion_token_ids"]
        assert 0 < len(ids) <= OUTPUT_BOUND and len(call["completion_logprobs"]) == len(ids)
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
