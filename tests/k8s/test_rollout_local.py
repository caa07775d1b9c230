"""`forge rollout --backend local` for real: a real sidecar (`forge sidecar --mode regular`, mitmproxy), harness
processes that call `https://api.openai.com` through it with no knowledge of it (proxy and CA from the
environment), verifiers, rewards in the store. The policy is bench/fake_upstream.py (a vLLM-shaped answer):
this test is about the orchestration, the sidecar's token exactness is tested against real vLLM elsewhere.
"""

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.fake_upstream import FakeUpstream
from k8s.rollout import Attempt, LocalBackend, LocalSettings, Outcome, orchestrate, rollouts_for, summary
from k8s.tasks import Task
from k8s.verify import Verdict

FORGE = str(Path(sys.executable).parent / "forge")
# The harness: an unmodified OpenAI-style client (Python's urllib) that reads only the usual environment.
HARNESS = r"""
import json, os, urllib.request
body = {"model": "gpt-4o", "messages": [{"role": "user", "content": os.environ["FORGE_PROMPT"]}]}
request = urllib.request.Request("https://api.openai.com/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "authorization": "Bearer sk-test"})
answer = json.load(urllib.request.urlopen(request, timeout=30))
open("answer.txt", "w").write(answer["choices"][0]["message"]["content"])
"""


@pytest.fixture
def fake_upstream() -> Iterator[FakeUpstream]:
    with FakeUpstream() as upstream:
        yield upstream


