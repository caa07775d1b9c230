"""`forge eval` (measure a policy on a task file) and `forge eval compare A.json B.json` (is B better than A?)."""

from pathlib import Path

import click

from forge.errors import ForgeError


@click.group(
    "eval",
    invoke_without_command=True,
    subcommand_metavar="[compare A.json B.json]",
    short_help="Evaluate a policy: pass@k and pass^k.",
)
@click.option("--tasks", "tasks_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Task file (JSONL, `forge demo`'s format: forge/demo/tasks/tasks.jsonl). [required]")  # fmt: skip
@click.option("--samples", type=int, help="Rollouts per task (n). [required]")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Folder for eval.json, the rollouts and (by default) the store. [required]")  # fmt: skip
@click.option("--k", "k_text", help="The k of pass@k and pass^k, comma-separated [default: 1,3, those ≤ --samples].")
@click.option("--policy-url", help="A running policy server (forge serve) [default: start one here].")
@click.option("--checkpoint", type=click.Path(file_okay=False, path_type=Path),
              help="Serve this checkpoint (an HF folder, or a trainer's LoRA adapter on its base) [default: the "
                   "embedded base model].")  # fmt: skip
@click.option("--policy-model", help="The policy's served model name, which the sidecar sends every call to "
                                     "[default: the server's first model].")  # fmt: skip
@click.option("--store", help="Where calls and rewards go: a folder or s3://bucket/prefix [default: OUT/store].")
@click.option("--s3-endpoint", help="S3-compatible endpoint for an s3:// store.")
@click.option("--run", "run_name", help="Run id; `eval-` is put in front when missing [default: eval-<time>].")
@click.option("--concurrency", type=int, default=4, show_default=True, help="Rollouts running at once.")
@click.option("--retries", type=int, default=1, show_default=True,
              help="More attempts for a rollout that got no reward at all (its verifier could not run).")  # fmt: skip
@click.option("--harness", type=click.Path(dir_okay=False, path_type=Path),
              help="mini-swe-agent's `mini`, given to tasks as $FORGE_DEMO_MINI [default: installed by "
                   "scripts/harness.sh when a task uses it].")  # fmt: skip
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.pass_context
def eval_group(
    ctx: click.Context, tasks_file: Path | None, samples: int | None, out: Path | None, k_text: str | None,
    policy_url: str | None, checkpoint: Path | None, policy_model: str | None, store: str | None,
    s3_endpoint: str | None, run_name: str | None, concurrency: int, retries: int, harness: Path | None,
    progress: bool,
) -> None:  # fmt: skip
    """Evaluate a policy without training it: pass@1, pass@k and pass^k per task and overall.

    Runs each task of --tasks --samples times through its harness on the policy (behind the sidecar, as `forge
    demo` does), posts each verifier's reward to the store, reads the rewards back from the store (the collector's
    DuckDB views) and prints per task and overall: n, successes c, mean reward, pass@1, pass@k = 1 − C(n−c,k)/C(n,k)
    (one of k samples succeeds) and pass^k = C(c,k)/C(n,k) (all k do). A sample succeeds when its reward is at least
    its task's success_threshold (default 1.0). Writes OUT/eval.json with the figures and every sample's reward.

    The run id starts with eval-: no trainer ever learns from these episodes. `forge eval compare A.json B.json`
    tests whether B is better than A.
    """
    from forge.evaluation.run import EvalSettings, evaluate, evaluation_run_id, parse_ks

    if ctx.invoked_subcommand is not None:
        return
    if tasks_file is None or samples is None or out is None:
        missing = [
            name for name, value in (("--tasks", tasks_file), ("--samples", samples), ("--out", out)) if value is None
        ]
        raise ForgeError(f"forge eval needs {', '.join(missing)} (see forge eval --help)")
    ks = parse_ks(k_text) if k_text else [k for k in (1, 3) if k <= samples] or [1]
    settings = EvalSettings(
        tasks_file=tasks_file, samples=samples, out=out.absolute(), ks=ks, run=evaluation_run_id(run_name),
        policy_url=policy_url, checkpoint=checkpoint, policy_model=policy_model, store=store,
        s3_endpoint=s3_endpoint, concurrency=concurrency, retries=retries, harness=harness, progress=progress,
    )  # fmt: skip
    evaluate(settings, echo=click.echo)


@eval_group.command("compare", short_help="Is B better than A? Two evaluations compared.")
@click.argument("a", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(dir_okay=False, path_type=Path))
def compare_command(a: Path, b: Path) -> None:
    """Compare two `forge eval` results: is B (e.g. the trained policy) better than A (e.g. the base)?

    Prints per task and overall both sides' n, mean reward and successes, the differences (B − A, also of pass@k
    and pass^k for the k both report), and two one-sided tests, each with its p-value:

    Welch's t-test on the per-sample rewards (H1: B's mean reward > A's): rewards may carry partial credit, so the
    mean is the main figure, and Welch assumes neither equal variances nor equal n on the two sides.

    Fisher's exact test on the success counts (H1: B's odds of success > A's): exact at the small counts a CPU
    evaluation has, where a normal approximation is not.

    One-sided because the question is whether B improved; a small p says the improvement is unlikely by chance.
    "all" pools the samples of the tasks both files hold.
    """
    from forge.evaluation import compare, report

    click.echo(compare.render(compare.compare(report.read(a), report.read(b))))


commands: list[click.Command] = [eval_group]
