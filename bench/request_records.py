"""Stored request bytes per call over one long episode: whole request records (before) vs linear ones (after).

A Claude-Code-shaped conversation (Anthropic Messages, streaming: the messages first, a billing line in
``system[0]`` that changes every call, a large system prompt and tool list, the cache marker moved to the last
message each turn, a tool result of a few hundred characters per turn) is sent through the real sidecar
(`forge sidecar`) to a fast stand-in upstream (bench/fake_upstream.py), and the store is read back:
- before: the whole request text (what the ``request_json`` column held for every call; the ``calls`` view still
  gives exactly that);
- after: what the sidecar stores now (``calls_raw.request_json``: the part not shared with the parent request);
both as characters per call and as zstd Parquet bytes of the column (one file each).

    .venv/bin/python bench/request_records.py [--turns 50]
"""

import json
import os
import random
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fake_upstream import FakeUpstream
from tests.support.sidecar import SidecarFactory

WORDS = [
    f"{a}{b}"
    for a in ("re", "un", "pre", "sub", "over", "in", "de", "co")
    for b in (
        "read",
        "write",
        "file",
        "test",
        "code",
        "path",
        "line",
        "shell",
        "run",
        "edit",
        "grep",
        "build",
        "fix",
        "diff",
        "task",
        "user",
        "tool",
        "call",
        "text",
        "data",
        "node",
        "tree",
        "list",
        "map",
        "key",
        "value",
        "error",
        "log",
    )
]


def prose(seed: int, words: int) -> str:
    """Text that does not compress to nothing (real prompts do not): seeded, so every run sends the same."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


SYSTEM_PROMPT = prose(0, 2500)  # ~17 KB, like Claude Code's
TOOLS = [
    {"name": f"Tool{i}", "description": prose(1000 + i, 100),
     "input_schema": {"type": "object", "properties": {"arg": {"type": "string", "description": "what to act on"}},
                      "required": ["arg"]}}
    for i in range(12)
]  # fmt: skip


def conversation(turns: int) -> list[dict[str, Any]]:
    """The request bodies of a ``turns``-call Claude-Code-shaped session, in order."""
    bodies = []
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Fix the failing test."}]}]
    for turn in range(turns):
        marked = json.loads(json.dumps(messages))
        marked[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}  # on the last message only, as CC does
        billing = f"x-anthropic-billing-header: cc_version=2.1.332; cch={turn * 7919 % 100000:05d};"
        bodies.append({
            "model": "claude-sonnet-4-5", "messages": marked,
            "system": [
                {"type": "text", "text": billing},
                {"type": "text", "text": SYSTEM_PROMPT, "cache_control": {"type": "ephemeral"}},
            ],
            "tools": TOOLS, "metadata": {"user_id": "user_0000"}, "max_tokens": 128000, "stream": True,
        })  # fmt: skip
        call_id = f"toolu_{turn:04d}"
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": "SmolLAM"},
            {"type": "tool_use", "id": call_id, "name": "Tool1", "input": {"arg": f"file_{turn}.py"}},
        ]})  # fmt: skip
        result = prose(10_000 + turn, 60)
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]}
        )
    return bodies


def send(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        f"{url}/v1/messages", data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json", "x-api-key": "sk-ant-bench", "anthropic-version": "2023-06-01",
                 "user-agent": "claude-cli/2.1.332 (external, sdk-cli)"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as answer:
        answer.read()


def stored_requests(store: str) -> list[dict[str, Any]]:
    """Per call in order: the whole request text (the ``calls`` view) and the stored part (``calls_raw``)."""
    from collector.sql import connect

    con = connect(store)
    return [
        {"call_id": c, "seq": s, "whole": w, "stored": r, "parent": p}
        for c, s, w, r, p in con.execute(
            "SELECT call_id, v.seq, v.request_json, r.request_json, r.request_parent_call_id "
            "FROM calls v JOIN calls_raw r USING (call_id) ORDER BY v.seq"
        ).fetchall()
    ]


def parquet_bytes(texts: list[str]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with tempfile.NamedTemporaryFile(suffix=".parquet") as file:
        pq.write_table(pa.table({"request_json": texts}), file.name, compression="zstd")
        return os.path.getsize(file.name)


def zstd_bytes(texts: list[str]) -> int:
    """Each text compressed alone (zstd): what a call costs in a file of its own, as when calls come more than
    --flush-seconds apart (a real model takes seconds per call)."""
    import pyarrow as pa

    return sum(len(pa.compress(text.encode(), codec="zstd", asbytes=True)) for text in texts)


def run_session(turns: int, work: Path) -> list[dict[str, Any]]:
    """The session through a real sidecar; its calls as ``stored_requests`` gives them."""
    factory = SidecarFactory(work)
    with FakeUpstream() as upstream:
        try:
            sidecar = factory(upstream.url, episode_id="bench-episode")
            for body in conversation(turns):
                send(sidecar.url, body)
        finally:
            factory.stop_all()
    return stored_requests(sidecar.store)


@click.command()
@click.option("--turns", type=int, default=50, show_default=True)
def main(turns: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        calls = run_session(turns, Path(work))
    print(f"{'call':>4} {'whole chars':>12} {'stored chars':>12}  parent")
    for c in calls:
        print(f"{c['seq']:>4} {len(c['whole']):>12} {len(c['stored']):>12}  {c['parent'] or '-'}")
    whole = sum(len(c["whole"]) for c in calls)
    stored = sum(len(c["stored"]) for c in calls)
    n = len(calls)
    for label, texts in (("before (whole requests)", [c["whole"] for c in calls]),
                         ("after (linear)", [c["stored"] for c in calls])):  # fmt: skip
        chars, one_file, alone = sum(map(len, texts)), parquet_bytes(texts), zstd_bytes(texts)
        print(
            f"{label}: {chars / n:.0f} chars per call; zstd, all {n} calls in one Parquet file: "
            f"{one_file / n:.0f} B per call; zstd, each call alone: {alone / n:.0f} B per call"
        )
    later = [len(c["stored"]) for c in calls[1:]]
    print(f"after, calls 2..{n}: {min(later)}..{max(later)} chars each ({whole / stored:.1f}x fewer chars overall)")


if __name__ == "__main__":
    main()
