"""`forge eval` end to end on a task file the demo has never seen: the real sidecar (regular mode), the real vLLM
(the session's policy server), a tiny harness that asks "OpenAI" once over HTTPS, and verifiers a reader checks by
eye; the figures in eval.json are the store's, and a trainer's selection leaves every one of the episodes out."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from collector.collect import Collector
from collector.sql import connect
from trainer.batch import parse_version
from trainer.loop import select_groups

FORGE = str(Path(sys.executable).parent / "forge")

# The harness: one Chat Completions call to the real OpenAI host, which only the sidecar (HTTPS_PROXY, loopback)
# can answer; it refuses to run without it, so nothing here leaves the machine.
HARNESS = """
import os, ssl, sys
import httpx
if "@127.0.0.1:" not in os.environ.get("HTTPS_PROXY", ""):
    sys.exit("no loopback sidecar in HTTPS_PROXY: not calling out")
answer = httpx.post(
    "https://api.openai.com/v1/chat/completions", timeout=120,
    verify=ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"]),
    headers={"authorization": "Bearer sk-forge-eval-test"},
    json={"model": "gpt-4o-mini", "max_tokens": 8,
          "messages": [{"role": "user", "content": os.environ["FORGE_PROMPT"]}]},
)
answer.raise_for_status()
open("answer.txt", "w").write(answer.json()["choices"][0]["message"]["content"] or "")
"""


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_forge_eval_end_to_end_on_a_new_task_file(tmp_path, policy_server):
    harness = tmp_path / "ask.py"
    harness.write_text(HARNESS)
    command = f'"$FORGE_DEMO_PYTHON" {harness}'
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"id": "say-hi", "prompt": "Say hi.", "command": command, "verifier": "test -f answer.txt",
                    "timeout_s": 180}) + "\n"
        # Partial credit under the threshold: a reward of 0.25 is never a success.
        + json.dumps({"id": "quarter", "prompt": "Name a colour.", "command": command,
                      "verifier": 'test -f answer.txt && echo 0.25 > "$FORGE_VERDICT_FILE"',
                      "success_threshold": 0.5, "timeout_s": 180})
        + "\n"
    )  # fmt: skip
    out = tmp_path / "eval"
    done = subprocess.run(
        [FORGE, "eval", "--tasks", str(tasks), "--samples", "2", "--k", "1,2", "--out", str(out),
         "--policy-url", policy_server.base_url, "--run", "new-tasks", "--no-progress"],
        capture_output=True, text=True, timeout=540, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pass@2" in done.stdout and "pass^2" in done.stdout

    result = json.loads((out / "eval.json").read_text())
    assert result["run_id"] == "eval-new-tasks"
    say_hi, quarter = result["tasks"]
    assert (say_hi["n"], say_hi["successes"], say_hi["mean_reward"]) == (2, 2, 1.0)
    assert (say_hi["pass@1"], say_hi["pass@k"]["2"], say_hi["pass^k"]["2"]) == (1.0, 1.0, 1.0)
    assert (quarter["n"], quarter["successes"], quarter["mean_reward"]) == (2, 0, 0.25)
    assert (quarter["pass@k"]["2"], quarter["pass^k"]["2"]) == (0.0, 0.0)
    overall = result["overall"]
    assert (overall["n"], overall["successes"], overall["mean_reward"]) == (4, 2, 0.625)
    assert (overall["pass@1"], overall["pass@k"]["2"], overall["pass^k"]["2"]) == (0.5, 0.5, 0.5)
    samples = [s for t in result["tasks"] for s in t["samples"]]
    assert all(s["status"] == "complete" and s["n_calls"] == 1 for s in samples), samples  # through the sidecar
    assert result["policy"]["models_served"] == {policy_server.name: 4}

    # What eval.json says is what the store holds.
    store = str(out / "store")
    con = connect(store, run="eval-new-tasks")
    stored = dict(con.execute("SELECT episode_id, reward FROM rewards").fetchall())
    assert stored == {s["episode_id"]: s["reward"] for s in samples}
    # And no trainer learns from it.
    episodes = Collector(store, idle_seconds=0.0, progress=False).update().episodes
    version = parse_version(next(iter(result["policy"]["policy_versions"]))) or 0
    chosen, _, waiting = select_groups(episodes, version, "sync", 0, set(), 100)
    assert chosen == [] and waiting["for_evaluation"] == 4
