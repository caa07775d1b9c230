"""`forge demo`, shortened (2 tasks × 2 rollouts × 2 rounds): the whole loop with the real mini-swe-agent, the real
sidecar, the real vLLM, the real collector and a real veRL update, checked from what it left in the store.

It starts its own policy server (the demo loads adapters into it) and installs mini-swe-agent once
(scripts/harness.sh, cached under $FORGE_CACHE) as `make demo` does.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collector.sql import connect
from forge.demo.run import HELDOUT_FILE, TASKS_FILE, summary_table
from forge.demo.verify import CHECKS, verdict
from k8s.tasks import load_tasks
from trainer import teacher
from trainer.publish import TOLERANCE
from trainer.serve import default_checkpoint

FORGE = str(Path(sys.executable).parent / "forge")
DEMO_TEMPERATURE = 0.5  # forge/demo/tasks/mini.yaml: the harness's own sampling setting
MINI = '"$FORGE_DEMO_MINI" -c "$FORGE_DEMO_DIR/mini.yaml" -t "$FORGE_PROMPT" -o traj.json'
# The test's verifier: the length of the answers the harness ran, so a group's rewards almost never tie (a flat group
# is left out of the update; this test is about the loop, not the task). Written as the verifier contract asks.
LENGTH_VERIFIER = """
import json, os
try:
    messages = json.load(open("traj.json"))["messages"]
except (OSError, ValueError, KeyError):
    messages = []
