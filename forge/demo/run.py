"""`forge demo`: the whole loop on one machine, round after round, with a real and unmodified harness.

One round: G rollouts of each task through mini-swe-agent (its own venv, its own default endpoint,
api.openai.com, reached through HTTPS_PROXY = the sidecar, which answers from the policy server and records every
call) → each rollout's verifier scores its workspace and the reward goes to the store → the collector assembles
the round's episodes (one GRPO group per task) → the trainer does one synchronous update (veRL, LoRA by default),
publishes v+1 to the policy server and verifies it landed → the next round runs on v+1.

The pieces are the project's own: `trainer.serve.PolicyServer`, `k8s.rollout.run_local` (its `LocalSidecar`),
`collector.collect.Collector`, `trainer.loop.Trainer`. This module only sequences them, counts, and writes the
summary (a table, a PNG of the rounds, the HTML of one episode).
"""

import dataclasses
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from forge.demo.harness import TASKS_DIR, find_harness, with_harness_env
from forge.errors import ForgeError
from k8s.rollout import RolloutResult, run_local
from k8s.tasks import Task, load_tasks

TASKS_FILE = TASKS_DIR / "tasks.jsonl"
HELDOUT_FILE = TASKS_DIR / "heldout.jsonl"  # the same kind of chores, never trained on: the demo's verdict


@dataclass
class DemoSettings:
    out: Path  # everything of this run: store (by default), rollouts, trainer state, summary, plot, episode page
    run: str
    store: str | None = None  # default: <out>/store
    s3_endpoint: str | None = None
    tasks: int = 8
    rollouts: int = 4  # G: rollouts per task per round (one GRPO group)
    rounds: int = 3
    concurrency: int = 4
    lora_rank: int = 8  # 0: full weights
    lr: float = 1e-3
    algo: str = "grpo"
    harness: Path | None = None  # mini-swe-agent's `mini` (default: scripts/harness.sh's install)
    policy_url: str | None = None  # a running `forge serve` (default: start one for the demo)
    progress: bool = True
    tasks_file: Path = TASKS_FILE
    harness_env: dict[str, str] = field(default_factory=dict)  # extra settings for every rollout
    epochs: int = 4  # optimizer steps per round over its batch (veRL's ppo_epochs)
    seed: int = 1  # the trainer's (LoRA's initial weights); the policy server samples with its own randomness
    heldout_file: Path = HELDOUT_FILE
    heldout_samples: int = 0  # per held-out task, before training and after the last round; 0: no evaluation

    @property
    def store_uri(self) -> str:
        return self.store or str(self.out / "store")


@dataclass
class RoundStats:
    round: int
    version: int  # the policy version the round's rollouts were served by
    episodes: int
    complete: int
    failed_rollouts: int
    calls: int
    trainable_tokens: int
    fork_rate: float
    reward_mean: float
    reward_sd: float
    groups: int
    zero_variance_groups: int
    rollout_s: float
    update_s: float = math.nan
    publish_s: float = math.nan
    new_version: int | None = None  # after this round's update (None: no update)
    calls_by_version: dict[str, int] = field(default_factory=dict)
    forks_by_cause: dict[str, int] = field(default_factory=dict)  # collector/report.py's causes
    note: str = ""


def demo_tasks(settings: DemoSettings, mini: Path) -> list[Task]:
    tasks = load_tasks(settings.tasks_file)
    if not 1 <= settings.tasks <= len(tasks):
        raise ForgeError(f"--tasks must be between 1 and {len(tasks)} (the tasks in {settings.tasks_file})")
    return with_harness_env(tasks[: settings.tasks], mini, settings.out, settings.harness_env)


