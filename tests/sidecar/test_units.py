"""The sidecar's pieces without a proxy: SSE framing, prefix references, the WAL writer, stripping, redaction."""

import base64
import json
import random
from array import array
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sidecar.apis import openai
from sidecar.metrics import Metrics
from sidecar.prefix import PrefixIndex, common_prefix_len
from sidecar.redact import REDACTED, redacted_json, secrets_in_headers
from sidecar.sse import EventFramer, rewrite_event
from sidecar.store import StoreError, open_store
from sidecar.writer import RecordWriter, pack_floats, pack_ids, read_segment

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
    return RecordWriter(tmp_path / "wal", open_store(store), "sc-test", Metrics(), **kwargs), store


def row(n: int) -> dict:
    return {"call_id": f"c{n}", "episode_id": "e", "seq": n, "started_at": 1_800_000_000_000_000 + n,
            "prompt_suffix_ids": pack_ids(list(range(n))), "completion_token_ids": pack_ids([n, n + 1]),
            "completion_logprobs": pack_floats([-0.5, -0.25]), "status": "ok"}  # fmt: skip


def test_records_reach_parquet_with_ids_and_types_intact(tmp_path):
    writer, store = make_writer(tmp_path)
    for n in range(5):
        assert writer.append("calls", row(n))
    assert writer.close()
    table = open_store(store).read_table("calls")
    assert table is not None and table.num_rows == 5
    rows = sorted(table.to_pylist(), key=lambda r: r["seq"])
    assert [r["prompt_suffix_ids"] for r in rows] == [list(range(n)) for n in range(5)]
    assert rows[3]["completion_token_ids"] == [3, 4] and rows[3]["completion_logprobs"] == [-0.5, -0.25]
    assert rows[0]["started_at"].year == 2027 and rows[0]["schema_version"] == 1
    assert not list((tmp_path / "wal").glob("*.wal"))


def test_a_torn_tail_keeps_the_records_before_it_and_replay_reuses_the_file_name(tmp_path):
    writer, store = make_writer(tmp_path)
    for n in range(3):
        writer.append("calls", row(n))
    segment = next((tmp_path / "wal").glob("*.open"))
    segment.write_bytes(segment.read_bytes() + b"\x10\x00\x00\x00garbage")  # a crash mid-write
    assert [r["call_id"] for r in read_segment(segment)] == ["c0", "c1", "c2"]
    crashed = RecordWriter(tmp_path / "wal", open_store(store), "sc-test", Metrics())  # restart over the same WAL
    assert crashed.close()
    first = open_store(store).list_parquet("calls")
    assert len(first) == 1 and pq.read_table(first[0]).num_rows == 3


def test_past_the_disk_bound_records_are_dropped_and_counted(tmp_path):
    writer, _ = make_writer(tmp_path, max_disk_bytes=600)
    results = [writer.append("calls", row(n)) for n in range(20)]
    assert results[0] and not results[-1]
    assert writer.metrics.get("records_dropped_total") == results.count(False) > 0


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
