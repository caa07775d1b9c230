"""Records you can trust, through the real sidecar (mitmdump + the addon): restarts, odd input, the version per call,
a clean stop with calls in flight. The policy server is the real vLLM where token ids must line up across calls,
else the fake upstream (bench/fake_upstream.py), whose answers and weight version a test sets exactly."""

import contextlib
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector.assemble import assemble
from sidecar.store import open_store
from sidecar.writer import pending_records
from tests.support.sidecar import read_calls, wait_for

pytestmark = pytest.mark.integration


def stored_calls(store: str) -> list[dict]:
    table = open_store(store).read_table("calls")
    return table.to_pylist() if table is not None else []


def chat(base_url: str, model: object = "policy", stream: bool = False, headers: dict | None = None) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": stream}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def test_a_restart_keeps_every_call_in_order_and_a_linear_conversation_stays_one_segment(
    start_sidecar, policy_server, tmp_path
):
    """The reproduction: 3 calls, Ctrl-C, start again on the same folders, 3 more calls: 6 of 6, seq 0..5."""
    wal = tmp_path / "wal"
    prompt = [1, 9690, 28, 1838, 9]  # token ids: each call's prompt is the last prompt + its completion + more
    seen: list[int] = []
    for _ in range(2):
        sidecar = start_sidecar(policy_server.base_url, wal_dir=wal, episode_id="conversation")
        for _ in range(3):
            answer = httpx.post(f"{sidecar.url}/v1/completions", timeout=120, json={
                "model": "policy", "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
            })  # fmt: skip
            assert answer.status_code == 200, answer.text
            completion = answer.json()["choices"][0]["token_ids"]
            prompt = prompt + completion + [198, 1838 + len(seen)]
            seen.append(len(completion))
        assert sidecar.stop() == 0, sidecar.log()
    calls = read_calls(sidecar.store)
    assert [c["seq"] for c in calls] == [0, 1, 2, 3, 4, 5] and all(c["status"] == "ok" for c in calls)
    assert len({c["call_id"] for c in calls}) == 6
    segments, episodes = assemble(open_store(sidecar.store).read_table("calls"))
    assert segments.num_rows == 1, segments.column("fork_reason").to_pylist()
    assert episodes.column("n_calls").to_pylist() == [6]


def test_odd_model_names_are_answered_and_every_later_call_reaches_the_store_while_the_sidecar_runs(
    start_sidecar, fake_upstream
):
    sidecar = start_sidecar(fake_upstream.url)
    odd = [5, ["a", 1], {"name": "x"}, 2.5, True]
    for model in odd:
        assert chat(sidecar.url, model=model).status_code == 200
    for _ in range(3):
        assert chat(sidecar.url, stream=True).status_code == 200
    calls = wait_for(lambda: len(stored_calls(sidecar.store)) == 8 and stored_calls(sidecar.store), timeout=20,
                     what="all 8 calls in the store, with the sidecar still running")  # fmt: skip
    by_seq = sorted(calls, key=lambda c: c["seq"])
    assert [c["model_requested"] for c in by_seq[:5]] == ["5", '["a", 1]', '{"name": "x"}', "2.5", "true"]
    assert all(c["status"] == "ok" for c in calls)
    assert sidecar.metrics()["store_up"] == 1 and sidecar.metrics().get("records_quarantined_total", 0) == 0


def test_every_call_is_recorded_with_the_version_that_served_it_and_a_straddling_call_is_marked(
    start_sidecar, fake_upstream
):
    sidecar = start_sidecar(fake_upstream.url)
    assert chat(sidecar.url).status_code == 200
    # The version after a call is asked just after it ended (off the event loop): a publish within that instant
    # would mark the call as straddling (conservative). Publish once its record is complete, as a trainer does.
    wait_for(lambda: len(stored_calls(sidecar.store)) == 1, what="the first call's record")
    fake_upstream.weight_version = "fake-2"  # a publish: the very next call must say so (no poll window)
    assert chat(sidecar.url).status_code == 200
    straddling: dict = {}

    def slow_stream() -> None:
        straddling["answer"] = chat(sidecar.url, stream=True, headers={"x-fake": "slow"})

    thread = threading.Thread(target=slow_stream)
    thread.start()
    wait_for(lambda: len(fake_upstream.requests) == 3, what="the slow call to reach the upstream")
    time.sleep(0.5)  # the stream is under way
    fake_upstream.weight_version = "fake-3"
    thread.join(30)
    assert straddling["answer"].status_code == 200
    assert chat(sidecar.url).status_code == 200
    calls = wait_for(lambda: len(stored_calls(sidecar.store)) == 4 and stored_calls(sidecar.store), what="4 calls")
    versions = [(c["policy_version"], c["policy_version_end"]) for c in sorted(calls, key=lambda c: c["seq"])]
    assert versions == [("fake-1", "fake-1"), ("fake-2", "fake-2"), ("fake-2", "fake-3"), ("fake-3", "fake-3")]


