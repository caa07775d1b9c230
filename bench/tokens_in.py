"""Tokens-in continuation: what it costs per call and what it saves per episode.

    python -m bench.tokens_in latency --upstream http://127.0.0.1:18000 [--pairs 10]
    python -m bench.tokens_in forks --store STORE --upstream http://127.0.0.1:18000

``latency``: two real sidecars on the same vLLM, one with ``--tokens-in auto``, one with ``--tokens-in off``. Each
pair is one conversation whose first answer re-tokenizes differently (six sampled newlines), then the same
second call through each sidecar (greedy, 8 tokens): served tokens-in by the first, by the normal path by the
second. Printed: the median of the paired differences (ms), and both medians.

``forks``: a recorded session (a store) assembled as recorded (after) and with every tokens-in call's prompt
replaced by vLLM's own rendering of its request, the ids the normal path would have had (before): segments, fork
rate, forks by cause (as ``forge report`` names them) and trainable-token share of each. Chat, Anthropic Messages
and OpenAI Responses calls (a Responses request normalised as the sidecar sends it).
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa

from sidecar.apis.responses import normalise_request
from tests.support.sidecar import SidecarFactory, read_calls

NEWLINE = 198


def _chat(client: httpx.Client, episode: str, messages: list[dict], **extra: object) -> tuple[str, float]:
    started = time.perf_counter()
    answer = client.post("/v1/chat/completions", headers={"x-forge-episode-id": episode},
                         json={"model": "any", "messages": messages, **extra})  # fmt: skip
    elapsed = (time.perf_counter() - started) * 1e3
    answer.raise_for_status()
    return answer.json()["choices"][0]["message"]["content"] or "", elapsed


def latency(upstream: str, pairs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        factory = SidecarFactory(Path(tmp))
        try:
            extra = ("--trust-episode-header",)
            auto = factory(upstream, episode_id=None, extra=(*extra, "--tokens-in", "auto"))
            off = factory(upstream, episode_id=None, extra=(*extra, "--tokens-in", "off"), store=f"{tmp}/store-off")
            differences, ours, normal = [], [], []
            for n in range(pairs):
                first = [{"role": "user", "content": f"Write empty lines ({n})."}]
                timings = {}
                for name, sidecar in (("auto", auto), ("off", off)) if n % 2 else (("off", off), ("auto", auto)):
                    with httpx.Client(base_url=sidecar.url, timeout=300) as client:
                        text, _ = _chat(client, f"{name}-{n}", first, max_tokens=6, temperature=1.0,
                                        allowed_token_ids=[NEWLINE])  # fmt: skip
                        second = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "Go."}]
                        _, timings[name] = _chat(client, f"{name}-{n}", second, max_tokens=8, temperature=0)
                ours.append(timings["auto"])
                normal.append(timings["off"])
                differences.append(timings["auto"] - timings["off"])
            calls = read_calls(auto.store, "continuation = 'tokens_in'")
            print(f"pairs: {pairs}; second calls served tokens-in by the auto sidecar: {len(calls)}")
            print(f"tokens-in path median {statistics.median(ours):.1f} ms, normal path median "
                  f"{statistics.median(normal):.1f} ms")  # fmt: skip
            print(f"added latency of the tokens-in path (median of paired differences): "
                  f"{statistics.median(differences):.1f} ms")  # fmt: skip
        finally:
            factory.stop_all()


def _assembled(calls: list[dict], prompts: dict[str, list[int]]) -> dict[str, Any]:
    from collector.assemble import CALL_COLUMNS, assemble

    rows = []
    for call in calls:
        prompt = prompts.get(call["call_id"], call["prompt_token_ids"])
        row = {name: call.get(name) for name in CALL_COLUMNS}
        row.update(parent_call_id=None, prefix_len=0, prompt_suffix_ids=prompt, prompt_len=len(prompt))
        rows.append(row)
    table = pa.Table.from_pylist(rows)
    table = table.set_column(table.schema.get_field_index("prompt_suffix_ids"), "prompt_suffix_ids",
                             table["prompt_suffix_ids"].cast(pa.list_(pa.int32())))  # fmt: skip
    segments, episodes = assemble(table)
    e = episodes.to_pylist()
    merged, forked = sum(x["n_merged"] for x in e), sum(x["n_forked"] for x in e)
    return {
        "calls": len(calls), "segments": segments.num_rows,
        "fork_rate": forked / max(merged + forked, 1),
        "causes": _causes(segments.to_pylist(), {c["call_id"]: c["continuation"] for c in calls}),
        "trainable_share": sum(x["n_trainable"] for x in e) / max(sum(x["n_tokens"] for x in e), 1),
    }  # fmt: skip


def _causes(segments: list[dict], continuation: dict[str, str | None]) -> dict[str, int]:
    """Forks by cause, as collector/report.py's FORK_CAUSES_SQL names them (by each later segment's first call)."""
    from collector.report import CAUSES

    counts = dict.fromkeys(CAUSES, 0)
    for s in segments:
        if s["segment"] == 0:
            continue
        if s["fork_reason"] == "retry":
            cause = "retry"
        elif continuation.get(s["call_ids"][0]) in ("retokenized", "tokens_in"):
            cause = "retokenization"
        else:
            cause = "unrelated" if s["fork_reason"] == "unrelated" else "rewrite"
        counts[cause] += 1
    return counts


def render_request(call: dict, model: str) -> tuple[str, dict]:
    """The policy server's render endpoint for a recorded call and the request to render there, as the sidecar sends
    it (a Messages request without ``thinking``, which the sidecar ignores; a Responses request normalised)."""
    request = {**json.loads(call["request_json"]), "model": model, "stream": False}
    if call["api"] == "messages":
        request.pop("thinking", None)
        return "/v1/messages/render", request
    if call["api"] == "responses":
        normalise_request(request)
        return "/v1/responses/render", request
    return "/v1/chat/completions/render", {**request, "stream_options": None}


def forks(store: str, upstream: str) -> None:
    calls = read_calls(store)
    canonical: dict[str, list[int]] = {}
    with httpx.Client(base_url=upstream, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for call in calls:
            if call["continuation"] != "tokens_in":
                continue
            path, request = render_request(call, model)
            canonical[call["call_id"]] = client.post(path, json=request).json()["token_ids"]
    before, after = _assembled(calls, canonical), _assembled(calls, {})
    print(f"session: {len(calls)} calls, {len(canonical)} served tokens-in")
    for name, figures in (("before (normal path)", before), ("after (tokens-in)", after)):
        causes = ", ".join(f"{cause} {n}" for cause, n in figures["causes"].items())
        print(f"{name:>22}: segments {figures['segments']}, fork rate {figures['fork_rate']:.2f} "
              f"(forks by cause: {causes}), trainable-token share {figures['trainable_share']:.4f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["latency", "forks"])
    parser.add_argument("--upstream", default="http://127.0.0.1:18000")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--store")
    args = parser.parse_args()
    if args.what == "latency":
        latency(args.upstream, args.pairs)
    else:
        forks(args.store, args.upstream)


if __name__ == "__main__":
    main()
