"""Added latency of transparent mode against regular mode, on the same upstream, in a network namespace (root).

One pod-like namespace holds the fast vLLM-shaped upstream (bench/fake_upstream.py on its loopback), two sidecars
as uid 1337 (`forge sidecar --mode transparent` behind `forge net-init`, and `--mode regular`), and one client
with keep-alive connections: plain HTTP and HTTPS to ``api.openai.com`` (resolved by the namespace's hosts file),
either straight (redirected by the nat rules) or through the regular proxy (absolute URL / CONNECT). Prints
p50/p99 per target and what transparent mode adds over regular mode.

Run (root): .venv/bin/python bench/transparent_latency.py [--calls 400]
"""

import asyncio
import json
import os
import random
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import read_response

ROOT = Path(__file__).resolve().parent.parent
FORGE = str(Path(sys.executable).parent / "forge")
MODEL_HOST = "api.openai.com"
UPSTREAM_PORT, TRANSPARENT_PORT, REGULAR_PORT = 18000, 15001, 15003
PROXY_UID = 1337
BODY = {"model": "m", "messages": [{"role": "user", "content": "Say hi in three words."}], "max_tokens": 8}


# -- the client, run inside the namespace ------------------------------------------------------------------------
def request(target: str) -> bytes:
    data = json.dumps(BODY).encode()
    return (
        f"POST {target} HTTP/1.1\r\nHost: {MODEL_HOST}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode() + data


async def connect(target: str, ca_file: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    tls = ssl.create_default_context(cafile=ca_file)
    if target == "direct":
        reader, writer = await asyncio.open_connection("127.0.0.1", UPSTREAM_PORT)
        return reader, writer, request("/v1/chat/completions")
    if target == "regular http":
        reader, writer = await asyncio.open_connection("127.0.0.1", REGULAR_PORT)
        return reader, writer, request(f"http://{MODEL_HOST}/v1/chat/completions")
    if target == "transparent http":
        reader, writer = await asyncio.open_connection(MODEL_HOST, 80)
        return reader, writer, request("/v1/chat/completions")
    if target == "regular https":
        reader, writer = await asyncio.open_connection("127.0.0.1", REGULAR_PORT)
        writer.write(f"CONNECT {MODEL_HOST}:443 HTTP/1.1\r\nHost: {MODEL_HOST}:443\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n", 1)[0], head
        await writer.start_tls(tls, server_hostname=MODEL_HOST)
        return reader, writer, request("/v1/chat/completions")
    assert target == "transparent https"
    reader, writer = await asyncio.open_connection(MODEL_HOST, 443, ssl=tls, server_hostname=MODEL_HOST)
    return reader, writer, request("/v1/chat/completions")


async def measure(target: str, calls: int, ca_file: str) -> dict[str, float]:
    reader, writer, payload = await connect(target, ca_file)
    latencies, errors = [], 0
    try:
        for i in range(calls + 20):  # the first 20 warm up
            started = time.perf_counter()
            writer.write(payload)
            status, _ = await read_response(reader, started)
            if status != 200:
                errors += 1
            elif i >= 20:
                latencies.append((time.perf_counter() - started) * 1000)
    finally:
        writer.close()
    ordered = sorted(latencies)
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
            "errors": errors}  # fmt: skip


TARGETS = ["direct", "regular http", "transparent http", "regular https", "transparent https"]


def client_main(calls: int, ca_file: str, rounds: int) -> None:
    results: dict[str, list[dict[str, float]]] = {t: [] for t in TARGETS}
    for _ in range(rounds):  # interleaved rounds: drift on a shared machine hits every target alike
        for target in TARGETS:
            results[target].append(asyncio.run(measure(target, calls, ca_file)))
    merged = {
        t: {k: statistics.median(r[k] for r in rs) for k in ("p50", "p99")} | {"errors": sum(r["errors"] for r in rs)}
        for t, rs in results.items()
    }
    print(json.dumps(merged))


# -- the namespace and the servers, run as root ------------------------------------------------------------------
def sh(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:8])} ... exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done


def in_ns(ns: str, args: list[str], uid: int | None = None) -> list[str]:
    prefix = ["ip", "netns", "exec", ns]
    if uid is not None:
        prefix += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return prefix + args


def wait_ready(ns: str, port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1).close()"
    while time.monotonic() < deadline:
        if subprocess.run(in_ns(ns, ["/usr/bin/python3", "-c", probe]), capture_output=True).returncode == 0:
            time.sleep(0.5)
            return
        time.sleep(0.2)
    raise SystemExit(f"nothing listens on {port} in {ns} after {timeout} s")