def test_a_call_in_prefill_at_sigterm_is_answered_recorded_and_flushed_before_exit(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url)
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(
        chat(sidecar.url, stream=True, headers={"x-fake": "slow-start", "x-fake-seconds": "3"})))  # fmt: skip
    thread.start()
    wait_for(lambda: fake_upstream.requests, what="the call to reach the upstream")
    started = time.monotonic()
    assert sidecar.stop() == 0, sidecar.log()
    thread.join(30)
    assert time.monotonic() - started < 15
    assert answers and answers[0].status_code == 200 and "[DONE]" in answers[0].text
    [call] = stored_calls(sidecar.store)
    assert call["status"] == "ok" and call["completion_token_ids"] and pending_records(sidecar.wal_dir) == 0


def test_a_call_still_running_at_the_drain_bound_is_recorded_as_cut(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url, extra=("--drain-seconds", "1"))

    def cut_call() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the sidecar hangs up on it: that is the point
            chat(sidecar.url, stream=True, headers={"x-fake": "slow-start", "x-fake-seconds": "8"})

    thread = threading.Thread(target=cut_call)
    thread.start()
    wait_for(lambda: fake_upstream.requests, what="the call to reach the upstream")
    assert sidecar.stop() == 0, sidecar.log()
    [call] = stored_calls(sidecar.store)
    assert call["status"] == "truncated" and "cut at shutdown" in call["error"]
    thread.join(15)


def test_a_stop_that_leaves_records_in_the_wal_says_so_and_exits_non_zero(start_sidecar, fake_upstream, s3_server):
    store = f"s3://{s3_server.bucket}/forge"
    sidecar = start_sidecar(fake_upstream.url, store=store, extra=("--s3-endpoint", s3_server.endpoint))
    s3_server.stop()
    assert all(chat(sidecar.url).status_code == 200 for _ in range(3))
    assert sidecar.stop(timeout=60) == 3
    assert "3 records are still in the write-ahead log" in sidecar.log()
    assert pending_records(sidecar.wal_dir) == 3
    s3_server.start()
    again = start_sidecar(fake_upstream.url, store=store, wal_dir=sidecar.wal_dir,
                          extra=("--s3-endpoint", s3_server.endpoint))  # fmt: skip
    wait_for(lambda: pending_records(sidecar.wal_dir) == 0, timeout=30, what="the WAL to drain")
    assert again.stop() == 0


# -- property: whatever a harness sends and an upstream answers, the sidecar stays up and later calls are stored --
# Finite floats: NaN is valid in Python's JSON but never equal to itself, so "the same answer" could not be checked.
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
# Keys of the four wire APIs, given any type; never the keys the sidecar adds and strips (then the answer differs).
request_keys = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "input",
        "max_tokens",
        "max_output_tokens",
        "stream",
        "tools",
        "system",
        "n",
        "logprobs",
        "stream_options",
        "include",
        "temperature",
    ]
)
answer_keys = st.sampled_from(["id", "object", "model", "choices", "usage", "output", "content", "type", "status",
                               "error", "stop_reason", "created"])  # fmt: skip
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}  # fmt: skip


@st.composite
def exchanges(draw):
    api = draw(st.sampled_from(sorted(PATHS)))
    request = draw(st.dictionaries(request_keys, json_values, max_size=6))
    if draw(st.booleans()):
        request["stream"] = True
    status = draw(st.sampled_from([200, 200, 200, 400, 500]))
    answer = draw(st.dictionaries(answer_keys, json_values, max_size=5))
    if request.get("stream") is True and status == 200:
        # No "usage" key in events: a usage-only chunk is one the sidecar asked for, and drops, by design.
        event_keys = answer_keys.filter(lambda key: key != "usage")
        events = draw(st.lists(st.dictionaries(event_keys, json_values, max_size=4), max_size=4))
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + draw(st.sampled_from(["data: [DONE]\n\n", ""]))
        return api, request, status, "text/event-stream", body.encode()
    return api, request, status, "application/json", json.dumps(answer).encode()


def sse_payloads(body: bytes) -> list[object]:
    payloads = [line[5:].strip() for line in body.decode().splitlines() if line.startswith("data:")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


@pytest.fixture
def property_sidecar(start_sidecar, fake_upstream):
    return start_sidecar(fake_upstream.url, extra=("--flush-seconds", "0.05")), fake_upstream


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(exchange=exchanges())
def test_any_request_and_answer_leave_the_sidecar_up_and_the_next_normal_call_stored(property_sidecar, exchange):
    sidecar, upstream = property_sidecar
    api, request, status, content_type, body = exchange
    upstream.answer_next(status, content_type, body)
    answer = httpx.post(f"{sidecar.url}{PATHS[api]}", json=request, timeout=30)
    if api != "messages":  # the three OpenAI APIs are passed on as the upstream sent them (Messages is translated)
        assert answer.status_code == status
        if content_type == "application/json":
            assert answer.json() == json.loads(body)
        else:  # event by event (the sidecar writes the JSON it re-encodes compactly)
            assert sse_payloads(answer.content) == sse_payloads(body)
    marker = f"after-{time.monotonic_ns()}"
    normal = httpx.post(f"{sidecar.url}/v1/chat/completions", timeout=30, json={
        "model": "policy", "messages": [{"role": "user", "content": marker}], "max_tokens": 4})  # fmt: skip
    assert normal.status_code == 200
    wait_for(lambda: any(marker in (c["request_json"] or "") for c in stored_calls(sidecar.store)), timeout=10,
             what="the normal call after an odd one in the store")  # fmt: skip
    assert sidecar.process.poll() is None
