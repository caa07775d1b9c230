"""`forge demo`: run the whole loop on the embedded default and print what happened, round by round."""

import time
from pathlib import Path

import click

from forge.errors import ForgeError


@click.command("demo")
@click.option("--tasks", "n_tasks", type=int, default=2, show_default=True,
              help="How many of the shipped tasks (forge/demo/tasks/tasks.jsonl) to run.")  # fmt: skip
@click.option("--rollouts", type=int, default=4, show_default=True, help="Rollouts per task per round (GRPO's G).")
@click.option("--rounds", type=int, default=3, show_default=True, help="Rounds: rollouts, then one update each.")
@click.option("--store", help="Where calls and rewards go: a folder or s3://bucket/prefix [default: OUT/store].")
@click.option("--s3-endpoint", help="S3-compatible endpoint for an s3:// store.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="This run's folder [default: forge-demo/<run>].")  # fmt: skip
@click.option("--run", "run_name", help="Run name [default: demo-<time>].")
@click.option("--concurrency", type=int, default=4, show_default=True, help="Rollouts running at once.")
@click.option("--lora-rank", type=int, default=8, show_default=True, help="LoRA rank of the update; 0: full weights.")
@click.option("--lr", type=float, help="Learning rate [default: 2e-4 with LoRA, 1e-5 for full weights].")
@click.option("--algo", default="grpo", show_default=True, help="veRL advantage estimator (grpo, rloo, ...).")
@click.option("--harness", type=click.Path(dir_okay=False, path_type=Path),
              help="mini-swe-agent's `mini` [default: scripts/harness.sh mini-swe-agent installs it].")  # fmt: skip
@click.option("--policy-url", help="Use this running policy server (forge serve) instead of starting one.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def demo_command(
    n_tasks: int, rollouts: int, rounds: int, store: str | None, s3_endpoint: str | None, out: Path | None,
    run_name: str | None, concurrency: int, lora_rank: int, lr: float | None, algo: str, harness: Path | None,
    policy_url: str | None, progress: bool,
) -> None:  # fmt: skip
    """Train the embedded policy (SmolLM2-135M on vLLM) inside a real, unmodified harness, round by round.

    The harness is mini-swe-agent. Each round: TASKS × ROLLOUTS rollouts through the sidecar, rewards from each
    task's verifier, one veRL update, the new version published and verified; the next round runs on it. At the
    end: a table per round, a PNG, the HTML of one episode, and where every file is.
    """
    from forge.demo.run import Demo, DemoSettings

    if rollouts < 1 or rounds < 1 or concurrency < 1 or lora_rank < 0:
        raise ForgeError("--rollouts, --rounds and --concurrency must be ≥ 1, --lora-rank ≥ 0")
    run = run_name or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    settings = DemoSettings(
        out=(out or Path("forge-demo") / run).absolute(), run=run, store=store, s3_endpoint=s3_endpoint,
        tasks=n_tasks, rollouts=rollouts, rounds=rounds, concurrency=concurrency, lora_rank=lora_rank,
        lr=lr if lr is not None else (2e-4 if lora_rank else 1e-5), algo=algo, harness=harness,
        policy_url=policy_url, progress=progress,
    )  # fmt: skip
    Demo(settings, echo=click.echo).run()


commands: list[click.Command] = [demo_command]
