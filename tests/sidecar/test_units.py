"""The sidecar's pieces without a proxy: SSE framing, prefix references, the WAL writer, stripping, redaction."""

import base64
import contextlib
import json
import marshal
import random
import struct
import subprocess
import sys
import time
import zlib
from array import array
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forge.paths import repo_root
from sidecar.apis import openai
from sidecar.metrics import Metrics
from sidecar.prefix import PrefixIndex, common_prefix_len
from sidecar.record import (
    CALL_SCHEMA,
    REWARD_SCHEMA,
    CallRecord,
    RewardRow,
    checked_row,
    pack_floats,
    pack_ids,
    reward_row,
    to_table,
)
from sidecar.redact import REDACTED, redacted_json, secrets_in_headers
from sidecar.sse import EventFramer, parse_data, parse_event, rewrite_event
from sidecar.store import StoreError, open_store
from sidecar.writer import WAL_FILE, RecordWriter, pending_records, rows_to_table

STREAM = b'data: {"a":1}\n\nevent: ping\ndata: {"b":2}\n\n: comment\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_events_come_out_whole_however_the_stream_is_cut(cut):
    framer = EventFramer()
    events = framer.feed(STREAM[:cut]) + framer.feed(STREAM[cut:])
    assert b"".join(events) == STREAM and len(events) == 4 and framer.rest() == b""


def test_an_unchanged_event_goes_on_byte_for_byte_and_others_keep_their_fields():
    raw = b'event: x\r\ndata: {"a":1}\r\n\r\n'
    assert rewrite_event(raw, lambda d: d) is raw
    assert rewrite_event(raw, lambda d: '{"a":2}') == b'event: x\ndata: {"a":2}\r\n\r\n'
    assert rewrite_event(raw, lambda d: None) is None
    assert rewrite_event(b": keep-alive\n\n", lambda d: None) == b": keep-alive\n\n"


def test_every_api_reads_a_chunk_the_same_way():
    """One parser for the sentinel, JSON objects, vLLM's error chunk, and what is none of these."""
    assert parse_event(b"data: [DONE]\n\n").done and parse_data(" [DONE] ").done
    chunk = parse_event(b'event: x\ndata: {"choices":[],"a":1}\n\n')
    assert chunk.payload == {"choices": [], "a": 1} and chunk.error is None and not chunk.done
    assert parse_data('{"error":{"message":"engine died"}}').error == "engine died"
    assert parse_data('{"error":"plain"}').error == "plain"
    assert parse_data('{"error":{"message":"x"},"choices":[]}').error is None  # a chunk with choices goes on
    for data in ("[1, 2]", "not json", '"text"'):
        assert parse_data(data).payload is None and parse_data(data).data == data
    assert parse_event(b": keep-alive\n\n").data is None


def test_common_prefix_len_matches_a_plain_loop():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(5) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(10))]
        expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(pack_ids(a), pack_ids(b)) == expected


def test_a_prompt_references_the_call_it_extends_most():
    index = PrefixIndex(min_prefix=2)
    index.remember("e", "c1", pack_ids([1, 2, 3, 4]))
    index.remember("e", "c2", pack_ids([1, 2, 9, 9, 9]))
    assert index.split("e", pack_ids([1, 2, 3, 4, 5, 6])) == ("c1", 4)
    assert index.split("e", pack_ids([1, 2, 9, 9, 8])) == ("c2", 4)
    assert index.split("other", pack_ids([1, 2, 3])) == (None, 0)
    assert index.split("e", pack_ids([7])) == (None, 0)


def make_writer(tmp_path: Path, **kwargs) -> tuple[RecordWriter, str]:
    store = str(tmp_path / "store")
    return RecordWriter(tmp_path / "wal", open_store(store), Metrics(), **kwargs), store


def row(n: int, episode: str = "e") -> dict:
    return {"call_id": f"c{n}", "episode_id": episode, "seq": n, "started_at": 1_800_000_000_000_000 + n,
            "prompt_suffix_ids": pack_ids(list(range(n))), "completion_token_ids": pack_ids([n, n + 1]),
            "completion_logprobs": pack_floats([-0.5, -0.25]), "status": "ok"}  # fmt: skip


