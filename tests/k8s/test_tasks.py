"""The tasks file of `forge rollout`: JSONL, and a bad line is named by its number."""

import subprocess
import sys
from pathlib import Path

import pytest

from forge.errors import ForgeError
from k8s.tasks import load_tasks
from k8s.verify import run_verifier, verdict_from

FORGE = str(Path(sys.executable).parent / "forge")


def write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_good_file_gives_its_tasks_with_string_commands_run_by_sh(tmp_path):
    path = write(
        tmp_path,
        "# comments and blank lines are skipped",
        "",
        '{"id": "add-2-3", "prompt": "2+3?", "command": "python agent.py", "verifier": ["test", "-f", "a.txt"]}',
        '{"id": "b", "command": ["true"], "verifier": "true", "timeout_s": 5, "env": {"K": "V"}, "image": "x:1",'
        ' "harness": "codex", "success_threshold": 0.5}',
    )
    first, second = load_tasks(path)
    assert first.id == "add-2-3" and first.command == ("sh", "-c", "python agent.py") and first.prompt == "2+3?"
    assert first.verifier == ("test", "-f", "a.txt") and first.timeout_s == 600
    assert second.env == {"K": "V"} and second.image == "x:1" and second.timeout_s == 5
    assert first.harness == "" and second.harness == "codex"
    assert first.success_threshold == 1.0 and second.success_threshold == 0.5


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "tasks.jsonl:2: not JSON"),
        ('{"id": "b", "verifier": "true"}', "tasks.jsonl:2: command must be"),
        ('{"id": "b c", "command": "x", "verifier": "true"}', "tasks.jsonl:2: id 'b c'"),
        ('{"id": "b", "command": "x", "verifier": "true", "timeout": 3}', "unknown field 'timeout'"),
        ('{"id": "b", "command": "x", "verifier": "true", "timeout_s": -1}', "timeout_s must be a positive"),
        ('{"id": "a", "command": "x", "verifier": "true"}', "tasks.jsonl:2: task id 'a' appears twice"),
        ('["a"]', "tasks.jsonl:2: a task is a JSON object"),
        ('{"id": "b", "command": "x", "verifier": "true", "harness": 3}', "tasks.jsonl:2: harness must be a string"),
        (
            '{"id": "b", "command": "x", "verifier": "true", "success_threshold": "high"}',
            "tasks.jsonl:2: success_threshold 'high' must be a finite number",
        ),
        (
            '{"id": "b", "command": "x", "verifier": "true", "success_threshold": true}',
            "tasks.jsonl:2: success_threshold True must be a finite number",
        ),
        (
            '{"id": "b", "command": "x", "verifier": "true", "success_threshold": NaN}',
            "tasks.jsonl:2: success_threshold nan must be a finite number",
        ),
    ],
)
def test_a_bad_line_is_named(tmp_path, line, message):
    path = write(tmp_path, '{"id": "a", "command": "x", "verifier": "true"}', line)
    with pytest.raises(ForgeError, match=message.replace("(", r"\(")):
        load_tasks(path)


def test_the_cli_names_the_bad_line_in_one_line_without_a_traceback(tmp_path):
    path = write(tmp_path, '{"id": "a", "command": "x", "verifier": "true"}', '{"id": "a"')
    done = subprocess.run([FORGE, "rollout", "--tasks", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "tasks.jsonl:2: not JSON" in done.stderr


@pytest.mark.parametrize(
    ("exit_code", "written", "reward", "components"),
    [
        (0, None, 1.0, {}),
        (3, None, 0.0, {}),
        (0, "0.25\n", 0.25, {}),
        (0, '{"reward": 0.5, "components": {"tests": 2}}', 0.5, {"tests": 2.0}),
        (1, '{"reward": 0.5, "components": {"tests": 2}}', 0.0, {}),  # a failed verifier gives no reward
        (0, '{"reward": "high"}\n', 1.0, {}),  # not a number: the exit status decides
    ],
)
def test_a_verdict_comes_from_the_exit_status_or_the_verdict_file(exit_code, written, reward, components):
    verdict = verdict_from(exit_code, written)
    assert verdict.reward == reward and verdict.components == components and verdict.exit_code == exit_code


def test_a_non_zero_exit_is_no_reward_whatever_the_verifier_printed(tmp_path):
    """The verifier runs agent-written code (its tests): what that code prints on the way out is not the verdict."""
    verdict = run_verifier(("sh", "-c", "echo 1.0; exit 1"), tmp_path, {"PATH": "/usr/bin:/bin"}, 30)
    assert verdict.reward == 0.0 and verdict.exit_code == 1 and "exited 1" in verdict.detail


def test_the_verdict_comes_from_the_verdict_file_outside_the_workspace_not_stdout(tmp_path):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    script = (  # the agent's code prints a perfect score last; the verifier writes what it found, outside the folder
        'case "$FORGE_VERDICT_FILE" in "$PWD"/*|"") exit 9;; esac; '
        'echo \'{"reward": 0.25, "components": {"tests": 0.25}}\' > "$FORGE_VERDICT_FILE"; echo 1.0'
    )
    verdict = run_verifier(("sh", "-c", script), workspace, {"PATH": "/usr/bin:/bin"}, 30)
    assert (verdict.reward, verdict.components, verdict.exit_code) == (0.25, {"tests": 0.25}, 0)
    assert run_verifier(("sh", "-c", "echo 0.0"), workspace, {"PATH": "/usr/bin:/bin"}, 30).reward == 1.0


def test_an_odd_verdict_never_crashes_forge_verify(tmp_path):
    """A crash of forge verify after the verifier ran is an infrastructure failure, retried: agent-written code in
    the verifier could turn its failures into fresh attempts. An int of 400 digits raised OverflowError before; a
    FIFO in place of the verdict file blocked the read; a link is not followed."""
    huge = "1" + "0" * 400
    assert verdict_from(0, f'{{"reward": {huge}}}').detail == "verifier exited 0"
    assert verdict_from(0, f'{{"reward": 0.5, "components": {{"a": {huge}, "b": 1e999, "c": 1}}}}').components == {
        "c": 1.0
    }
    fifo = 'mkfifo "$FORGE_VERDICT_FILE"'
    verdict = run_verifier(("sh", "-c", fifo), tmp_path, {"PATH": "/usr/bin:/bin"}, 30)
    assert verdict.reward == 1.0 and verdict.detail == "verifier exited 0"
    (tmp_path / "secret").write_text("0.25")
    link = f'ln -s {tmp_path / "secret"} "$FORGE_VERDICT_FILE"'
    assert run_verifier(("sh", "-c", link), tmp_path, {"PATH": "/usr/bin:/bin"}, 30).detail == "verifier exited 0"