def rows(store: Path, kind: str) -> list[dict]:
    files = sorted((store / kind).rglob("*.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


@pytest.mark.integration
def test_a_real_task_end_to_end_behind_one_sidecar(tmp_path, fake_upstream):
    (tmp_path / "harness.py").write_text(HARNESS)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"id": "echo", "prompt": "say hi", "command": [sys.executable, str(tmp_path / "harness.py")],
                    "verifier": 'test -s answer.txt && echo \'{"reward": 0.75, "components": {"answered": 1}}\' '
                                '> "$FORGE_VERDICT_FILE"'})
        + "\n"
        + json.dumps({"id": "never", "prompt": "x", "command": "true", "verifier": "test -f answer.txt"})
        + "\n"
    )  # fmt: skip
    store, results = tmp_path / "store", tmp_path / "results.jsonl"
    done = subprocess.run(
        [FORGE, "rollout", "--backend", "local", "--tasks", str(tasks), "-G", "2", "--concurrency", "2",
         "--run-id", "r1", "--upstream", fake_upstream.url, "--store", str(store), "--workdir", str(tmp_path / "w"),
         "--results", str(results)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "run r1: 2 tasks x 2 rollouts (local)"
    echo_row = next(line for line in lines if line.startswith("echo "))
    assert echo_row.split()[1:4] == ["2", "2", "0"] and "0.750" in echo_row
    assert next(line for line in lines if line.startswith("never ")).split()[5] == "0.000"

    # Each harness call went through the sidecar and is recorded under its own episode, task and run.
    calls = rows(store, "calls")
    assert sorted(c["episode_id"] for c in calls) == ["r1.echo.0", "r1.echo.1"]
    assert all(c["status"] == "ok" and c["host"] == "api.openai.com" and c["run_id"] == "r1" for c in calls)
    assert len(fake_upstream.requests) == 2  # served by the policy, never by the real host
    rewards = {r["episode_id"]: r["reward"] for r in rows(store, "rewards")}
    assert rewards == {"r1.echo.0": 0.75, "r1.echo.1": 0.75, "r1.never.0": 0.0, "r1.never.1": 0.0}
    answer = (tmp_path / "w/r1/r1.echo.1/attempt-1/answer.txt").read_text()
    assert answer == "SmolLAM"  # the fake policy's answer reached the unmodified client
    written = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(r["episode_id"] for r in written) == ["r1.echo.0", "r1.echo.1", "r1.never.0", "r1.never.1"]


class FlakyBackend:
    """The local backend with the first attempt of each rollout of one task failing as infrastructure would."""

    def __init__(self, inner: LocalBackend, flaky_task: str) -> None:
        self.inner, self.flaky_task = inner, flaky_task
        self.failed: list[Attempt] = []
        self.running = 0
        self.max_running = 0

    def start(self, attempt: Attempt) -> None:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        if attempt.rollout.task.id == self.flaky_task and attempt.number == 1:
            self.failed.append(attempt)
        self.inner.start(attempt)

    def wait(self) -> tuple[Attempt, Outcome]:
        attempt, outcome = self.inner.wait()
        self.running -= 1
        if attempt in self.failed:
            return attempt, Outcome(None, "node lost")
        return attempt, outcome

    def cancel(self) -> None:
        pass


def test_concurrency_is_bounded_failures_are_retried_with_their_reason_and_summarised(tmp_path):
    slow = Task("slow", ("sh", "-c", "sleep 0.2; echo 1 > out"), ("test", "-f", "out"))
    flaky = Task("flaky", ("true",), ("sh", "-c", "echo 0.5"))
    backend = FlakyBackend(LocalBackend(LocalSettings(tmp_path)), "flaky")
    results = orchestrate(rollouts_for([slow, flaky], 3, "r2"), backend, concurrency=2, retries=1)
    assert backend.max_running == 2
    assert [r.verdict for r in results if r.rollout.task.id == "slow"] == [Verdict(1.0, {}, 0, "verifier exited 0")] * 3
    flaky_results = [r for r in results if r.rollout.task.id == "flaky"]
    assert all(r.ok and r.attempts == 2 and r.reasons == ["node lost"] for r in flaky_results)
    table = summary(results)
    assert "flaky" in table and table.splitlines()[-1].split()[:5] == ["all", "6", "6", "0", "3"]

    always_lost = FlakyBackend(LocalBackend(LocalSettings(tmp_path)), "flaky")
    none_left = orchestrate(rollouts_for([flaky], 1, "r3"), always_lost, concurrency=1, retries=0)
    assert not none_left[0].ok and none_left[0].reasons == ["node lost"]
    assert "r3.flaky.0: node lost" in summary(none_left)


def test_a_harness_that_cannot_start_is_a_failure_with_its_reason(tmp_path):
    task = Task("missing", ("/no/such/harness",), ("true",))
    (result,) = orchestrate(rollouts_for([task], 1, "r4"), LocalBackend(LocalSettings(tmp_path)), 1, retries=1)
    assert not result.ok and result.attempts == 2 and all("could not start" in r for r in result.reasons)


def test_a_retried_rollout_is_a_new_episode_so_the_aborted_attempts_calls_never_get_its_reward(tmp_path):
    """The first attempt's harness dies after its calls; the retry runs as episode `<id>.a2` (same task, same GRPO
    group), and the reward goes to that episode alone."""
    marker = tmp_path / "failed-once"
    harness = f'echo "$FORGE_EPISODE_ID" >> {tmp_path}/seen; test -f {marker} || {{ touch {marker}; exit 3; }}'
    task = Task("flaky", ("sh", "-c", harness), ("sh", "-c", "echo 1.0"))
    store = tmp_path / "store"
    settings = LocalSettings(tmp_path / "work", str(store), harness_must_succeed=True)
    (result,) = orchestrate(rollouts_for([task], 1, "r5"), LocalBackend(settings), 1, retries=1)
    assert result.ok and result.attempts == 2 and result.as_json()["episode_id"] == "r5.flaky.0.a2"
    assert (tmp_path / "seen").read_text().split() == ["r5.flaky.0", "r5.flaky.0.a2"]
    assert [(r["episode_id"], r["reward"]) for r in rows(store, "rewards")] == [("r5.flaky.0.a2", 1.0)]