def stored_call_ids(store: str) -> list[str]:
    table = open_store(store).read_table("calls")
    return sorted(table.column("call_id").to_pylist()) if table is not None else []


def test_records_reach_parquet_with_ids_and_types_intact(tmp_path):
    writer, store = make_writer(tmp_path)
    for n in range(5):
        assert writer.append("calls", row(n))
    assert writer.close() and writer.pending() == 0
    table = open_store(store).read_table("calls")
    assert table is not None and table.num_rows == 5
    rows = sorted(table.to_pylist(), key=lambda r: r["seq"])
    assert [r["prompt_suffix_ids"] for r in rows] == [list(range(n)) for n in range(5)]
    assert rows[3]["completion_token_ids"] == [3, 4] and rows[3]["completion_logprobs"] == [-0.5, -0.25]
    assert rows[0]["started_at"].year == 2027 and rows[0]["schema_version"] == 1
    assert pending_records(tmp_path / "wal") == 0


def test_a_restart_over_the_same_wal_keeps_every_earlier_file_and_goes_on_counting(tmp_path):
    writer, store = make_writer(tmp_path)
    assert [writer.next_seq("e") for _ in range(3)] == [0, 1, 2]
    for n in range(3):
        writer.append("calls", row(n))
    assert writer.close()
    again, _ = make_writer(tmp_path)  # the same WAL folder: the same sidecar id, batch numbers go on
    assert again.sidecar_id == writer.sidecar_id
    assert [again.next_seq("e") for _ in range(3)] == [3, 4, 5] and again.next_seq("other") == 0
    for n in range(3, 6):
        again.append("calls", row(n))
    assert again.close()
    assert stored_call_ids(store) == [f"c{n}" for n in range(6)]
    assert len(open_store(store).list_parquet("calls")) == 2


def test_the_store_never_replaces_a_file_of_that_name(tmp_path):
    target = open_store(str(tmp_path / "store"))
    assert target.write_parquet_new("calls/x.parquet", to_table([{"call_id": "first"}], "calls"))
    assert not target.write_parquet_new("calls/x.parquet", to_table([{"call_id": "second"}], "calls"))
    assert stored_call_ids(target.uri) == ["first"]


CRASH_AFTER_APPENDS = """
import os, sys
sys.path.insert(0, {root!r})
from pathlib import Path
from sidecar.metrics import Metrics
from sidecar.store import open_store
from sidecar.writer import RecordWriter
from tests.sidecar.test_units import row
writer = RecordWriter(Path({wal!r}), open_store({store!r}), Metrics())
for n in range(3):
    writer.append("calls", row(n))
os._exit(0)  # a crash: no close, no checkpoint; the records are only in SQLite's journal
"""


def test_a_crash_then_a_torn_journal_tail_keeps_every_committed_record_once(tmp_path):
    wal, store = tmp_path / "wal", str(tmp_path / "store")
    script = CRASH_AFTER_APPENDS.format(root=str(repo_root()), wal=str(wal), store=store)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    journal = wal / f"{WAL_FILE}-wal"
    assert journal.stat().st_size > 0, "the crash left no journal: the test would show nothing"
    with journal.open("ab") as out:  # a frame torn mid-write by a machine crash
        out.write(b"\x37\x7f\x06\x82" + bytes(range(256)) * 7)
    assert pending_records(wal) == 3
    restarted, _ = make_writer(tmp_path)
    assert restarted.close()
    assert stored_call_ids(store) == ["c0", "c1", "c2"]


def test_a_wal_written_by_the_previous_release_replays(tmp_path):
    wal = tmp_path / "wal"
    wal.mkdir()
    frames = b""
    for n in range(3):  # the previous release's frame: length, adler32, marshal payload
        payload = marshal.dumps(row(n))
        frames += struct.pack("<II", len(payload), zlib.adler32(payload)) + payload
    (wal / "calls-00000004.open").write_bytes(frames + b"\x10\x00\x00\x00torn")
    (wal / "sidecar-id").write_text("old-sidecar")
    writer, store = make_writer(tmp_path)
    assert writer.metrics.get("wal_records_replayed") == 3 and not list(wal.glob("*.open"))
    assert writer.close()
    assert stored_call_ids(store) == ["c0", "c1", "c2"]
    assert not any("old-sidecar-calls-4" in p for p in open_store(store).list_parquet("calls"))


