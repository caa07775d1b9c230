"""The real harnesses as the tests and benchmarks run them: installed (pinned by scripts/harness.sh), configured
against an endpoint as a user would, and checked for having succeeded."""

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from forge.paths import repo_root
from sidecar.cli import sidecar_python_bin
from tests.support.sidecar import call_table
from trainer.serve import free_port

# Test-only (harness_output_bound.py): keeps a sampling 135M model from rambling for minutes.
OUTPUT_BOUND = 96


def assert_harness_succeeded(
    run: subprocess.CompletedProcess, calls: list[dict], explained_exit: tuple[int, str] | None = None
) -> None:
    """The harness exited 0 and every model call it made was recorded ok (the table of all calls otherwise).
    ``explained_exit`` (code, words in its output): the one other exit accepted, when every call ran into the
    completion-token bound (``finish_reason`` length) and the harness says that is why it stopped."""
    table = call_table(calls)
    print(table)
    transcript = (run.stdout + run.stderr)[-3000:]
    explained = (
        explained_exit is not None
        and run.returncode == explained_exit[0]
        and explained_exit[1] in transcript
        and bool(calls)
        and all(c["finish_reason"] == "length" for c in calls)
    )
    assert run.returncode == 0 or explained, f"the harness exited {run.returncode}:\n{transcript}\n{table}"
    assert calls and all(c["status"] == "ok" for c in calls), f"not every call is ok:\n{table}\n{transcript}"


def claude_code_env(home, base_url: str, max_output_tokens: int) -> dict[str, str]:
    """Claude Code's environment as a user runs it offline against an endpoint, its answers bounded by its own
    setting (CLAUDE_CODE_MAX_OUTPUT_TOKENS, sent as max_tokens)."""
    return {
        "PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(home), "NO_COLOR": "1",
        "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": "sk-ant-test-not-a-real-key",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "IS_SANDBOX": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
    }  # fmt: skip


def installed_harness(name: str) -> str:
    """The executable of a pinned real harness, installed once by scripts/harness.sh (`make harnesses`)."""
    found = subprocess.run([str(repo_root() / "scripts" / "harness.sh"), name], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.fail(f"cannot install {name} (`make harnesses`): {found.stderr.strip()}")
    return found.stdout.strip()


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