text = "".join(str(m.get("content")) for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
verdict = json.dumps({"reward": min(len(text), 999) / 1000})
open(os.environ["FORGE_VERDICT_FILE"], "w").write(verdict)
print(verdict)
"""


def task_file(path: Path, ids: list[str], verifier: Path) -> Path:
    prompts = {"hello": "Create a file named hello.txt that contains the word hello.", "build": "Create a folder named "
               "build.", "cache": "Create a folder named cache."}  # fmt: skip
    lines = [json.dumps({"id": i, "prompt": prompts[i], "command": MINI, "timeout_s": 120,
                         "verifier": f'"$FORGE_DEMO_PYTHON" {verifier}'}) for i in ids]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.integration
@pytest.mark.timeout(1800)  # the demo's own bound (below); a loaded 2-core machine took over 900 s
def test_a_short_demo_closes_the_loop(tmp_path: Path, s3_server) -> None:
    """On moto's S3 server (calls, rewards and checkpoints go to S3; one demo run serves both stores' checks: a
    folder store is the demo's default and every collector test's)."""
    out, store = tmp_path / "demo", f"s3://{s3_server.bucket}/demo"
    verifier = tmp_path / "length.py"
    verifier.write_text(LENGTH_VERIFIER)
    tasks, heldout = task_file(tmp_path / "tasks.jsonl", ["hello", "build"], verifier), task_file(
        tmp_path / "heldout.jsonl", ["cache"], verifier)  # fmt: skip
    done = subprocess.run(
        [FORGE, "demo", "--tasks", "2", "--rollouts", "3", "--rounds", "2", "--out", str(out), "--run", "t",
         "--tasks-file", str(tasks), "--heldout-file", str(heldout), "--heldout-samples", "2", "--epochs", "2",
         "--store", store, "--s3-endpoint", s3_server.endpoint, "--no-progress"],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the libraries' warnings went to the run's log, not between the demo's lines
    assert "Warning" not in done.stderr and "Warning" not in done.stdout, done.stderr[-3000:]
    assert "torchtitan engine is not available" in (out / "demo.log").read_text()
    assert not (out / "store").exists()
    printed = done.stdout
    assert "round  policy version  episodes" in printed and "rounds in" in printed

    summary = json.loads((out / "summary.json").read_text())
    rounds = summary["rounds"]
    assert [r["version"] for r in rounds] == [0, 1]
    assert [r["new_version"] for r in rounds] == [1, 2]
    for r in rounds:  # forks are filed by measured cause, none under a fallback
        assert "unknown" not in r["forks_by_cause"] and sum(r["forks_by_cause"].values()) <= r["calls"]
    for r in rounds:  # one GRPO group per task: the task id reached the records through the proxy user name
        assert r["groups"] == 2, r
        assert r["episodes"] == 6 and r["complete"] + r["failed_rollouts"] >= 6 - r["failed_rollouts"]
    # The held-out verdict: v0 (before any update) against v2 (the last), each evaluated on the never-trained task.
    assert summary["heldout"]["verdict"].startswith("v0 → v2: held-out mean reward"), summary["heldout"]
    assert "Welch one-sided p = " in summary["heldout"]["verdict"] and summary["heldout"]["verdict"] in printed
    assert {v: f["n"] for v, f in summary["heldout"]["versions"].items()} == {"v0": 2, "v2": 2}
    assert "Welch's t-test, one-sided" in (out / "heldout.txt").read_text()

    con = connect(store, s3_server.endpoint, episodes=True, state_dir=tmp_path / "state", idle_seconds=0.0)
    calls = con.execute(
        "SELECT run_id, episode_id, task_id, host, harness, status, policy_version, len(prompt_token_ids), "
        "len(completion_token_ids) FROM calls ORDER BY run_id, episode_id, seq"
    ).fetchall()
    episodes = {c[1] for c in calls}
    assert episodes == {f"t-r{n}.{task}.{i}" for n in (1, 2) for task in ("hello", "build") for i in range(3)} | {
        f"eval-t-v{v}.cache.{i}" for v in (0, 2) for i in range(2)}  # fmt: skip
    expected = {"t-r1": "0", "t-r2": "1", "eval-t-v0": "0", "eval-t-v2": "2"}  # the version each run was served by
    for run_id, episode, task, host, harness, status, version, n_prompt, n_completion in calls:
        assert episode.startswith(f"{run_id}.{task}."), (episode, task)
        assert host == "api.openai.com"  # the harness kept its own endpoint: the sidecar answered as it
        assert harness == "mini-swe-agent"
        assert status == "ok" and n_prompt and n_completion
        # Round 1 was served by v0 and round 2 by the published v1, every call of each (a version question on a
        # kept-alive connection the server had closed once left a call's version unknown: sidecar/version.py).
        assert version == expected[run_id], (episode, version)

    rewards = dict(con.execute("SELECT episode_id, reward FROM rewards WHERE episode_id LIKE 't-r%'").fetchall())
    failed = sum(r["failed_rollouts"] for r in rounds)
    assert len(rewards) == 12 - failed and failed <= 1

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2]
    for m in metrics:  # each update landed: the server's probe logprobs are the new weights'
        assert m["probe_diff"] <= TOLERANCE["float32"]
        assert m["episodes"] >= 3

    # Behaviour, not labels: each call's recorded logprobs are those of the weights its record names (teacher forcing
    # under that version's checkpoint in the store), and round 2's are not v0's (when the update moved the policy).
    import boto3

    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_server.endpoint)
            .list_objects_v2(Bucket=s3_server.bucket, Prefix="demo/checkpoints/t/")["Contents"]]  # fmt: skip
    assert {f"demo/checkpoints/t/v{n}/_PUBLISHED.json" for n in (0, 1, 2)} <= set(keys), keys
    # The trainer's local copies of what it uploaded (the S3 objects' bytes are the same files).
    base, checkpoints = default_checkpoint("float32"), out / "trainer" / "forge-checkpoints" / "checkpoints" / "t"
    moved = {m["version"]: m["probe_diff_old"] > 10 * TOLERANCE["float32"] for m in metrics}
    served = con.execute(
        "SELECT run_id, call_id, model_served, prompt_token_ids, completion_token_ids, completion_logprobs, sampling "
        "FROM calls WHERE status = 'ok' ORDER BY run_id, call_id"
    ).fetchall()
    # Sampled at the harness's temperature (forge/demo/tasks/mini.yaml), recorded; the recorded logprobs are that
    # distribution's, so teacher forcing computes at it.
    assert {json.loads(row[-1])["temperature"] for row in served} == {DEMO_TEMPERATURE}
    served = [row[:-1] for row in served]
    gaps = []
    for run_id, call_id, model, prompt, completion, recorded in served:
        assert model == "forge-t", (call_id, model)  # the run's adapter served it, v0 too, never the base beside it
        version = int(expected[run_id])  # the held-out evaluation of v2 too: the last version served it
        forced = teacher.logprobs(checkpoints / f"v{version}", base, prompt, completion, DEMO_TEMPERATURE)
        gap = teacher.mean_abs_gap(recorded, forced)
        assert gap <= TOLERANCE["float32"], (call_id, version, gap)
        if version and moved[version]:
            before = teacher.logprobs(checkpoints / f"v{version - 1}", base, prompt, completion, DEMO_TEMPERATURE)
            old = teacher.mean_abs_gap(recorded, before)
            assert old > 10 * gap and old > TOLERANCE["float32"], (call_id, gap, old)
            gaps.append((gap, old))
    print(f"teacher forcing (mean |recorded - forced| under the version named, under the one before): {gaps}")
    assert (out / "rounds.png").stat().st_size > 10_000
    pages = list(out.glob("episode-*.html"))
    assert len(pages) == 1 and "segment" in pages[0].read_text()


def test_every_shipped_task_has_a_verifier_that_gives_partial_credit(tmp_path: Path) -> None:
    trained, heldout = load_tasks(TASKS_FILE), load_tasks(HELDOUT_FILE)
    assert {t.id for t in trained + heldout} == set(CHECKS) and not {t.id for t in trained} & {t.id for t in heldout}
    trajectory = {"messages": [
        {"role": "assistant", "content": "```bash\nls\n```"},
        {"role": "user", "content": "Format error", "extra": {"interrupt_type": "FormatError"}},
    ]}  # fmt: skip
    (tmp_path / "traj.json").write_text(json.dumps(trajectory))
    assert verdict("file-hello", tmp_path) == {
        "reward": 0.2, "components": {"format": 0.5, "outcome": 0.0, "turns_run": 1, "turns_rejected": 1}
    }  # fmt: skip
    (tmp_path / "hello.txt").write_text("nothing\n")
    assert verdict("file-hello", tmp_path)["reward"] == 0.5  # the file: half the outcome
    (tmp_path / "hello.txt").write_text("Hello\n")
    assert verdict("file-hello", tmp_path)["reward"] == 0.8  # the word, in any case
    (tmp_path / "build").write_text("a file, not a folder")
    assert verdict("folder-build", tmp_path)["components"]["outcome"] == 0.0
    (tmp_path / "build").unlink()
    (tmp_path / "build").mkdir()
    assert verdict("folder-build", tmp_path)["components"]["outcome"] == 1.0
    (tmp_path / "traj.json").write_text("{not json")
    assert verdict("file-hello", tmp_path)["components"]["format"] == 0.0  # no trajectory, no format credit


def test_the_summary_table_says_what_each_round_did() -> None:
    from forge.demo.run import RoundStats

    stats = RoundStats(round=1, version=0, episodes=16, complete=15, failed_rollouts=1, calls=40,
                       trainable_tokens=4000, fork_rate=0.25, reward_mean=0.2, reward_sd=0.1, groups=4,
                       zero_variance_groups=1, rollout_s=100.0, update_s=50.0, publish_s=1.5,
                       new_version=1, forks_by_cause={"answer_dropped": 3, "rewrite": 1})  # fmt: skip
    lines = summary_table([stats]).splitlines()
    assert "3 answer_dropped, 1 rewrite" in lines[2]
    assert lines[0].split()[:3] == ["round", "policy", "version"]
    assert "v0 → v1" in lines[2] and "15/16" in lines[2] and "0.200 ± 0.100" in lines[2] and "1/4" in lines[2]


def test_a_module_the_agent_writes_into_its_workspace_is_not_what_the_verifier_imports(tmp_path: Path) -> None:
    """The verifier runs in the workspace; `python -m` would put it first on the import path, and a json.py there
    would decide the reward (it did, before -P)."""
    from forge.demo.harness import with_harness_env
    from k8s.verify import run_verifier

    (tmp_path / "json.py").write_text(
        "import os\nopen(os.environ['FORGE_VERDICT_FILE'], 'w').write('{\"reward\": 1.0}')\nraise SystemExit(0)\n"
    )
    for task in with_harness_env(load_tasks(TASKS_FILE) + load_tasks(HELDOUT_FILE), None, tmp_path, {}):
        env = {**__import__("os").environ, **task.env}
        verdict = run_verifier(task.verifier, tmp_path, env, 30)
        assert verdict.reward == 0.0, (task.id, verdict)


def test_what_a_harness_leaves_running_is_killed_before_the_verifier_reads_the_workspace(tmp_path: Path) -> None:
    """A background writer started by the agent would change the workspace under the verifier, or wait for a later
    rollout's folder (the held-out evaluation's): the local backend kills the harness's whole session."""
    from k8s.rollout import run_in_own_session

    with open(tmp_path / "log", "wb") as log:
        done = run_in_own_session(["bash", "-c", "(sleep 2; touch late) & exit 0"], tmp_path, {"PATH": "/usr/bin:/bin"},
                                  log, 30)  # fmt: skip
    assert done.returncode == 0
    __import__("time").sleep(3)
    assert not (tmp_path / "late").exists()


def test_what_a_harness_leaves_running_in_a_session_of_its_own_is_killed_too(tmp_path: Path) -> None:
    """setsid and a double fork leave the harness's process group (a killpg of the group missed them: `late` was
    written after the verifier had read the workspace); the subreaper still ends them. Also after a timeout."""
    from k8s.rollout import run_in_own_session

    escape = "(setsid sh -c 'sleep 2; touch late' </dev/null >/dev/null 2>&1 &) ; exit 3"
    with open(tmp_path / "log", "wb") as log:
        done = run_in_own_session(["bash", "-c", escape], tmp_path, {"PATH": "/usr/bin:/bin"}, log, 30)
    assert done.returncode == 3
    slow = "(setsid sh -c 'sleep 3; touch later' </dev/null >/dev/null 2>&1 &) ; sleep 30"
    with open(tmp_path / "log", "wb") as log, pytest.raises(subprocess.TimeoutExpired):
        run_in_own_session(["bash", "-c", slow], tmp_path, {"PATH": "/usr/bin:/bin"}, log, 1)
    time.sleep(4)
    assert not (tmp_path / "late").exists() and not (tmp_path / "later").exists()