def test_a_row_that_cannot_be_converted_is_quarantined_and_the_others_go_on(tmp_path):
    writer, store = make_writer(tmp_path, max_rows=3)
    bad = {**row(1), "seq": "not a number"}  # what CallRecord's checks make impossible, written around them
    for record in (row(0), bad, row(2), row(3), row(4)):
        writer.append("calls", record)
    assert writer.close()
    assert stored_call_ids(store) == ["c0", "c2", "c3", "c4"]
    assert writer.metrics.get("records_quarantined_total") == 1
    [quarantined] = (tmp_path / "wal" / "quarantine").glob("*.jsonl")
    kept = json.loads(quarantined.read_text())
    assert kept["row"]["call_id"] == "c1" and kept["reason"].startswith(("ArrowInvalid", "ArrowTypeError", "TypeError"))


def test_past_the_disk_bound_records_are_dropped_and_counted(tmp_path):
    writer, _ = make_writer(tmp_path, max_disk_bytes=600)
    results = [writer.append("calls", row(n)) for n in range(20)]
    assert results[0] is not None and results[-1] is None
    assert writer.metrics.get("records_dropped_total") == results.count(None) > 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([f.name for f in CALL_SCHEMA]), json_values))
def test_any_values_checked_into_a_call_record_convert_to_parquet(values):
    checked = checked_row("calls", {"call_id": "c", **values})
    rows_to_table([{**checked, "call_id": checked["call_id"] or "c"}], "calls")  # never raises


def test_an_odd_model_name_is_kept_as_its_json_text():
    checked = checked_row("calls", {"call_id": "c", "model_requested": 5, "seq": 2**40, "stream": "yes"})
    assert (checked["model_requested"], checked["seq"], checked["stream"]) == ("5", None, None)
    assert checked_row("calls", {"model_requested": ["a", 1]})["model_requested"] == '["a", 1]'


def test_the_prefix_index_is_bounded_in_bytes():
    index = PrefixIndex(max_bytes=4000, calls_per_episode=2)
    for episode in range(50):
        for call in range(3):
            index.remember(f"e{episode}", f"c{episode}-{call}", pack_ids(list(range(100))))
    recent = index.recent
    assert recent.total <= 4000 and recent.total == sum(len(s) for calls in recent.episodes.values() for _, s in calls)
    assert index.split("e49", pack_ids(list(range(100)))) == ("c49-2", 100) and "e0" not in recent.episodes


def test_bad_store_uris_say_what_to_write(tmp_path):
    (tmp_path / "file").write_text("x")
    for uri, message in ((str(tmp_path / "file"), "is a file"), ("s3://", "names no bucket"),
                         ("s3://k:s@bucket/x", "AWS_ACCESS_KEY_ID"), ("ftp://x/y", "unsupported")):  # fmt: skip
        with pytest.raises(StoreError, match=message):
            open_store(uri)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_prepare_adds_and_strip_removes_exactly_the_additions(api):
    body: dict = {"model": "m", "stream": True}
    added = openai.prepare_request(api, body)
    assert body["return_token_ids"] is True and body["stream_options"] == {"include_usage": True}
    assert body["logprobs"] is (True if api == "chat" else 0) or body["logprobs"] == 0
    answer = {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [5], "logprobs": {"content": []}}]}
    openai.strip_response(answer, added)
    assert answer == {"prompt_token_ids": None, "choices": [{"index": 0, "token_ids": None, "logprobs": None}]}


def test_what_the_harness_asked_for_itself_is_kept():
    body = {"logprobs": True, "top_logprobs": 2, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    added = openai.prepare_request("chat", body)
    state = openai.StreamState(added)
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 1}})
    assert state.on_event(usage) is not None
    chunk = {"choices": [{"index": 0, "delta": {}, "token_ids": [3], "logprobs": {"content": [{"logprob": -1.0}]}}]}
    assert json.loads(state.on_event(json.dumps(chunk)) or "") == chunk


