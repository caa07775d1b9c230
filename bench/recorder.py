"""Recorder throughput and storage: the addon's own hooks over synthetic calls, no proxy or network.

Throughput: calls with 4,000-token prompts (each extending its episode's previous call, as an agent's do) through
``request`` + ``response`` (parse, route, add fields, strip, build the record, WAL append) and the flush to
Parquet. Storage: one 50-turn episode, stored ids against its unique tokens.

Runs in the sidecar environment (mitmproxy), pinned to one core:
  taskset -c 0 .venv-sidecar/bin/python bench/recorder.py [--calls 4000]
"""

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow.parquet as pq
from mitmproxy import http
from mitmproxy.test import taddons, tflow, tutils

from sidecar.addon import Forge


def make_flow(prompt: list[int], completion: list[int], text: str) -> http.HTTPFlow:
    body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": text}], "max_tokens": 64}).encode()
    request = tutils.treq(
        method=b"POST", host="127.0.0.1", port=8000, path=b"/v1/chat/completions", content=body,
        headers=http.Headers(content_type="application/json", authorization="Bearer sk-bench-secret"),
    )  # fmt: skip
    flow = tflow.tflow(req=request)
    answer = {
        "id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": "policy",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok " * len(completion)},
                     "logprobs": {"content": [{"token": "ok", "logprob": -0.1, "bytes": [], "top_logprobs": []}
                                              for _ in completion]},
                     "finish_reason": "stop", "token_ids": completion}],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}, "prompt_token_ids": prompt,
    }  # fmt: skip
    flow.metadata["bench_response"] = json.dumps(answer).encode()
    return flow


LOOP = asyncio.new_event_loop()  # the addon's request hook is async (mitmproxy awaits it)


def drive(addon: Forge, flow: http.HTTPFlow) -> None:
    addon.requestheaders(flow)
    LOOP.run_until_complete(addon.request(flow))
    flow.response = tutils.tresp(content=flow.metadata["bench_response"],
                                 headers=http.Headers(content_type="application/json"))  # fmt: skip
    LOOP.run_until_complete(addon.response(flow))


def episode_flows(episode_len: int, prompt_len: int, completion_len: int, new_per_turn: int) -> list[http.HTTPFlow]:
    """An episode whose every prompt is its previous prompt + completion + new tokens (a context of prompt_len)."""
    flows, history = [], list(range(1000, 1000 + prompt_len - (episode_len - 1) * (completion_len + new_per_turn)))
    for turn in range(episode_len):
        completion = [5000 + turn * 100 + i for i in range(completion_len)]
        flows.append(make_flow(list(history), completion, "x" * (4 * len(history))))
        history += completion + [7000 + turn] * new_per_turn
    return flows


@contextlib.contextmanager
def recording(prefix: str, **options: str) -> Iterator[tuple[Forge, Path]]:
    """A running addon writing to a fresh local store; flushed (and checked) on exit."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    addon = Forge()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, forge_store=str(work / "store"), forge_wal_dir=str(work / "wal"),
                       forge_policy_model="policy", forge_policy_version="1", **options)  # fmt: skip
        addon.running()
        yield addon, work
        assert addon.relay.writer is not None and addon.relay.writer.close(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--fsync", choices=["always", "interval", "never"], default="interval")
    args = parser.parse_args()
    with recording("forge-recorder-", forge_flush_seconds="1", forge_fsync=args.fsync) as (addon, work):
        # Throughput: episodes of 10 calls, every prompt 4,000 tokens long.
        flows = []
        for episode in range(args.calls // 10):
            for flow in episode_flows(10, 4000, 32, 8):
                flow.request.headers["x-forge-episode-id"] = f"e{episode}"
                flows.append(flow)
        started_wall, started_cpu = time.perf_counter(), time.process_time()
        for flow in flows:
            drive(addon, flow)
        assert addon.relay.writer is not None and addon.relay.writer.close(60)  # the flush is part of the cost
        wall, cpu = time.perf_counter() - started_wall, time.process_time() - started_cpu
    print(f"recorder (--fsync {args.fsync}): {len(flows)} calls with 4,000-token prompts in {wall:.2f} s wall / "
          f"{cpu:.2f} s CPU = {len(flows) / wall:,.0f} calls/s ({len(flows) / cpu:,.0f} per CPU-second)")  # fmt: skip
    stored = [pq.read_table(p) for p in (work / "store").rglob("*.parquet")]
    assert sum(t.num_rows for t in stored) == len(flows), "not every call was stored"

    # Storage: one 50-turn episode.
    with recording("forge-storage-", forge_episode_id="long") as (addon, work2):
        flows = episode_flows(50, 4000, 32, 16)
        for flow in flows:
            drive(addon, flow)
    (path,) = (work2 / "store").rglob("*.parquet")
    table = pq.read_table(path)
    stored_ids = sum(len(x) for x in table["prompt_suffix_ids"].to_pylist()) + sum(
        len(x) for x in table["completion_token_ids"].to_pylist()
    )
    last = json.loads(flows[-1].metadata["bench_response"])
    unique = len(last["prompt_token_ids"]) + len(last["choices"][0]["token_ids"])
    whole = sum(len(json.loads(f.metadata["bench_response"])["prompt_token_ids"]) for f in flows)
    meta = pq.ParquetFile(path).metadata
    id_bytes = sum(
        meta.row_group(g).column(c).total_compressed_size
        for g in range(meta.num_row_groups)
        for c in range(meta.num_columns)
        if meta.row_group(g).column(c).path_in_schema.split(".")[0] in ("prompt_suffix_ids", "completion_token_ids")
    )
    ratio = stored_ids / unique
    print(f"storage, 50-turn episode: {stored_ids:,} ids stored for {unique:,} unique tokens = {ratio:.3f}x "
          f"(whole prompts would be {whole:,} = {whole / unique:.1f}x); id columns {id_bytes:,} B on disk vs "
          f"{unique * 4:,} B raw int32 = {id_bytes / (unique * 4):.2f}x; whole file {path.stat().st_size:,} B "
          f"(request/response JSON included)")  # fmt: skip


if __name__ == "__main__":
    main()
