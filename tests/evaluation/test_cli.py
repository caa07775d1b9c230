"""`forge eval`'s expected errors: one line on stderr, exit 2, nothing started; and its run ids and --k."""

import subprocess
import sys
from pathlib import Path

import pytest

from collector.episode import is_evaluation
from forge.errors import ForgeError
from forge.evaluation.run import evaluation_run_id, parse_ks

FORGE = str(Path(sys.executable).parent / "forge")
TASK = '{"id": "a", "command": "true", "verifier": "true"}'


def forge_eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FORGE, "eval", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("task_line", "args", "message"),
    [
        (None, ["--samples", "2"], "cannot read the tasks file"),  # missing task file
        (TASK, ["--samples", "2", "--k", "1,3"], "--k 3 is larger than --samples 2"),
        (TASK, ["--samples", "2", "--k", "one"], "--k 'one': give a comma-separated list of integers ≥ 1"),
        (TASK, ["--samples", "0"], "--samples and --concurrency must be ≥ 1"),
        ('{"id": "a", "command": "true", "verifier": "true", "success_threshold": "all"}', ["--samples", "2"],
         "tasks.jsonl:1: success_threshold 'all' must be a finite number"),
        (TASK, ["--samples", "2", "--checkpoint", "/nonexistent-checkpoint"], "--checkpoint /nonexistent-checkpoint"),
        (TASK, ["--samples", "2", "--policy-url", "http://127.0.0.1:9", "--checkpoint", "."], "not both"),
        (TASK, [], "forge eval needs --samples"),
        (TASK, ["--samples", "2", "--run", "a.b"], "--run 'a.b': a run id has no"),
    ],
)  # fmt: skip
def test_an_expected_error_is_one_line_with_exit_2_and_starts_nothing(tmp_path, task_line, args, message):
    tasks = tmp_path / "tasks.jsonl"
    if task_line is not None:
        tasks.write_text(task_line + "\n")
    out = tmp_path / "out"
    done = forge_eval("--tasks", str(tasks), "--out", str(out), *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not out.exists()  # refused before any folder, server or rollout


def test_run_ids_are_evaluation_run_ids():
    assert evaluation_run_id("heldout-v0") == "eval-heldout-v0" and evaluation_run_id("eval-x") == "eval-x"
    assert is_evaluation(evaluation_run_id(None)) and not is_evaluation("demo-r1") and not is_evaluation(None)
    assert parse_ks("3, 1,3") == [1, 3]
    with pytest.raises(ForgeError):
        parse_ks("0,1")
