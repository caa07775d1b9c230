"""Added latency of the sidecar per wire API and stream mode, against the real vLLM, compared with the chat path.

For each API × stream mode, calls alternate between vLLM directly and the sidecar in front of it (same body,
greedy, a few tokens), so drift in the server's speed hits both; the figure is the median of the paired
differences. "Direct" for Messages is vLLM's own /v1/messages (its Anthropic layer); through the sidecar the
call is translated to /v1/chat/completions with ids and back. Streams: time to the first content event.

Run: .venv/bin/python bench/api_latency.py [--pairs 40] [--upstream http://127.0.0.1:8000]
(without --upstream it starts its own vLLM, ~45 s)
"""

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sidecar_latency import wait_port
from trainer.model import prepare
from trainer.serve import PolicyServer, default_checkpoint, free_port

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Say hi in three words."
TOKENS = 8


def bodies(model: str) -> dict[str, tuple[str, dict]]:
    return {
        "chat": ("/v1/chat/completions", {"model": model, "max_tokens": TOKENS, "temperature": 0,
                                          "messages": [{"role": "user", "content": QUESTION}]}),
        "responses": ("/v1/responses", {"model": model, "max_output_tokens": TOKENS, "temperature": 0,
                                        "input": QUESTION}),
        "messages": ("/v1/messages", {"model": model, "max_tokens": TOKENS, "temperature": 0,
                                      "messages": [{"role": "user", "content": QUESTION}]}),
    }  # fmt: skip


def timed_call(client: httpx.Client, url: str, body: dict, stream: bool) -> float:
    """Seconds to the whole answer, or (stream) to the first content event."""
    start = time.perf_counter()
    if not stream:
        answer = client.post(url, json=body)
        answer.raise_for_status()
        return time.perf_counter() - start
    with client.stream("POST", url, json={**body, "stream": True}) as answer:
        answer.raise_for_status()
        first = None
        for line in answer.iter_lines():
            if (
                first is None
                and line.startswith("data:")
                and any(key in line for key in ('"content":"', '"delta":"', '"text_delta"'))
            ):
                first = time.perf_counter() - start
        return first if first is not None else time.perf_counter() - start


def paired(pairs: int, direct: Callable[[], float], through: Callable[[], float]) -> tuple[float, float, float]:
    gaps, bases = [], []
    for i in range(pairs):
        if i % 2:
            a, b = direct(), through()
        else:
            b, a = through(), direct()
        gaps.append((b - a) * 1000)
        bases.append(a * 1000)
    q1, _, q3 = statistics.quantiles(gaps, n=4)
    return statistics.median(bases), statistics.median(gaps), q3 - q1


@click.command()
@click.option("--pairs", type=int, default=40, show_default=True)
@click.option("--upstream", help="A running vLLM (forge serve); default: start one.")
def main(pairs: int, upstream: str | None) -> None:
    server = None
    if upstream is None:
        prepare(log=lambda *_: None)
        server = PolicyServer(model=default_checkpoint(), port=free_port(),
                              run_dir=Path(tempfile.mkdtemp(prefix="forge-bench-vllm-")))  # fmt: skip
        server.start()
        upstream = server.base_url.removesuffix("/v1")
    work = Path(tempfile.mkdtemp(prefix="forge-bench-api-"))
    port = free_port()
    sidecar = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "forge"), "sidecar", "--mode", f"reverse:{upstream}", "--upstream", upstream,
         "--listen-port", str(port), "--store", str(work / "store"), "--wal-dir", str(work / "wal"),
         "--episode-id", "bench"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_port(port)
        with httpx.Client(timeout=120) as client:
            model = client.get(f"{upstream}/v1/models").json()["data"][0]["id"]
            rows = []
            for api, (path, body) in bodies(model).items():
                for stream in (False, True):
                    timed_call(client, f"http://127.0.0.1:{port}{path}", body, stream)  # warm both paths
                    timed_call(client, f"{upstream}{path}", body, stream)
                    direct_url, sidecar_url = f"{upstream}{path}", f"http://127.0.0.1:{port}{path}"
                    base, added, iqr = paired(
                        pairs,
                        partial(timed_call, client, direct_url, body, stream),
                        partial(timed_call, client, sidecar_url, body, stream),
                    )
                    rows.append((api, stream, base, added, iqr))
    finally:
        sidecar.terminate()
        sidecar.wait(30)
        if server:
            server.stop()
    chat = {stream: added for api, stream, _, added, _ in rows if api == "chat"}
    click.echo(f"{pairs} pairs per row, {TOKENS} tokens, greedy; real vLLM at {upstream}")
    click.echo(f"{'api':10} {'mode':7} {'direct ms':>10} {'added ms':>9} {'IQR':>6} {'vs chat':>8}")
    for api, stream, base, added, iqr in rows:
        click.echo(f"{api:10} {'stream' if stream else 'whole':7} {base:10.1f} {added:+9.2f} {iqr:6.2f} "
                   f"{added - chat[stream]:+8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
