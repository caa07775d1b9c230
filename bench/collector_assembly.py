"""Collector benchmark: episode assembly over 10k / 100k / 1M calls (50 calls per episode, 4,000-token prompts).

Each size's store is generated once (bench/collector_generate.py) into a cache folder and reused. Each
measurement runs in its own process pinned to two cores, so its peak memory is its own:
  full        `collect --rebuild`: list, read every file, assemble, write the state (what the goal counts)
  read/assemble  the two main parts of it, timed separately
  no-op       a second run with nothing new (reads the state back)
  one file    a run after one new file of one new episode landed (that file read, one episode rebuilt)
  wide file   a run after one reward file for 1,000 existing episodes landed (their calls re-read, rebuilt)
  read state  every segment read back from the state (what `forge collect` reads before it filters)

    .venv/bin/python bench/collector_assembly.py                   # 10k and 100k
    .venv/bin/python bench/collector_assembly.py --sizes 10000,100000,1000000 --timeout 600
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CALLS_PER_EPISODE = 50
CORES = "0,1"
EXTRA_FILE = "zz-bench-extra-calls-0"  # the one-file step's file, removed after it (and before, if a run was killed)
WIDE_FILE = "zz-bench-extra-rewards-0"  # the wide-file step's file, likewise
WIDE_EPISODES = 1000


def cache_root() -> Path:
    from forge.paths import cache_dir

    return cache_dir() / "bench"


def ensure_store(calls: int, prompt_tokens: int) -> Path:
    from bench.collector_generate import write_bench_store

    store = cache_root() / f"collector-{calls}-{prompt_tokens}"
    if not (store / ".complete").exists():
        shutil.rmtree(store, ignore_errors=True)
        start = time.perf_counter()
        written = write_bench_store(str(store), calls, calls // CALLS_PER_EPISODE, prompt_tokens)
        (store / ".complete").write_text(json.dumps(written))
        print(f"  generated {store} in {time.perf_counter() - start:.1f} s: {written}", flush=True)
    return store


def measure(store: Path, phase: str) -> dict[str, float]:
    """Runs in a child process: phase "full" (full, no-op and one-file runs) or "parts" (read, assemble)."""
    import pyarrow as pa

    from bench.collector_generate import SyntheticEpisode, write_calls, write_rewards
    from collector.collect import Collector

    figures: dict[str, float] = {}
    for name in (EXTRA_FILE, WIDE_FILE):
        for stale in store.rglob(f"{name}.parquet"):
            stale.unlink()
    with tempfile.TemporaryDirectory() as state:
        collector = Collector(str(store), state_dir=Path(state), progress=False)
        if phase == "parts":
            start = time.perf_counter()
            files = collector.list_files()
            calls = pa.concat_tables(collector.read([f for f in files if f.table == "calls"], "calls"))
            rewards = pa.concat_tables(collector.read([f for f in files if f.table == "rewards"], "rewards"))
            figures["read_s"] = time.perf_counter() - start
            start = time.perf_counter()
            collector.assemble(calls, rewards)  # in batches of episodes, as update() does
            figures["assemble_s"] = time.perf_counter() - start
            figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            return figures
        start = time.perf_counter()
        collection = collector.update(rebuild=True)
        figures["full_s"] = time.perf_counter() - start
        figures["segments"] = collection.segments.num_rows
        figures["episodes"] = collection.episodes.num_rows
        figures["tokens"] = float(sum(collection.episodes["n_tokens"].to_pylist()))
        figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(figures), flush=True)  # the parent keeps the last line if a later step is stopped
        del collection
        start = time.perf_counter()
        collector.update()
        figures["noop_s"] = time.perf_counter() - start
        print(json.dumps(figures), flush=True)
        episode = SyntheticEpisode("bench-extra", run_id="bench")
        prompt = list(range(4000))
        for turn in range(CALLS_PER_EPISODE):
            completion = list(range(50_000 + 40 * turn, 50_040 + 40 * turn))
            episode.call(prompt, completion)
            prompt = prompt + completion + list(range(60_000 + 40 * turn, 60_040 + 40 * turn))
        extra = write_calls(str(store), episode.rows, name=EXTRA_FILE, run="bench")
        try:
            start = time.perf_counter()
            result = collector.update()
            figures["one_file_s"] = time.perf_counter() - start
            figures["one_file_read"] = result.files_read
            figures["one_file_rebuilt"] = result.episodes_rebuilt
        finally:
            os.unlink(extra)
        print(json.dumps(figures), flush=True)
        episodes = int(figures["episodes"])
        picked = [f"e{e:06d}" for e in range(0, episodes, max(episodes // WIDE_EPISODES, 1))][:WIDE_EPISODES]
        wide = write_rewards(str(store), [{"episode_id": e, "reward": 0.5} for e in picked], name=WIDE_FILE,
                             run="bench")  # fmt: skip
        try:
            start = time.perf_counter()
            result = collector.update()
            figures["wide_file_s"] = time.perf_counter() - start
            figures["wide_file_rebuilt"] = result.episodes_rebuilt
            print(json.dumps(figures), flush=True)
            start = time.perf_counter()
            figures["state_segments"] = result.segments.num_rows
            figures["read_state_s"] = time.perf_counter() - start
        finally:
            os.unlink(wide)
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def rss_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)


def run_bounded(command: list[str], timeout: float, max_rss_gb: float) -> tuple[str | None, str, int]:
    """Run the measuring child; stop it past the time or memory bound (the machine is shared)."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, peak, status = time.monotonic() + timeout, 0, None
    while child.poll() is None:
        peak = max(peak, rss_kb(child.pid))
        if peak > max_rss_gb * 1024 * 1024:
            status = f"stopped past {max_rss_gb:g} GB RSS"
        elif time.monotonic() > deadline:
            status = f"stopped after {timeout:.0f} s"
        if status:
            child.kill()
            break
        time.sleep(0.2)
    stdout, stderr = child.communicate()
    if status is None and child.returncode:
        status = f"failed: {(stderr.strip().splitlines() or ['?'])[-1]}"
    return status, stdout, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10000,100000", help="Numbers of calls, comma-separated.")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds per size; a size past it is cut.")
    parser.add_argument("--max-rss-gb", type=float, default=6.0, help="Stop a size whose process grows past this.")
    parser.add_argument("--phases", default="full,parts", help="full (update runs), parts (read, assemble).")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.phase)))
        return
    print(f"collector assembly, {CALLS_PER_EPISODE} calls per episode, prompts averaging {args.prompt_tokens} "
          f"tokens, pinned to cores {CORES}")  # fmt: skip
    header = f"{'calls':>9} {'episodes':>8} {'tokens out':>11} {'full s':>7} {'no-op s':>7} {'1 file s':>8} " \
             f"{'wide s':>7} {'state s':>7} {'peak MB':>8} | " \
             f"{'read s':>7} {'assemble s':>10} {'peak MB':>8}"  # fmt: skip
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        store = ensure_store(size, args.prompt_tokens)
        results: dict[str, dict | str] = {"parts": "parts: not measured"}
        for phase in args.phases.split(","):
            command = ["taskset", "-c", CORES, sys.executable, __file__, "--measure", str(store), "--phase", phase]
            status, stdout, peak = run_bounded(command, args.timeout, args.max_rss_gb)
            lines = stdout.strip().splitlines()
            if status and lines:  # stopped in a later step: keep the figures it printed before
                results[phase] = {"noop_s": float("nan"), "one_file_s": float("nan"), "wide_file_s": float("nan"),
                                  "read_state_s": float("nan"), **json.loads(lines[-1])}  # fmt: skip
                print(f"  {size} {phase}: {status}; before that: {lines[-1]}", flush=True)
            elif status:
                results[phase] = f"{phase}: {status} (peak RSS seen {peak / 1024:.0f} MB)"
                print(f"  {size} {results[phase]}", flush=True)
            else:
                results[phase] = json.loads(stdout.strip().splitlines()[-1])
                print(f"  {size} {phase}: {json.dumps(results[phase])}", flush=True)
        full, parts = results["full"], results["parts"]
        left: str = full if isinstance(full, str) else ""
        if isinstance(full, dict):
            left = (f"{full['episodes']:>8.0f} {full['tokens']:>11,.0f} {full['full_s']:>7.2f} "
                    f"{full['noop_s']:>7.2f} {full['one_file_s']:>8.2f} {full['wide_file_s']:>7.2f} "
                    f"{full['read_state_s']:>7.2f} {full['peak_rss_mb']:>8.0f}")  # fmt: skip
        right = (f"{parts['read_s']:>7.2f} {parts['assemble_s']:>10.2f} {parts['peak_rss_mb']:>8.0f}"
                 if isinstance(parts, dict) else parts)  # fmt: skip
        rows.append(f"{size:>9} {left} | {right}")
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
