"""Prefill time of the policy server per serving dtype: why `forge serve` defaults to fp32 on CPUs without native
bf16 (vLLM's CPU build emulates bf16 there).

For each dtype it starts its own server (eager, 16k context, the prepared checkpoint of that dtype) and times one
`/v1/completions` call per prompt: random token ids (no prefix cache hit) and a repetitive 9.4k-token prompt (the
policy-server test's). Run: .venv/bin/python bench/prefill_dtype.py [--dtypes float32,bfloat16] [--tokens 4600]
"""

import random
import sys
import tempfile
import time
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.serve import PolicyServer, default_checkpoint, free_port


def timed_completion(client: httpx.Client, model: str, prompt: list[int]) -> float:
    started = time.monotonic()
    client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
    }).raise_for_status()  # fmt: skip
    return time.monotonic() - started


@click.command()
@click.option("--dtypes", default="float32,bfloat16", show_default=True)
@click.option("--tokens", type=int, default=4600, show_default=True, help="Length of the random prompt.")
@click.option("--seed", type=int, default=0, show_default=True)
def main(dtypes: str, tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    prompts = {
        f"random {tokens}": [rng.randrange(100, 40000) for _ in range(tokens)],
        "repetitive 9401": [1] + [253, 5356] * 4700,
    }
    for dtype in dtypes.split(","):
        server = PolicyServer(model=default_checkpoint(dtype), dtype=dtype, port=free_port(), max_model_len=16384,
                              run_dir=Path(tempfile.mkdtemp(prefix=f"forge-bench-{dtype}-")))  # fmt: skip
        with server, httpx.Client(base_url=server.base_url, timeout=1800) as client:
            for name, prompt in prompts.items():
                click.echo(f"{dtype}: prefill {name} tokens: {timed_completion(client, server.name, prompt):.1f} s")


if __name__ == "__main__":
    main()