@click.command()
@click.option("--calls", type=int, default=400, show_default=True, help="Calls per target and round (1 client).")
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--client", "client_ca", hidden=True, help="Internal: run the client with this CA file.")
def main(calls: int, rounds: int, client_ca: str | None) -> None:
    if client_ca:
        client_main(calls, client_ca, rounds)
        return
    if os.geteuid() != 0:
        raise SystemExit("bench/transparent_latency.py needs root (a network namespace and iptables)")
    tag = f"{os.getpid() % 10000}{random.randint(0, 0xFF):02x}"
    ns, n = f"forge-bench-{tag}", random.randint(100, 250)
    work = Path(tempfile.mkdtemp(prefix="forge-bench-transparent-"))
    work.chmod(0o755)
    hosts_dir = Path("/etc/netns") / ns
    processes: list[subprocess.Popen] = []
    try:
        sh(["ip", "netns", "add", ns])
        sh(in_ns(ns, ["ip", "link", "set", "lo", "up"]))
        # The model host needs a route (any), or the client fails at route lookup before the redirect.
        sh(in_ns(ns, ["ip", "link", "add", f"fb{tag}", "type", "veth", "peer", "name", f"fc{tag}"]))
        for cmd in (
            ["ip", "addr", "add", f"10.{n}.0.2/24", "dev", f"fb{tag}"],
            ["ip", "link", "set", f"fb{tag}", "up"],
            ["ip", "link", "set", f"fc{tag}", "up"],
            ["ip", "route", "add", "default", "via", f"10.{n}.0.1"],
        ):
            sh(in_ns(ns, cmd))  # fmt: skip
        hosts_dir.mkdir(parents=True, exist_ok=True)
        (hosts_dir / "hosts").write_text(f"127.0.0.1 localhost\n10.{n}.1.10 {MODEL_HOST}\n")
        ca_dir = work / "ca"
        sh([FORGE, "ca", "init", "--dir", str(ca_dir), "--owner", str(PROXY_UID)])
        sh(in_ns(ns, [FORGE, "net-init", "--proxy-uid", str(PROXY_UID), "--proxy-port", str(TRANSPARENT_PORT)]))
        log = (work / "servers.log").open("ab")
        upstream = [sys.executable, str(ROOT / "bench" / "fake_upstream.py"), str(UPSTREAM_PORT)]
        processes.append(subprocess.Popen(in_ns(ns, upstream), stdout=log, stderr=log, start_new_session=True))
        wait_ready(ns, UPSTREAM_PORT)
        for mode, port in (("transparent", TRANSPARENT_PORT), ("regular", REGULAR_PORT)):
            for sub in (f"store-{mode}", f"wal-{mode}"):
                (work / sub).mkdir()
                shutil.chown(work / sub, PROXY_UID, PROXY_UID)
            args = json.loads(sh([
                FORGE, "sidecar", "--mode", mode, "--listen-port", str(port),
                "--upstream", f"http://127.0.0.1:{UPSTREAM_PORT}", "--store", str(work / f"store-{mode}"),
                "--wal-dir", str(work / f"wal-{mode}"), "--episode-id", "bench", "--model-hosts", MODEL_HOST,
                "--ca-dir", str(ca_dir), "--print-command",
            ]).stdout)  # fmt: skip
            env = {"PATH": "/usr/bin:/bin", "HOME": str(work / f"wal-{mode}")}
            processes.append(subprocess.Popen(in_ns(ns, args, uid=PROXY_UID), stdout=log, stderr=log, env=env,
                                              start_new_session=True))  # fmt: skip
            wait_ready(ns, port)
        time.sleep(3)  # the addon's start-up (store, WAL) finishes after the port opens
        done = sh(in_ns(ns, [sys.executable, __file__, "--calls", str(calls), "--rounds", str(rounds),
                             "--client", str(ca_dir / "mitmproxy-ca-cert.pem")]), timeout=1800)  # fmt: skip
        results = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(hosts_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    click.echo(f"{calls} sequential calls x {rounds} rounds per target, 1 keep-alive client; {os.cpu_count()} cores")
    click.echo(f"{'target':18} {'p50 ms':>8} {'p99 ms':>8} {'+p50 vs direct':>15} {'errors':>7}")
    base = results["direct"]["p50"]
    for target, r in results.items():
        click.echo(f"{target:18} {r['p50']:8.2f} {r['p99']:8.2f} {r['p50'] - base:+15.2f} {r['errors']:7.0f}")
    for scheme in ("http", "https"):
        t, g = results[f"transparent {scheme}"], results[f"regular {scheme}"]
        click.echo(f"transparent mode adds over regular ({scheme}): p50 {t['p50'] - g['p50']:+.2f} ms, "
                   f"p99 {t['p99'] - g['p99']:+.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
