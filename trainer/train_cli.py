"""`forge train`: learn from the store's episodes with veRL and publish each version to the policy server."""

import json
from pathlib import Path

import click

from forge.errors import ForgeError


@click.group("train", invoke_without_command=True, short_help="Train the policy on complete episodes.")
@click.option("--store", help="The store: a folder or s3://bucket/prefix (the sidecars' records).")
@click.option(
    "--policy-url",
    help="The vLLM policy replicas, each published to: http://127.0.0.1:8000, a comma-separated list, or "
    "dns+http://NAME:PORT (every address of NAME: a headless Service, as the sidecars' --upstream).",
)
@click.option("--run", default="default", show_default=True, help="Run name: checkpoints/<run>/v<n>/ in the store.")
@click.option("--mode", type=click.Choice(["sync", "async"]), default="sync", show_default=True)
@click.option("--steps", type=int, default=1, show_default=True)
@click.option("--episodes-per-step", type=int, default=8, show_default=True)
@click.option("--staleness", type=int, default=0, show_default=True, help="async: train on episodes ≤ K versions old.")
@click.option("--lora-rank", type=int, default=0, show_default=True, help="0: full weights.")
@click.option("--algo", default="grpo", show_default=True, help="veRL advantage estimator (grpo, rloo, ...).")
@click.option(
    "--loss", "loss_mode", default="vanilla", show_default=True, help="veRL policy loss (vanilla = PPO-clip)."
)
@click.option("--lr", type=float, default=1e-5, show_default=True)
@click.option(
    "--epochs", type=int, default=1, show_default=True,
    help="Optimizer steps over each step's batch (veRL's ppo_epochs; PPO's clip bounds the later ones).",
)  # fmt: skip
@click.option(
    "--prefix-packing/--no-prefix-packing", default=True, show_default=True,
    help="Compute the token prefix that rows share (a task's prompt, an episode before a fork) once per micro-batch.",
)  # fmt: skip
@click.option("--seed", type=int, default=1, show_default=True, help="The engine's seed (LoRA's initial weights).")
@click.option(
    "--correction", type=click.Choice(["bypass", "decoupled"]), default="bypass", show_default=True,
    help="bypass: PPO's ratio against the behaviour logprobs; decoupled: veRL's rollout IS weights.",
)  # fmt: skip
@click.option("--rollout-is", type=click.Choice(["token", "sequence"]), default="token", show_default=True)
@click.option("--wait-timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for episodes.")
@click.option("--resume", is_flag=True, help="Continue the run from its last committed step.")
@click.option(
    "--workers", type=int, default=1, show_default=True,
    help="FSDP ranks: 1 in this process; W > 1 as a Ray worker group (a local Ray, or RAY_ADDRESS's cluster).",
)  # fmt: skip
@click.option(
    "--workers-per-node", type=int, default=0, help="Ranks per node on a Ray cluster (default: all on one node)."
)
@click.option(
    "--kl-coef", type=float, default=0.0, show_default=True,
    help="KL loss to the reference (the base weights; with LoRA the adapter disabled); 0: none.",
)  # fmt: skip
@click.option("--kl-type", default="low_var_kl", show_default=True, help="veRL kl_penalty: kl, abs, mse, low_var_kl.")
@click.option(
    "--model", "model_dir", type=click.Path(path_type=Path), help="Base HF checkpoint (default: prepared fp32)."
)
@click.option("--s3-endpoint", help="S3-compatible endpoint for an s3:// store.")
@click.option(
    "--load-dir", default="auto", show_default=True,
    help="Where full weights are written for the policy servers to load, beside the store's copy: auto (/dev/shm "
    "when every replica is on loopback), store (load the store's copy), or a folder the servers read.",
)  # fmt: skip
@click.pass_context
def train_group(ctx: click.Context, store: str | None, policy_url: str | None, workers: int, **options) -> None:
    """Train the policy on complete episodes; publish and verify every new version.

    sync: each step waits for --episodes-per-step complete episodes served by the current version, updates,
    publishes v+1. async: episodes up to --staleness versions old are used, with importance correction.
    Metrics are printed (and kept in the run's metrics.jsonl) as one JSON line per step.
    """
    if ctx.invoked_subcommand is not None:
        return
    if not store or not policy_url:
        raise ForgeError("forge train needs --store and --policy-url (see `forge train --help`)")
    from trainer.loop import Trainer, TrainSettings

    trainer = Trainer(TrainSettings(store=store, policy_url=policy_url, workers=workers, **options), echo=click.echo)
    try:
        trainer.run()
    finally:
        trainer.close()
    click.echo(f"forge train: {trainer.state.step} steps done; the server serves v{trainer.state.version}", err=True)


@train_group.command("plot", short_help="Plot a run's metrics as a PNG.")
@click.argument("metrics", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--out", type=click.Path(path_type=Path), help="PNG to write (default: beside METRICS).")
def plot_command(metrics: Path, out: Path | None) -> None:
    """Plot a run's metrics.jsonl (reward, KL, entropy, clip fraction, throughput, publish seconds) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except ValueError as error:
        raise ForgeError(f"{metrics} is not a metrics JSON-lines file: {error}") from error
    if not rows:
        raise ForgeError(f"{metrics} holds no steps yet")
    panels = [
        ("reward_mean", "reward mean"), ("kl_behaviour", "KL to behaviour"), ("entropy", "entropy"),
        ("clip_frac", "clip fraction"), ("tokens_per_s", "trained tokens/s"), ("publish_s", "publish s"),
    ]  # fmt: skip
    figure, axes = plt.subplots(2, 3, figsize=(12, 6))
    steps = [r.get("step", i + 1) for i, r in enumerate(rows)]
    for ax, (key, title) in zip(axes.flat, panels, strict=True):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o")
        ax.set_title(title)
        ax.set_xlabel("step")
    figure.tight_layout()
    target = out or metrics.with_suffix(".png")
    figure.savefig(target, dpi=100)
    click.echo(str(target))


commands: list[click.Command] = [train_group]
