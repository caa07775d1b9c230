"""Two more real harnesses end to end, as a new user runs them: Qwen Code (npm @qwen-code/qwen-code) and pi
(npm @mariozechner/pi-coding-agent), pinned by scripts/harness.sh, headless on a short task through the real sidecar
against the real vLLM. Each points at the sidecar the way its own docs say (Qwen Code: ``OPENAI_BASE_URL`` and
``--auth-type openai``; pi: a provider in ``~/.pi/agent/models.json``, over each of its three wire APIs); the one
OpenForge setting is a rollout's response-length bound (``forge sidecar --max-completion-tokens``), which a 135M
model on a CPU needs. Every call is recorded ``ok`` with its token ids, sampled by vLLM (teacher forcing), labelled
with the harness (neither needs a setting for that: Qwen Code by its user agent, pi by its system prompt), and the
harness's own token counts equal the records'.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.harness import assert_harness_succeeded, installed_harness
from tests.support.sidecar import assert_all_sampled_by_vllm, assert_no_secret_anywhere, read_calls, wait_for

pytestmark = pytest.mark.integration
MAX_COMPLETION_TOKENS = 32  # the rollout's response-length bound, the one OpenForge setting
API_KEY = "sk-test-not-a-real-key"
PI_APIS = {"chat": "openai-completions", "responses": "openai-responses", "messages": "anthropic-messages"}


def run_harness(
    command: list[str], home: Path, env: dict[str, str], timeout: float = 900
) -> subprocess.CompletedProcess:
    work = home / "work"
    work.mkdir(exist_ok=True)
    base = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(home), "NO_COLOR": "1"}
    return subprocess.run(command, cwd=work, env={**base, **env}, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # fmt: skip


def recorded(sidecar, episode: str, at_least: int = 1) -> list[dict]:
    return wait_for(lambda: (c := read_calls(sidecar.store, f"episode_id = '{episode}'")) and len(c) >= at_least and c,
                    timeout=60, what="the records")  # fmt: skip


def assert_counts_equal(calls: list[dict], prompt_tokens: int, completion_tokens: int) -> None:
    assert prompt_tokens == sum(c["prompt_len"] for c in calls), [c["prompt_len"] for c in calls]
    assert completion_tokens == sum(len(c["completion_token_ids"]) for c in calls)


def test_qwen_code_headless_is_served_recorded_exactly_and_labelled(policy_server, vllm, start_sidecar, tmp_path):
    qwen = installed_harness("qwen-code")
    sidecar = start_sidecar(policy_server.base_url, episode_id="qwen",
                            extra=("--max-completion-tokens", str(MAX_COMPLETION_TOKENS)))  # fmt: skip
    run = run_harness([qwen, "-p", "Say hello in one word.", "--auth-type", "openai", "--output-format", "json"],
                      tmp_path, {"OPENAI_BASE_URL": f"{sidecar.url}/v1", "OPENAI_API_KEY": API_KEY})  # fmt: skip
    result = next(event for event in json.loads(run.stdout) if event.get("type") == "result")
    requests = sum(model["api"]["totalRequests"] for model in result["stats"]["models"].values())
    calls = recorded(sidecar, "qwen", at_least=requests)  # every call Qwen Code says it made (the WAL flushes)
    assert_harness_succeeded(run, calls)
    assert len(calls) == requests and {c["harness"] for c in calls} == {"qwen-code"}
    assert all(c["prompt_token_ids"] and c["completion_token_ids"] for c in calls)
    assert_counts_equal(calls, result["usage"]["input_tokens"], result["usage"]["output_tokens"])
    assert_all_sampled_by_vllm(vllm, policy_server, calls)
    assert_no_secret_anywhere(sidecar, [API_KEY])


@pytest.mark.parametrize("api", list(PI_APIS))
def test_pi_headless_over_each_api_is_served_recorded_exactly_and_labelled(
    policy_server, vllm, start_sidecar, tmp_path, api
):
    pi = installed_harness("pi")
    sidecar = start_sidecar(policy_server.base_url, episode_id=f"pi-{api}",
                            extra=("--max-completion-tokens", str(MAX_COMPLETION_TOKENS)))  # fmt: skip
    config = tmp_path / ".pi" / "agent"
    config.mkdir(parents=True)
    base_url = sidecar.url if api == "messages" else f"{sidecar.url}/v1"
    (config / "models.json").write_text(json.dumps({"providers": {"openforge": {
        "baseUrl": base_url, "api": PI_APIS[api], "apiKey": API_KEY, "models": [{"id": "policy"}]}}}))  # fmt: skip
    run = run_harness([pi, "--provider", "openforge", "--model", "policy", "--mode", "json", "-p", "--no-session",
                       "Say hello in one word."], tmp_path, {"PI_OFFLINE": "1"})  # fmt: skip
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    usages = [e["message"]["usage"] for e in events
              if e.get("type") == "message_end" and e["message"].get("role") == "assistant"]  # fmt: skip
    calls = recorded(sidecar, f"pi-{api}", at_least=max(1, len(usages)))  # every answer pi got (the WAL flushes)
    assert_harness_succeeded(run, calls)
    assert {c["harness"] for c in calls} == {"pi"} and {c["api"] for c in calls} == {api}
    assert all(c["prompt_token_ids"] and c["completion_token_ids"] for c in calls)
    assert len(usages) == len(calls)
    # pi counts the prompt tokens the server read from its prefix cache apart (cacheRead, from vLLM's cached_tokens)
    prompt_tokens = sum(u["input"] + u["cacheRead"] for u in usages)
    assert_counts_equal(calls, prompt_tokens, sum(u["output"] for u in usages))
    assert_all_sampled_by_vllm(vllm, policy_server, calls)
    assert_no_secret_anywhere(sidecar, [API_KEY])
