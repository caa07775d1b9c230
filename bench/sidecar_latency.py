"""Added latency and throughput of the sidecar vs direct, bare mitmdump and rllm-model-gateway.

All over the same fast local upstream (bench/fake_upstream.py: a fixed vLLM-shaped answer), so the proxy is what
is measured. Non-streaming p50/p99 with 1 and 64 clients, streaming time to first token with 1 client, and
whether SSE is live (upstream chunks 0.3 s apart: when does the first reach the client?).

Run: .venv/bin/python bench/sidecar_latency.py [--calls 400] [--runs 3] [--rounds N] [--gateway-python PATH]
Each run prints its table and the sidecar's ratios to bare mitmdump's against the goals (issue 24: added p50 for one
client <= 1.1x, calls/s at 64 clients >= 0.9x); ``--runs 3`` then lists the three runs' ratios side by side.
``--rounds N`` measures the one-client p50 in N interleaved rounds (the targets take turns, all running): on a
shared VM the machine's speed drifts between one target's block and the next, a paired design cancels that.
(rllm-model-gateway lives in a bench-only env: python3.11 -m venv V && V/bin/pip install rllm-model-gateway)
"""

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import run
from trainer.serve import free_port

ROOT = Path(__file__).resolve().parent.parent
BODY = {"model": "m", "messages": [{"role": "user", "content": "Say hi in three words."}], "max_tokens": 8}


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing listens on {port} after {timeout} s")


def start(args: list[str], port: int, tree: Path | None = None) -> subprocess.Popen:
    """Start a target; ``tree``: the sidecar's code from that checkout (``--compare-tree``), with this one's envs."""
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tree)
    wait_port(port)
    time.sleep(0.5)
    return process


