"""How long the policy server (vLLM CPU build, SmolLM2-135M, eager; fp32 on CPUs without native bf16) takes to
answer, and a first call.

Run: .venv/bin/python bench/policy_server_startup.py [--runs 3]
"""

import statistics
import time

import click
import httpx

from trainer.serve import PolicyServer, default_checkpoint, free_port


@click.command()
@click.option("--runs", type=int, default=3, show_default=True)
def main(runs: int) -> None:
    ready_s, first_call_s = [], []
    for _ in range(runs):
        server = PolicyServer(model=default_checkpoint(), port=free_port())
        started = time.monotonic()
        with server:
            ready_s.append(time.monotonic() - started)
            started = time.monotonic()
            httpx.post(f"{server.openai_url}/chat/completions", timeout=60, json={
                "model": server.name, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello"}],
            }).raise_for_status()  # fmt: skip
            first_call_s.append(time.monotonic() - started)
    click.echo(
        f"vLLM ready: median {statistics.median(ready_s):.1f} s (runs: {', '.join(f'{s:.1f}' for s in ready_s)})"
    )
    click.echo(f"first 16-token chat call: median {statistics.median(first_call_s):.2f} s")


if __name__ == "__main__":
    main()
