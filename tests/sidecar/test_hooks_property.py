"""The addon's real hooks on odd JSON (hooks_property.py, run in the sidecar's environment: mitmproxy, no servers)."""

import os
import subprocess
import sys
from pathlib import Path

import hypothesis
import pytest

HERE = Path(__file__).resolve().parent
SIDECAR_PYTHON = HERE.parent.parent / ".venv-sidecar" / "bin" / "python"
EXAMPLES = 300


def hypothesis_only(folder: Path) -> Path:
    """A folder holding only hypothesis (pure Python; its one dependency, sortedcontainers, is mitmproxy's too), so
    the sidecar's environment gains nothing else of the main one."""
    site = Path(hypothesis.__file__).resolve().parent.parent
    for name in ("hypothesis", "_hypothesis_globals.py", "_hypothesis_ftz_detector.py"):
        (folder / name).symlink_to(site / name)
    return folder


def in_sidecar_env(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """hooks_property.py with these arguments, in the sidecar's environment; its output shown on failure."""
    if not SIDECAR_PYTHON.exists():
        pytest.fail("the sidecar environment is missing: run `make env`")
    env = {**os.environ, "PYTHONPATH": str(hypothesis_only(tmp_path))}
    done = subprocess.run(
        [str(SIDECAR_PYTHON), str(HERE / "hooks_property.py"), *args],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    sys.stderr.write(done.stderr[-4000:])
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "ok", done.stdout + done.stderr[-8000:]
    return done


def test_every_model_call_goes_upstream_whole_or_as_it_came_and_ends_in_one_record(tmp_path):
    """Found triggers first (a lone surrogate escape in a body, a non-string system text, a tool whose name is a
    list, a non-UTF-8 episode header, vLLM-internal fields: each must be prepared whole), then odd-typed JSON for
    every wire API."""
    done = in_sidecar_env(tmp_path, "property", str(EXAMPLES))
    assert "triggers ok" in done.stdout


def test_a_tokens_in_call_whose_fallback_cannot_reach_the_server_gets_a_502_and_is_recorded(tmp_path):
    in_sidecar_env(tmp_path, "tokens-in-fallback-unreachable")


def test_a_tokens_in_call_whose_normal_path_answers_an_http_error_passes_that_answer_on(tmp_path):
    in_sidecar_env(tmp_path, "tokens-in-fallback-http-error")


def test_a_call_moved_to_a_replica_with_a_smaller_context_is_bounded_again(tmp_path):
    in_sidecar_env(tmp_path, "replica-move-bounds-again")


def test_the_clients_threads_and_gauges_of_a_replica_that_left_dns_go_with_it(tmp_path):
    in_sidecar_env(tmp_path, "replicas-that-leave-dns-are-forgotten")