def test_the_stream_state_gathers_ids_logprobs_and_tool_calls():
    state = openai.StreamState(openai.prepare_request("chat", {"stream": True}))

    def tool_delta(arguments: str, **first: str) -> dict:
        return {
            "tool_calls": [
                {
                    "index": 0,
                    **({"id": first["id"]} if first else {}),
                    "function": {**({"name": first["name"]} if first else {}), "arguments": arguments},
                }
            ]
        }

    events = [
        {"id": "r1", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": tool_delta('{"a"', id="t", name="f"), "token_ids": [7, 8],
                      "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]}}]},
        {"choices": [{"index": 0, "delta": tool_delta(": 1}"), "token_ids": [9],
                      "logprobs": {"content": [{"logprob": -3.0}]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}},
    ]  # fmt: skip
    outs = [state.on_event(json.dumps(e)) for e in events]
    assert outs[-1] is None and state.on_event("[DONE]") == "[DONE]" and state.done
    s = state.sampled
    assert (s.prompt_ids, s.completion_ids, s.logprobs, s.finish_reason) == (
        [1, 2],
        [7, 8, 9],
        [-1.0, -2.0, -3.0],
        "tool_calls",
    )
    assert state.summary()["tool_calls"] == [{"id": "t", "name": "f", "arguments": '{"a": 1}'}]
    for out in (json.loads(o) for o in outs if o):
        assert out.get("prompt_token_ids") is None
        assert all(c.get("token_ids") is None and c.get("logprobs") is None for c in out["choices"])


def test_secrets_are_found_in_headers_and_scrubbed_from_bodies():
    basic = base64.b64encode(b"episode-7:hunter2-password").decode()
    headers = {"Authorization": "Bearer sk-abcdef123456", "Proxy-Authorization": f"Basic {basic}", "Accept": "x"}
    secrets = secrets_in_headers(headers)
    assert "sk-abcdef123456" in secrets and "hunter2-password" in secrets and "episode-7" not in secrets
    text = redacted_json({"api_key": "whatever", "messages": [{"content": "use sk-abcdef123456 please"}]}, secrets)
    assert "sk-abcdef123456" not in text and "whatever" not in text and text.count(REDACTED) == 2


def test_packed_ids_round_trip():
    assert array("i", pack_ids([1, -2, 2**31 - 1])).tolist() == [1, -2, 2**31 - 1]


def test_a_held_row_waits_for_its_late_value_and_the_rows_after_it_keep_their_order(tmp_path):
    writer, store = make_writer(tmp_path, max_age_s=0.0)
    held = writer.append("calls", row(0), hold=True)
    writer.append("calls", row(1))
    writer.cut_batches()
    assert writer.flush_batches() and stored_call_ids(store) == []  # nothing at or past the held row goes
    assert held is not None
    writer.complete(held, {"policy_version_end": "7"})
    writer.cut_batches()
    assert writer.flush_batches() and stored_call_ids(store) == ["c0", "c1"]
    table = open_store(store).read_table("calls")
    assert table is not None and table.column("policy_version_end").to_pylist() == ["7", None]
    writer.complete(held, {"policy_version_end": "8"})  # too late: counted, nothing changes
    assert writer.metrics.get("records_completed_late_total") == 1


def test_a_held_row_whose_value_never_comes_goes_on_after_the_hold(tmp_path, monkeypatch):
    monkeypatch.setattr("sidecar.writer.HOLD_S", 0.0)
    writer, store = make_writer(tmp_path, max_age_s=0.0)
    writer.append("calls", row(0), hold=True)
    writer.cut_batches()
    assert writer.flush_batches() and stored_call_ids(store) == ["c0"]
    assert writer.metrics.get("records_hold_expired_total") == 1


def test_a_version_after_the_call_that_takes_seconds_to_come_is_still_recorded(tmp_path):
    """A busy policy server can take seconds to say its version after a call (the question may wait 10 s): the
    row waits for it, so a call that straddled a publish never looks single-version."""
    import asyncio
    import http.server
    import threading
    from urllib.parse import urlparse

    from sidecar import version

    class SlowVersion(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(4.0)  # longer than the 3 s the WAL used to hold a row
            body = b'{"weight_version": "v-after"}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowVersion)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    writer, store = make_writer(tmp_path, max_age_s=0.0)
    url = urlparse(f"http://127.0.0.1:{server.server_address[1]}")
    clock = version.VersionClock(
        url, lambda rows, v: writer.complete_many(rows, {"policy_version_end": v})
    )  # as the addon
    try:
        held = writer.append("calls", row(0), hold=True)
        assert held is not None

        async def scenario() -> None:  # as the addon: the question after the call runs on the event loop
            clock.after(held)
            deadline = time.monotonic() + 15
            while not stored_call_ids(store) and time.monotonic() < deadline:
                writer.cut_batches()
                writer.flush_batches()
                await asyncio.sleep(0.1)

        asyncio.run(scenario())
        table = open_store(store).read_table("calls")
        assert table is not None and table.column("policy_version_end").to_pylist() == ["v-after"]
    finally:
        clock.stop()
        server.shutdown()
        server.server_close()


def test_the_typed_call_record_has_exactly_the_schema_columns():
    assert set(CallRecord.__annotations__) == {f.name for f in CALL_SCHEMA} - {"schema_version"}


def test_the_typed_reward_row_has_exactly_the_schema_columns_and_writes_as_built():
    assert set(RewardRow.__annotations__) == {f.name for f in REWARD_SCHEMA} - {"schema_version"}
    row = reward_row("e1", 1, "cli", call_id="c1", components={"tests": 2}, at=1_767_614_400_000_000)
    (written,) = to_table([row], "rewards").to_pylist()
    assert written["at"] == datetime(2026, 1, 5, 12, 0, tzinfo=UTC) and written["schema_version"] == 1
    assert (written["reward"], written["components"], written["call_id"]) == (1.0, [("tests", 2.0)], "c1")


def test_a_fresh_version_answer_serves_the_next_call_and_a_stale_one_is_asked_again(monkeypatch):
    """The version before a call: an answer to a question sent within FRESH_S stands (it was answered before the
    call is sent, so it is no newer than what serves the call); an older one is asked again, and a publish shows."""
    import asyncio
    from urllib.parse import urlparse

    from bench.fake_upstream import FakeUpstream
    from sidecar import version

    completed: list[tuple[list[int], str | None]] = []
    with FakeUpstream() as upstream:
        clock = version.VersionClock(urlparse(upstream.url), lambda rows, v: completed.append((rows, v)))
        try:

            async def scenario() -> list[str | None]:
                monkeypatch.setattr(version, "FRESH_S", 60.0)
                seen = [(await clock.before()).version, (await clock.before()).version]  # the second: the first's
                asked = upstream.weight_questions
                upstream.weight_version = "fake-2"  # a publish
                monkeypatch.setattr(version, "FRESH_S", 0.0)
                seen.append((await clock.before()).version)  # stale: asked again, the publish shows
                questions = upstream.weight_questions
                clock.after(7)  # the after question also feeds the answer the next call may use
                deadline = time.monotonic() + 10
                while not completed and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                return [*seen, str(asked), str(questions)]

            assert asyncio.run(scenario()) == ["fake-1", "fake-1", "fake-2", "1", "2"]
            assert completed == [([7], "fake-2")] and clock.known is not None and clock.known[1] == "fake-2"
        finally:
            clock.stop()


def test_at_shutdown_the_last_calls_get_their_version_after_and_an_answer_too_slow_releases_them():
    """The question after calls runs on the event loop: ``settle`` (the addon's ``done``, before the WAL closes)
    waits for the last calls' answer; one that does not come in time leaves their rows released, version unknown,
    at once (the WAL no longer waits its whole bound for an answer that cannot come), as are the rows of calls that
    end after it began."""
    import asyncio
    from urllib.parse import urlparse

    from bench.fake_upstream import FakeUpstream
    from sidecar import version

    completed: list[tuple[list[int], str | None]] = []
    with FakeUpstream() as upstream:
        clock = version.VersionClock(urlparse(upstream.url), lambda rows, v: completed.append((rows, v)))

        async def shutdown() -> None:
            clock.after(1)
            clock.after(2)  # ends before the question is sent: shares it
            await clock.settle(5.0)

        asyncio.run(shutdown())
        clock.stop()
    assert completed == [([1, 2], "fake-1")] and upstream.weight_questions == 1
    completed.clear()
    with FakeUpstream(weight_delay_s=3.0) as upstream:
        clock = version.VersionClock(urlparse(upstream.url), lambda rows, v: completed.append((rows, v)))

        async def hurried() -> float:
            clock.after(3)
            started = time.monotonic()
            await clock.settle(0.3)
            took = time.monotonic() - started
            clock.after(4)  # a call that ends while the sidecar stops: no question is left to come, released now
            await asyncio.sleep(0.1)
            return took

        assert asyncio.run(hurried()) < 1.0
        clock.stop()
    assert completed == [([3], None), ([4], None)] and clock.after_task is None and clock.waiting == []


def test_kept_alive_version_connections_the_server_closed_never_leave_a_version_unknown():
    """A policy server closes idle kept-alive connections (uvicorn after 5 s). With several of them pooled (calls
    at once asked at once), the retry must open a new connection, not take a second closed one."""
    import asyncio
    import socket
    from urllib.parse import urlparse

    from bench.fake_upstream import FakeUpstream
    from sidecar import version

    with FakeUpstream() as upstream, socket.create_server(("127.0.0.1", 0)) as closer:
        clock = version.VersionClock(urlparse(upstream.url), lambda rows, v: None)
        try:

            async def scenario() -> str | None:
                for _ in range(2):  # two pooled connections whose server end is gone
                    stale = await asyncio.open_connection(*closer.getsockname())
                    closer.accept()[0].close()
                    clock.idle.append(stale)
                await asyncio.sleep(0.05)
                return (await clock.before()).version

            assert asyncio.run(scenario()) == "fake-1"
        finally:
            clock.stop()


def test_a_version_answer_that_waits_for_a_long_engine_step_is_still_the_calls_version():
    """The cause of the demo's round-1 calls without a version (issue 25): vLLM answers /weight_info between engine
    steps, and a freshly started server's first steps took over 10 s; the question gave up at 10 s. A slow answer
    is the version all the same (the call waits for that step boundary anyway); a refused one says why."""
    import asyncio
    import socket
    from urllib.parse import urlparse

    from bench.fake_upstream import FakeUpstream
    from sidecar import version

    with FakeUpstream(weight_delay_s=11.0) as upstream:  # one long engine step: longer than the old 10 s bound
        clock = version.VersionClock(urlparse(upstream.url), lambda rows, v: None)
        try:
            assert asyncio.run(clock.before()) == ("fake-1", None)
        finally:
            clock.stop()
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    clock = version.VersionClock(urlparse(f"http://127.0.0.1:{port}"), lambda rows, v: None)
    try:
        asked = asyncio.run(clock.before())
        assert asked.version is None and "refused" in (asked.why or "")
    finally:
        clock.stop()


def test_a_version_answer_with_an_oversized_header_is_an_unknown_version_not_an_exception():
    """asyncio's readuntil raises LimitOverrunError (not an OSError) past 64 KiB: it must not escape into routing."""
    import asyncio
    import socket
    import threading
    from urllib.parse import urlparse

    from sidecar import version

    with socket.create_server(("127.0.0.1", 0)) as server:

        def answer() -> None:
            while True:  # every question (the clock asks once more on a new connection)
                try:
                    connection, _ = server.accept()
                except OSError:  # the test is over
                    return
                with connection:
                    connection.recv(4096)
                    connection.sendall(b"HTTP/1.1 200 OK\r\nx-padding: " + b"a" * 200_000 + b"\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        host, port = server.getsockname()
        clock = version.VersionClock(urlparse(f"http://{host}:{port}"), lambda rows, v: None)
        try:
            assert asyncio.run(clock.before()).version is None
        finally:
            clock.stop()


def test_after_a_crash_the_count_goes_on_from_the_records_whether_flushed_or_still_in_the_wal(tmp_path):
    """seq is counted in memory; a writer that dies without closing leaves records in the WAL or the store, and
    the next one counts on from the highest recorded seq of each episode."""
    crashed, _ = make_writer(tmp_path)
    assert [crashed.next_seq("e") for _ in range(3)] == [0, 1, 2]
    for n in range(3):
        crashed.append("calls", row(n, "e"))
    crashed.cut_batches(everything=True)
    assert crashed.flush_batches()  # e's records left the WAL: the episodes table holds its count
    assert [crashed.next_seq("w") for _ in range(2)] == [0, 1]
    for n in range(2):
        crashed.append("calls", {**row(10 + n, "w"), "seq": n})  # still in the WAL at the crash
    assert crashed.next_seq("never-recorded") == 0
    crashed.stopping.set()  # no close(): nothing is persisted on the way out
    again, _ = make_writer(tmp_path)
    assert again.next_seq("e") == 3 and again.next_seq("w") == 2
    assert again.next_seq("never-recorded") == 0  # no record carries it: the number may be handed out again
    assert again.close()


@settings(max_examples=200, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
))  # fmt: skip
def test_the_fast_json_codec_writes_and_reads_the_values_the_standard_library_does(value):
    """msgspec where it can, the standard library where it refuses (NaN, lone surrogates): every value reads back
    as the standard library reads it (integers of any size exact; a float may be spelled 1e16 for 1e+16)."""
    import json

    from sidecar import codec

    try:
        expected = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return
    ours = codec.dumps_text(value)
    # NaN and infinities are not JSON: written as null (the standard library writes NaN, which JSON readers refuse)
    assert json.loads(ours) == json.loads(expected, parse_constant=lambda _: None)
    with contextlib.suppress(UnicodeEncodeError):  # a lone surrogate has no UTF-8 form: encode() refuses it
        assert codec.dumps(value).decode() == ours
    parsed = codec.loads(expected)
    assert json.dumps(parsed, ensure_ascii=False, separators=(",", ":")) == expected


def test_the_fast_json_codec_takes_what_only_the_standard_library_reads():
    from sidecar import codec

    assert codec.loads(b'{"a": NaN, "b": -Infinity}')["b"] == float("-inf")
    assert codec.loads('"\\ud800"') == "\ud800"
    assert codec.dumps({"n": 1 << 70}) == b'{"n":1180591620717411303424}'
    assert codec.dumps({1: "x"}) == b'{"1":"x"}'


def test_identity_in_a_pod_ignores_and_counts_a_clients_relabel_and_outside_one_takes_it():
    from sidecar.identity import Rules, identify

    metrics = Metrics()
    pod = Rules("", "", "", trust_client=False, pod_episode="run.add.0", default_episode="s-default")
    claimed = {"x-forge-episode-id": "mine", "x-forge-task-id": "easy"}
    env = {"FORGE_TASK_ID": "add", "FORGE_RUN_ID": "run"}
    assert identify(pod, claimed, None, metrics, env) == ("run.add.0", "add", "run")
    assert identify(pod, {}, "mine;task=easy", metrics, env) == ("run.add.0", "add", "run")
    assert metrics.get("episode_relabel_refused_total") == 2
    local = Rules("", "", "", trust_client=False, pod_episode=None, default_episode="s-default")
    assert identify(local, {}, "ep-3;task=count", metrics, {}) == ("ep-3", "count", "default")
    assert identify(local, claimed, None, metrics, {}) == ("mine", "easy", "default")
    assert identify(local, {}, None, metrics, {}) == ("s-default", None, "default")
    operator = Rules("fixed", "t", "r", trust_client=False, pod_episode="run.add.0", default_episode="s-default")
    assert identify(operator, claimed, None, metrics, env) == ("fixed", "t", "r")


def test_the_policy_is_the_servers_only_adapter_else_its_base_and_never_falls_back_to_the_base():
    from sidecar.policy import announced_policy, policy_context

    base = {"id": "SmolLM2-135M-Instruct", "max_model_len": 16384, "parent": None}
    adapter = {"id": "forge-run7", "parent": "SmolLM2-135M-Instruct"}  # vLLM lists an adapter with no context
    other = {"id": "forge-run8", "parent": "SmolLM2-135M-Instruct"}
    assert announced_policy([base], None) == "SmolLM2-135M-Instruct"  # full weights: the server's model
    assert announced_policy([base, adapter], "SmolLM2-135M-Instruct") == "forge-run7"  # a LoRA run's v0 loaded
    assert announced_policy([base], "forge-run7") == "forge-run7"  # mid-publish (unloaded, not yet loaded): kept
    assert announced_policy([base, adapter, other], "forge-run7") == "forge-run7"  # ambiguous: never guessed
    assert policy_context([base, adapter], "forge-run7") == 16384  # the adapter's context is its base's
    assert policy_context([{"id": "x"}], "x") is None