def measure(port: int, calls: int) -> dict[str, float]:
    one = asyncio.run(run(port, 1, calls, BODY)).summary()
    many = asyncio.run(run(port, 64, calls * 5, BODY)).summary()
    stream = asyncio.run(run(port, 1, calls // 2, {**BODY, "stream": True})).summary()
    live = asyncio.run(run(port, 1, 2, {**BODY, "stream": True}, {"x-fake": "slow"})).summary()
    return {
        "p50_1": one["p50_ms"], "p99_1": one["p99_ms"], "rps_1": one["calls_per_s"],
        "p50_64": many["p50_ms"], "p99_64": many["p99_ms"], "rps_64": many["calls_per_s"],
        "ttft_1": stream["ttft_p50_ms"], "live_ttft": live["ttft_p50_ms"],
        "errors": one["errors"] + many["errors"] + stream["errors"],
    }  # fmt: skip


def one_run(
    calls: int, gateway_python: Path, fixed: bool, rounds: int = 1, compare: Path | None = None
) -> dict[str, dict[str, float]]:
    """Every target once, side by side over one upstream; each target's figures."""
    upstream_port = free_port()
    upstream = start([sys.executable, str(ROOT / "bench" / "fake_upstream.py"), str(upstream_port)], upstream_port)
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    mitmdump = str(ROOT / ".venv-sidecar" / "bin" / "mitmdump")
    work = Path(tempfile.mkdtemp(prefix="forge-bench-"))
    targets: dict[str, list[str] | None] = {
        "direct": None,
        "bare mitmdump": [mitmdump, "-q", "--mode", f"reverse:{upstream_url}", "--listen-host", "127.0.0.1",
                          "--set", f"confdir={work}/bare"],
        "openforge sidecar": [str(ROOT / ".venv" / "bin" / "forge"), "sidecar", "--mode", f"reverse:{upstream_url}",
                              "--upstream", upstream_url, "--store", str(work / "store"),
                              "--wal-dir", str(work / "wal"), "--episode-id", "bench"],
    }  # fmt: skip
    if fixed:  # the same without asking the server's weight version around each call (a fixed version)
        targets["sidecar, fixed version"] = [
            str(ROOT / ".venv" / "bin" / "forge"), "sidecar", "--mode", f"reverse:{upstream_url}",
            "--upstream", upstream_url, "--store", str(work / "store2"), "--wal-dir", str(work / "wal2"),
            "--episode-id", "bench", "--policy-version", "1",
        ]  # fmt: skip
    trees: dict[str, Path] = {}
    if compare is not None:  # the sidecar as another checkout has it (e.g. a worktree of the commit before a change)
        name = f"sidecar @ {compare.name}"
        trees[name] = compare
        targets[name] = [
            str(ROOT / ".venv" / "bin" / "forge"), "sidecar", "--mode", f"reverse:{upstream_url}",
            "--upstream", upstream_url, "--store", str(work / "store3"), "--wal-dir", str(work / "wal3"),
            "--episode-id", "bench",
        ]  # fmt: skip
    if gateway_python.exists():
        gateway = str(gateway_python.parent / "rllm-model-gateway")
        targets["rllm-model-gateway"] = [gateway, "--worker", upstream_url, "--store", "sqlite",
                                         "--db-path", str(work / "rllm.db"), "--log-level", "warning"]  # fmt: skip
    results: dict[str, dict[str, float]] = {}
    if rounds > 1:
        return interleaved(targets, upstream, upstream_port, calls, rounds, trees)
    try:
        for name, args in targets.items():
            if args is None:
                results[name] = measure(upstream_port, calls)
                continue
            port = free_port()
            process = start(args + port_flag(name, port), port, trees.get(name))
            try:
                results[name] = measure(port, calls)
            finally:
                process.terminate()
                process.wait(30)
    finally:
        upstream.terminate()
    return results


def port_flag(name: str, port: int) -> list[str]:
    return ["--port" if name == "rllm-model-gateway" else "--listen-port", str(port)]


def interleaved(
    targets: dict[str, list[str] | None], upstream: subprocess.Popen, upstream_port: int, calls: int, rounds: int,
    trees: dict[str, Path],
) -> dict[str, dict[str, float]]:  # fmt: skip
    """``--rounds N``: every target started at once, measured once as above, then the one-client p50 again in N
    rounds of ``calls`` calls each, the targets taking turns (in a rotated order each round), so that every target
    meets the same drift of a shared machine; its p50 is the median of its rounds' (each round's beside it)."""
    processes: dict[str, subprocess.Popen] = {}
    ports = {name: upstream_port for name in targets}
    results: dict[str, dict[str, float]] = {}
    try:
        for name, args in targets.items():
            if args is not None:
                ports[name] = free_port()
                processes[name] = start(args + port_flag(name, ports[name]), ports[name], trees.get(name))
        for name in targets:
            results[name] = measure(ports[name], calls)
        names = list(targets)
        blocks: dict[str, list[float]] = {name: [] for name in names}
        for number in range(rounds):
            for name in names[number % len(names) :] + names[: number % len(names)]:
                blocks[name].append(asyncio.run(run(ports[name], 1, calls, BODY)).summary()["p50_ms"])
        for name in names:
            results[name]["p50_1"] = statistics.median(blocks[name])
            click.echo(f"  {name:22} one-client p50 by round: {' '.join(f'{b:.2f}' for b in blocks[name])}")
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(30)
        upstream.terminate()
    return results


def ratios(results: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(the sidecar's added p50 over bare mitmdump's, 1 client; its calls/s over bare mitmdump's, 64 clients)."""
    base, bare, ours = results["direct"], results["bare mitmdump"], results["openforge sidecar"]
    return (ours["p50_1"] - base["p50_1"]) / (bare["p50_1"] - base["p50_1"]), ours["rps_64"] / bare["rps_64"]


def report(results: dict[str, dict[str, float]], calls: int, rounds: int = 1) -> None:
    base = results["direct"]
    if rounds > 1:
        click.echo(f"one-client p50 below: the median of {rounds} interleaved rounds of {calls} calls")
    click.echo(f"{calls} calls x1 client, {calls * 5} x64 clients, {calls // 2} streamed; {os.cpu_count()} cores, "
               f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    click.echo(f"{'target':22} {'p50 1c':>8} {'+p50':>7} {'p99 1c':>8} {'calls/s 1c':>10} {'p50 64c':>8} "
               f"{'p99 64c':>8} {'calls/s 64c':>11} {'ttft':>7} {'+ttft':>7} {'live ttft':>10} {'err':>4}")  # fmt: skip
    for name, r in results.items():
        click.echo(
            f"{name:22} {r['p50_1']:8.2f} {r['p50_1'] - base['p50_1']:+7.2f} {r['p99_1']:8.2f} {r['rps_1']:10.0f} "
            f"{r['p50_64']:8.2f} {r['p99_64']:8.2f} {r['rps_64']:11.0f} {r['ttft_1']:7.2f} "
            f"{r['ttft_1'] - base['ttft_1']:+7.2f} {r['live_ttft']:10.1f} {r['errors']:4.0f}"
        )
    bare, ours = results["bare mitmdump"], results["openforge sidecar"]
    added_bare, added_ours = bare["p50_1"] - base["p50_1"], ours["p50_1"] - base["p50_1"]
    latency, throughput = ratios(results)
    click.echo(f"sidecar added p50 (1 client): {added_ours:.2f} ms = {latency:.2f}x bare mitmdump's "
               f"{added_bare:.2f} ms (goal <= 1.1x: {'met' if latency <= 1.1 else 'NOT met'})")  # fmt: skip
    click.echo(f"sidecar calls/s (64 clients): {ours['rps_64']:.0f} = {throughput:.2f}x bare mitmdump's "
               f"{bare['rps_64']:.0f} (goal >= 0.9x: {'met' if throughput >= 0.9 else 'NOT met'})")  # fmt: skip
    click.echo(f"stream TTFT added: sidecar {ours['ttft_1'] - base['ttft_1']:+.2f} ms, bare mitmdump "
               f"{bare['ttft_1'] - base['ttft_1']:+.2f} ms; SSE live (first of chunks 0.3 s apart): sidecar "
               f"{ours['live_ttft']:.1f} ms, bare mitmdump {bare['live_ttft']:.1f} ms")  # fmt: skip
    for name in [name for name in results if name.startswith("sidecar @ ")]:  # --compare-tree
        theirs = results[name]
        click.echo(f"{name}: added p50 (1 client) {(theirs['p50_1'] - base['p50_1']) / added_bare:.2f}x bare "
                   f"mitmdump's, calls/s (64 clients) {theirs['rps_64'] / bare['rps_64']:.2f}x")  # fmt: skip
    if peer := results.get("rllm-model-gateway"):
        figures = (("p50 1 client", "p50_1", min), ("p99 1 client", "p99_1", min),
                   ("calls/s 64 clients", "rps_64", max), ("p99 64 clients", "p99_64", min))  # fmt: skip
        for label, key, better in figures:
            verdict = "sidecar better" if better(ours[key], peer[key]) == ours[key] else "gateway better"
            click.echo(f"vs rllm-model-gateway, {label}: {ours[key]:.2f} vs {peer[key]:.2f} ({verdict})")


@click.command()
@click.option("--calls", type=int, default=400, show_default=True)
@click.option("--runs", type=int, default=1, show_default=True, help="Whole side-by-side runs, each reported.")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="N > 1: the one-client p50 as the median of N rounds in which the targets (all running) take "
                   "turns, CALLS calls each: paired against the drift of a shared machine.")  # fmt: skip
@click.option(
    "--fixed-version/--no-fixed-version",
    default=True,
    show_default=True,
    help="Also measure the sidecar with a fixed --policy-version (no version questions).",
)
@click.option("--compare-tree", type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="Also measure the sidecar's code from this checkout (e.g. `git worktree add` of an earlier "
                   "commit), with this checkout's environments.")  # fmt: skip
@click.option("--gateway-python", type=click.Path(path_type=Path),
              default=Path("/var/cache/openforge/bench/rllm/bin/python"), show_default=True)  # fmt: skip
def main(
    calls: int, runs: int, rounds: int, fixed_version: bool, compare_tree: Path | None, gateway_python: Path
) -> None:
    every = []
    for run_number in range(1, runs + 1):
        if runs > 1:
            click.echo(f"--- run {run_number} of {runs}")
        compare = compare_tree.resolve() if compare_tree else None
        results = one_run(calls, gateway_python, fixed_version, rounds, compare)
        report(results, calls, rounds)
        every.append(ratios(results))
    if runs > 1:
        latency = " / ".join(f"{r[0]:.2f}x" for r in every)
        throughput = " / ".join(f"{r[1]:.2f}x" for r in every)
        click.echo(f"=== {runs} runs: added p50 1 client {latency} bare mitmdump's (goal <= 1.1x: met in "
                   f"{sum(r[0] <= 1.1 for r in every)} of {runs}); calls/s 64 clients {throughput} (goal >= 0.9x: "
                   f"met in {sum(r[1] >= 0.9 for r in every)} of {runs})")  # fmt: skip


if __name__ == "__main__":
    main()