def round_stats(
    number: int, version: int, run_id: str, episodes: pa.Table, calls_by_version: dict[str, int],
    results: list[RolloutResult], rollout_s: float,
) -> RoundStats:  # fmt: skip
    """The round's figures from the collector's episodes of its run (one group per task)."""
    mine = episodes.filter(pc.equal(episodes["run_id"], run_id)).to_pylist()
    complete = [e for e in mine if e["status"] == "complete"]
    rewards = [float(e["reward"]) for e in complete]
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    sd = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) if len(rewards) > 1 else 0.0
    groups: dict[str, list[float]] = {}
    for e in complete:
        groups.setdefault(e["group_id"], []).append(float(e["reward"]))
    follow_ups = sum(e["n_merged"] + e["n_forked"] for e in mine)
    return RoundStats(
        round=number, version=version, episodes=len(mine), complete=len(complete),
        failed_rollouts=sum(not r.ok for r in results), calls=sum(e["n_calls"] for e in mine),
        trainable_tokens=sum(e["n_trainable"] for e in complete),
        fork_rate=sum(e["n_forked"] for e in mine) / follow_ups if follow_ups else 0.0,
        reward_mean=mean, reward_sd=sd, groups=len(groups),
        zero_variance_groups=sum(1 for g in groups.values() if len(g) > 1 and max(g) == min(g)),
        rollout_s=rollout_s, calls_by_version=calls_by_version,
    )  # fmt: skip


def forks_by_cause(store: str, s3_endpoint: str | None, run_id: str) -> dict[str, int]:
    """The round's forks by measured cause (``forge report``'s), from the store."""
    from collector.report import fork_causes
    from collector.sql import connect

    con = connect(store, s3_endpoint, episodes=True, idle_seconds=0.0)
    causes = [f["cause"] for f in fork_causes(con) if f["run_id"] == run_id]
    return {cause: causes.count(cause) for cause in sorted(set(causes))}


def calls_by_version(store: str, s3_endpoint: str | None, run_id: str) -> dict[str, int]:
    """How many of the round's recorded calls each policy version served (from the records, not our own count)."""
    from collector.sql import connect

    con = connect(store, s3_endpoint, run=run_id)
    rows = con.execute("SELECT coalesce(policy_version, '?'), count(*) FROM calls GROUP BY 1 ORDER BY 1").fetchall()
    return {str(v): int(n) for v, n in rows}


TABLE_COLUMNS = [
    ("round", "round"), ("policy version", "version"), ("episodes", "episodes"), ("calls", "calls"),
    ("trainable tokens", "trainable_tokens"), ("fork rate", "fork_rate"), ("forks by cause", "forks_by_cause"),
    ("reward mean ± sd", "reward"),
    ("zero-var groups", "zero_variance_groups"), ("rollout s", "rollout_s"), ("update s", "update_s"),
    ("publish s", "publish_s"),
]  # fmt: skip


