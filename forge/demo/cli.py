"""`forge demo`: run the whole loop on the embedded default and print what happened, round by round."""

import time
from pathlib import Path

import click

from forge.console import echo, libraries_to
from forge.errors import ForgeError


@click.command("demo", short_help="Train the embedded policy in a real harness.")
@click.option("--tasks", "n_tasks", type=int, default=8, show_default=True,
              help="How many of the shipped training tasks (forge/demo/tasks/tasks.jsonl) to run.")  # fmt: skip
@click.option("--tasks-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Training tasks (forge demo's JSONL format) [default: forge/demo/tasks/tasks.jsonl].")  # fmt: skip
@click.option("--heldout-file", type=click.Path(dir_okay=False, exists=True, path_type=Path),
              help="Held-out tasks, never trained on [default: forge/demo/tasks/heldout.jsonl].")  # fmt: skip
@click.option("--rollouts", type=int, default=4, show_default=True, help="Rollouts per task per round (GRPO's G).")
@click.option("--rounds", type=int, default=3, show_default=True, help="Rounds: rollouts, then one update each.")
@click.option("--store", help="Where calls and rewards go: a folder or s3://bucket/prefix [default: OUT/store].")
@click.option("--s3-endpoint", help="S3-compatible endpoint for an s3:// store.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="This run's folder [default: forge-demo/<run>].")  # fmt: skip
@click.option("--run", "run_name", help="Run name [default: demo-<time>].")
@click.option("--concurrency", type=int, default=4, show_default=True, help="Rollouts running at once.")
@click.option("--lora-rank", type=int, default=8, show_default=True, help="LoRA rank of the update; 0: full weights.")
@click.option("--lr", type=float, help="Learning rate [default: 1e-3 with LoRA, 1e-5 for full weights].")
@click.option("--algo", default="grpo", show_default=True, help="veRL advantage estimator (grpo, rloo, ...).")
@click.option("--epochs", type=int, default=4, show_default=True,
              help="Optimizer steps per round over its rollouts (veRL's ppo_epochs; PPO's clip bounds the rest)."
              )  # fmt: skip
@click.option("--seed", type=int, default=1, show_default=True, help="The trainer's seed (LoRA's initial weights).")
@click.option("--heldout-samples", type=int, default=8, show_default=True,
              help="Samples of each held-out task (forge/demo/tasks/heldout.jsonl, never trained on), evaluated on v0 "
                   "and on the last version; the demo ends with their difference and one-sided tests. 0: none."
              )  # fmt: skip
@click.option("--harness", type=click.Path(dir_okay=False, path_type=Path),
              help="mini-swe-agent's `mini` [default: scripts/harness.sh mini-swe-agent installs it].")  # fmt: skip
@click.option("--policy-url", help="Use this running policy server (forge serve) instead of starting one.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def demo_command(
    n_tasks: int, tasks_file: Path | None, heldout_file: Path | None, rollouts: int, rounds: int, store: str | None,
    s3_endpoint: str | None, out: Path | None, run_name: str | None, concurrency: int, lora_rank: int,
    lr: float | None, algo: str, epochs: int, seed: int, heldout_samples: int, harness: Path | None,
    policy_url: str | None, progress: bool,
) -> None:  # fmt: skip
    """Train the embedded policy (SmolLM2-135M on vLLM) inside a real, unmodified harness, round by round.

    The harness is mini-swe-agent. First the base policy (v0) is evaluated on the held-out tasks. Each round:
    TASKS × ROLLOUTS rollouts through the sidecar, rewards from each task's verifier, a veRL update (groups whose
    rewards are all equal left out, counted), the new version published and verified; the next round runs on it.
    At the end: the last version on the held-out tasks and the verdict (Welch's and Fisher's one-sided tests), a
    table per round, a PNG, the HTML of one episode, and where every file is.
    """
    from forge.demo.run import HELDOUT_FILE, TASKS_FILE, Demo, DemoSettings

    if rollouts < 1 or rounds < 1 or concurrency < 1 or epochs < 1 or lora_rank < 0 or heldout_samples < 0:
        raise ForgeError(
            "--rollouts, --rounds, --concurrency and --epochs must be ≥ 1, --lora-rank and --heldout-samples ≥ 0"
        )
    run = run_name or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    settings = DemoSettings(
        out=(out or Path("forge-demo") / run).absolute(), run=run, store=store, s3_endpoint=s3_endpoint,
        tasks=n_tasks, rollouts=rollouts, rounds=rounds, concurrency=concurrency, lora_rank=lora_rank,
        lr=lr if lr is not None else (1e-3 if lora_rank else 1e-5), algo=algo, harness=harness,
        policy_url=policy_url, progress=progress, epochs=epochs, seed=seed, heldout_samples=heldout_samples,
        tasks_file=tasks_file or TASKS_FILE, heldout_file=heldout_file or HELDOUT_FILE,
    )  # fmt: skip
    settings.out.mkdir(parents=True, exist_ok=True)
    log = settings.out / "demo.log"
    click.echo(f"forge demo: the libraries' messages (veRL, torch, Ray, transformers) go to {log}")
    with libraries_to(log):
        Demo(settings, echo=echo).run()


commands: list[click.Command] = [demo_command]