def summary_table(rounds: list[RoundStats]) -> str:
    def cell(stats: RoundStats, key: str) -> str:
        if key == "reward":
            return "-" if math.isnan(stats.reward_mean) else f"{stats.reward_mean:.3f} ± {stats.reward_sd:.3f}"
        if key == "episodes":
            return f"{stats.complete}/{stats.episodes}"
        if key == "zero_variance_groups":
            return f"{stats.zero_variance_groups}/{stats.groups}"
        if key == "forks_by_cause":
            return ", ".join(f"{n} {cause}" for cause, n in stats.forks_by_cause.items()) or "-"
        if key == "version":
            return f"v{stats.version}" + (f" → v{stats.new_version}" if stats.new_version is not None else "")
        value = getattr(stats, key)
        if isinstance(value, float):
            return "-" if math.isnan(value) else (f"{value:.2f}" if key == "fork_rate" else f"{value:.1f}")
        return str(value)

    rows = [[title for title, _ in TABLE_COLUMNS]] + [[cell(s, key) for _, key in TABLE_COLUMNS] for s in rounds]
    widths = [max(len(row[i]) for row in rows) for i in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def heldout_figures(path: Path) -> dict[str, float]:
    """An evaluation's overall mean reward with its 95 % t-interval (n samples), for the plot and summary.json."""
    from forge.evaluation import report

    rewards = [r for task in report.read(path).tasks for r in task.rewards]
    n = len(rewards)
    mean = statistics.fmean(rewards) if n else math.nan
    half = ci95(mean, statistics.stdev(rewards) if n > 1 else 0.0, n)
    return {"n": n, "mean_reward": mean, "ci95_low": mean - half, "ci95_high": mean + half}


def ci95(mean: float, sd: float, n: int) -> float:
    """Half-width of the 95 % t-interval of a mean of n samples (nan below 2)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n) if n > 1 else math.nan


def plot_rounds(
    rounds: list[RoundStats], path: Path, title: str, heldout: list[tuple[int, dict[str, float]]] | None = None
) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s.round for s in rounds]
    figure, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    means = [s.reward_mean for s in rounds]
    half = [ci95(s.reward_mean, s.reward_sd, s.complete) for s in rounds]
    axes[0].plot(x, means, marker="o")
    axes[0].fill_between(x, [m - h for m, h in zip(means, half, strict=True)],
                         [m + h for m, h in zip(means, half, strict=True)], alpha=0.25)  # fmt: skip
    axes[0].set_title("training reward per round (mean, 95% CI)")
    heldout = heldout or []
    labels = [f"v{v}" for v, _ in heldout]
    values = [f["mean_reward"] for _, f in heldout]
    errors = [
        [f["mean_reward"] - f["ci95_low"] for _, f in heldout],
        [f["ci95_high"] - f["mean_reward"] for _, f in heldout],
    ]
    axes[1].bar(
        labels, values, yerr=errors if heldout else None, capsize=5, color=["#999999", "#2b7bba"][: len(heldout)]
    )
    axes[1].set_title("held-out mean reward (95% CI)" if heldout else "held-out: not evaluated")
    axes[1].set_ylim(0, 1)
    axes[2].bar(x, [s.zero_variance_groups for s in rounds], label="zero-variance groups")
    axes[2].set_ylim(0, max(1, max(s.groups for s in rounds)))
    axes[2].set_title("groups with equal rewards (bars); fork rate (line)")
    forks = axes[2].twinx()
    forks.plot(x, [s.fork_rate for s in rounds], "k--", marker=".")
    forks.set_ylim(0, 1.05)
    forks.set_ylabel("fork rate")
    axes[3].bar([i - 0.2 for i in x], [s.rollout_s for s in rounds], 0.4, label="rollouts")
    axes[3].bar([i + 0.2 for i in x], [0 if math.isnan(s.update_s) else s.update_s + s.publish_s for s in rounds],
                0.4, label="update + publish")  # fmt: skip
    axes[3].set_title("seconds per round")
    axes[3].legend(fontsize=8)
    for ax in (axes[0], axes[2], axes[3]):
        ax.set_xlabel("round")
        ax.set_xticks(x)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


class Demo:
    def __init__(self, settings: DemoSettings, echo=print) -> None:
        self.settings = settings
        self.echo = echo
        self.rounds: list[RoundStats] = []
        self.files: dict[str, Path] = {}
        self.heldout: list[tuple[int, Path]] = []  # (version, its eval.json): v0, then the last version
        self.verdict = ""
        self.started = 0.0  # set when run() begins: the wall time counts from there

    def run(self) -> list[RoundStats]:
        from trainer.serve import PolicyServer, default_checkpoint, free_port

        s = self.settings
        s.out.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        if s.store is None:
            Path(s.store_uri).mkdir(exist_ok=True)
        mini = find_harness(s.harness)
        tasks = demo_tasks(s, mini)
        self.echo(f"forge demo: run {s.run}: {len(tasks)} tasks × {s.rollouts} rollouts × {s.rounds} rounds through "
                  f"mini-swe-agent ({mini}); store {s.store_uri}; everything in {s.out}")  # fmt: skip
        server = None
        if s.policy_url is None:
            self.echo("forge demo: starting the policy server (vLLM) ...")
            server = PolicyServer(model=default_checkpoint(), port=free_port(), run_dir=s.out / "policy-server")
            server.start()
            policy_url = server.base_url
        else:
            policy_url = s.policy_url.rstrip("/").removesuffix("/v1")
        trainer = None
        try:
            trainer = self._trainer(policy_url)
            if s.heldout_samples:
                self.evaluate(trainer, policy_url, mini)
            self._rounds(trainer, tasks, policy_url)
            if s.heldout_samples and trainer.state.version == self.heldout[0][0]:
                self.verdict = f"no update was published: the policy is still v{trainer.state.version} (no verdict)"
            elif s.heldout_samples:
                self.evaluate(trainer, policy_url, mini)
                self.compare()
        finally:
            if trainer is not None:
                trainer.close()  # its load folder (full weights on /dev/shm), its Ray workers
            if server is not None:
                server.stop()
            self.finish(time.monotonic() - self.started)  # what was done, also when a later part failed
        return self.rounds

    def _trainer(self, policy_url: str):  # -> trainer.loop.Trainer (imported late: torch, veRL)
        from trainer.loop import Trainer, TrainSettings

        s = self.settings
        return Trainer(
            TrainSettings(
                store=s.store_uri, policy_url=policy_url, run=s.run, mode="sync", steps=s.rounds,
                episodes_per_step=1, lora_rank=s.lora_rank, algo=s.algo, lr=s.lr, s3_endpoint=s.s3_endpoint,
                state_dir=s.out / "trainer", wait_timeout=60.0, poll_seconds=0.5,
                idle_seconds=0.0,  # a round's rollouts have all ended before it is collected: no reward = none
                # Memory on a laptop-sized machine: micro-batches of ~1k tokens (logits are tokens × 49k vocabulary
                # in fp32) and recomputed activations keep the update at ~5 GB (16k-token micro-batches: 13 GB).
                max_token_len=1024, gradient_checkpointing=True, epochs=s.epochs, seed=s.seed,
            ),
            echo=self.echo,
        )  # fmt: skip

    def evaluate(self, trainer, policy_url: str, mini: Path) -> None:
        """`forge eval` of the policy as it is now on the held-out tasks (run eval-<run>-v<version>)."""
        from forge.evaluation.run import EvalSettings, evaluate

        s = self.settings
        version = trainer.state.version
        self.echo(f"forge demo: held-out evaluation of v{version}: {s.heldout_samples} samples of each task in "
                  f"{s.heldout_file.name}")  # fmt: skip
        # A folder name nothing could guess before it exists (the rollouts' own processes are killed as each ends).
        out = Path(tempfile.mkdtemp(prefix=f"heldout-v{version}-", dir=s.out))
        evaluate(
            EvalSettings(
                tasks_file=s.heldout_file, samples=s.heldout_samples, out=out, ks=[1, min(3, s.heldout_samples)],
                run=f"eval-{s.run}-v{version}", policy_url=policy_url, policy_model=trainer.policy_name,
                store=s.store_uri, s3_endpoint=s.s3_endpoint, concurrency=s.concurrency, harness=mini,
                progress=s.progress,
            ),
            echo=self.echo,
        )  # fmt: skip
        self.heldout.append((version, out / "eval.json"))

    def compare(self) -> None:
        """The held-out verdict: the last version against v0, one-sided tests named, whatever they say."""
        from forge.evaluation import compare, report

        (v_before, before), (v_after, after) = self.heldout[0], self.heldout[-1]
        comparison = compare.compare(report.read(before), report.read(after))
        self.verdict = f"v{v_before} → v{v_after}: " + compare.verdict(comparison, "held-out")
        self.files["heldout"] = self.settings.out / "heldout.txt"
        self.files["heldout"].write_text(compare.render(comparison) + "\n")
        self.echo(f"forge demo: {self.verdict}")

    def _rounds(self, trainer, tasks: list[Task], policy_url: str) -> None:
        from trainer.batch import counted
        from trainer.loop import NothingReady

        s = self.settings
        metrics_file = s.out / "metrics.jsonl"
        for number in range(1, s.rounds + 1):
            version, run_id = trainer.state.version, f"{s.run}-r{number}"
            self.echo(f"forge demo: round {number}/{s.rounds}: rollouts on policy v{version} (run id {run_id})")
            t0 = time.monotonic()
            results = run_local(
                tasks, s.rollouts, run_id, s.out / "rollouts", s.store_uri, policy_url, concurrency=s.concurrency,
                retries=0, s3_endpoint=s.s3_endpoint, progress=s.progress, harness_must_succeed=True,
                policy_model=trainer.policy_name,
            )  # fmt: skip
            rollout_s = time.monotonic() - t0
            collection = trainer.collector.update()
            stats = round_stats(number, version, run_id, collection.episodes,
                                calls_by_version(s.store_uri, s.s3_endpoint, run_id), results, rollout_s)  # fmt: skip
            stats.forks_by_cause = forks_by_cause(s.store_uri, s.s3_endpoint, run_id)
            for failed in (r for r in results if not r.ok):
                self.echo(f"forge demo:   rollout {failed.rollout.episode_id} failed, no reward: "
                          f"{'; '.join(failed.reasons)}")  # fmt: skip
            if stats.zero_variance_groups == stats.groups:
                stats.note = "every group's rewards are equal: GRPO has nothing to learn from this round"
            try:
                metrics = trainer.step(every_ready=True)
            except NothingReady as error:
                stats.note = f"no update this round: {error}"
                self.echo(f"forge demo:   {stats.note}")
            else:
                with metrics_file.open("a") as out:
                    out.write(json.dumps({"round": number, **metrics}, default=str) + "\n")
                stats.update_s, stats.publish_s = metrics["update_s"], metrics["publish_s"]
                stats.new_version = trainer.state.version
                left_out = counted(metrics["skipped_segments"])
                self.echo(f"forge demo:   update on {metrics['episodes']} episodes ({metrics['segments']} segments; "
                          f"left out: {left_out or 'none'}), {s.epochs} optimizer step(s): {metrics['update_s']:.1f} "
                          f"s; v{stats.new_version} published and verified in {metrics['publish_s']:.2f} s (probe "
                          f"difference {metrics['probe_diff']:.1e})")  # fmt: skip
            self.rounds.append(stats)
            self.echo(summary_table(self.rounds[-1:]).splitlines()[-1])
            self.save(time.monotonic() - self.started)  # a run stopped later keeps the rounds it finished
        self.files["metrics"] = metrics_file

    def save(self, wall_s: float) -> str:
        """summary.json, summary.txt and the plot of the rounds so far."""
        s = self.settings
        table = summary_table(self.rounds)
        plot = s.out / "rounds.png"
        update = f"LoRA r={s.lora_rank}" if s.lora_rank else "full weights"
        heldout = [(version, heldout_figures(path)) for version, path in self.heldout]
        plot_rounds(self.rounds, plot, f"forge demo {s.run}: {s.tasks} tasks × {s.rollouts} rollouts, {update}",
                    heldout)  # fmt: skip
        self.files["plot"] = plot
        summary = s.out / "summary.json"
        rounds = [dataclasses.asdict(r) for r in self.rounds]
        evaluation = {"file": str(s.heldout_file), "samples_per_task": s.heldout_samples, "verdict": self.verdict,
                      "versions": {f"v{v}": figures for v, figures in heldout}}  # fmt: skip
        summary.write_text(json.dumps({"run": s.run, "wall_s": wall_s, "seed": s.seed, "lr": s.lr, "epochs": s.epochs,
                                       "rounds": rounds, "heldout": evaluation}, indent=1))  # fmt: skip
        self.files["summary"] = summary
        (s.out / "summary.txt").write_text(table + "\n")
        return table

    def finish(self, wall_s: float) -> None:
        s = self.settings
        if not self.rounds:  # stopped before a round ended: nothing to sum up
            return
        table = self.save(wall_s)
        page = self.episode_page()
        if page:
            self.files["episode"] = page
        self.echo("")
        self.echo(table)
        for stats in self.rounds:
            if stats.note:
                self.echo(f"round {stats.round}: {stats.note}")
        if self.verdict:
            self.echo(f"\n{self.verdict}")
        import resource

        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        self.echo(f"\nforge demo: {len(self.rounds)} rounds in {wall_s / 60:.1f} min (peak memory of this process "
                  f"{peak_gb:.1f} GB, the policy server's apart). Files:")  # fmt: skip
        for name, path in {"store": Path(s.store_uri), **self.files, "rollouts": s.out / "rollouts"}.items():
            self.echo(f"  {name:9} {path}")
        self.echo(f"Query it: forge sql --store {s.store_uri} \"SELECT episode_id, status, reward, n_calls FROM "
                  "episodes ORDER BY episode_id\"")  # fmt: skip

    def episode_page(self) -> Path | None:
        """The HTML page of the last round's best complete episode (the collector's viewer)."""
        from collector.sql import connect
        from collector.view import render_episode, tokenizer_decoder

        s = self.settings
        if not self.rounds:
            return None
        con = connect(s.store_uri, s.s3_endpoint, episodes=True, state_dir=None, idle_seconds=0.0)
        row = con.execute(
            "SELECT episode_id FROM episodes WHERE run_id = ? AND status = 'complete' "
            "ORDER BY reward DESC, n_calls DESC, episode_id LIMIT 1", [f"{s.run}-r{self.rounds[-1].round}"]
        ).fetchone()  # fmt: skip
        if row is None:
            return None
        path = s.out / f"episode-{row[0]}.html"
        path.write_text(render_episode(con, row[0], tokenizer_decoder()), encoding="utf-8")
        return path
