"""Hostile and odd input: the client gets what the upstream sent, the sidecar stays up, model-call errors are
recorded. Failures a real vLLM cannot produce on demand (5xx, a reset mid-stream) come from bench/fake_upstream."""

import gzip
import json
import socket

import brotli
import httpx
import pytest
import zstandard

from bench.fake_upstream import FakeUpstream
from tests.support.sidecar import read_calls, wait_for

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def records(sidecar, n: int) -> list[dict]:
    return wait_for(lambda: len(read_calls(sidecar.store)) >= n and read_calls(sidecar.store), what=f"{n} records")


def still_up(sidecar) -> None:
    """The sidecar still serves a call (bounded: unbounded, the real model may sample until its context is full)."""
    answer = httpx.post(f"{sidecar.url}{CHAT}", json={**BODY, "max_tokens": 8}, timeout=30)
    assert answer.status_code == 200 and sidecar.process.poll() is None


def test_malformed_and_non_json_bodies_reach_vllm_unchanged(start_sidecar, policy_server, vllm):
    sidecar = start_sidecar(policy_server.base_url)
    for content, content_type in ((b'{"model": "x", "messages": [', "application/json"), (b"hello", "text/plain")):
        headers = {"content-type": content_type}
        through = httpx.post(f"{sidecar.url}{CHAT}", content=content, headers=headers, timeout=30)
        direct = vllm.post(CHAT, content=content, headers=headers)
        assert (through.status_code, through.json()) == (direct.status_code, direct.json())
    calls = records(sidecar, 2)
    assert {c["status"] for c in calls} == {"upstream_error"}
    assert all("not a JSON object" in c["error"] for c in calls)


def test_a_20_mb_body_and_an_upstream_4xx_pass_through(start_sidecar, policy_server, vllm):
    sidecar = start_sidecar(policy_server.base_url)
    huge = {"model": policy_server.name, "messages": [{"role": "user", "content": "x" * (20 << 20)}], "max_tokens": 1}
    through = httpx.post(f"{sidecar.url}{CHAT}", json=huge, timeout=120)
    direct = vllm.post(CHAT, json=huge)
    assert through.status_code == direct.status_code and 400 <= through.status_code < 500
    assert through.json()["error"]["type"] == direct.json()["error"]["type"]
    (call,) = records(sidecar, 1)
    assert call["status"] == "upstream_error" and call["http_status"] == through.status_code
    assert "too large" in call["request_json"]


@pytest.mark.parametrize("encoding", ["gzip", "br", "zstd"])
def test_encoded_request_bodies_are_decoded_for_the_upstream(start_sidecar, fake_upstream, encoding):
    sidecar = start_sidecar(fake_upstream.url)
    raw = json.dumps(BODY).encode()
    packed = {"gzip": gzip.compress, "br": brotli.compress, "zstd": zstandard.ZstdCompressor().compress}[encoding](raw)
    answer = httpx.post(f"{sidecar.url}{CHAT}", content=packed, timeout=30,
                        headers={"content-type": "application/json", "content-encoding": encoding})  # fmt: skip
    assert answer.status_code == 200
    assert "content-encoding" not in fake_upstream.requests[-1]["headers"]
    (call,) = records(sidecar, 1)
    assert call["status"] == "ok" and call["completion_token_ids"]


def test_upstream_5xx_is_passed_on_and_recorded(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url)
    answer = httpx.post(f"{sidecar.url}{CHAT}", json=BODY, headers={"x-fake": "500"}, timeout=30)
    assert answer.status_code == 500 and answer.json()["error"]["message"] == "injected failure"
    (call,) = records(sidecar, 1)
    assert call["status"] == "upstream_error" and "injected failure" in call["error"]
    still_up(sidecar)


def test_an_upstream_reset_mid_stream_gives_a_truncated_record(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url)
    seen = []
    with pytest.raises(httpx.HTTPError), httpx.stream("POST", f"{sidecar.url}{CHAT}", json={**BODY, "stream": True},
                      headers={"x-fake": "reset-mid-stream"}, timeout=30) as answer:  # fmt: skip
        for line in answer.iter_lines():
            seen.append(line)
    assert any(line.startswith("data: ") for line in seen), "the chunks before the reset reached the client"
    (call,) = records(sidecar, 1)
    assert call["status"] == "truncated" and call["stream"]
    assert call["prompt_token_ids"] and 0 < len(call["completion_token_ids"]) < 6
    still_up(sidecar)


def test_a_client_that_hangs_up_mid_stream_gives_a_truncated_record(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url)
    request = json.dumps({**BODY, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", sidecar.port), timeout=10) as sock:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-fake: slow\r\ncontent-type: application/json\r\n"
        sock.sendall(head + b"content-length: %d\r\n\r\n%s" % (len(request), request))
        received = b""
        while b"data: " not in received:  # the first chunk arrives live, then we hang up
            piece = sock.recv(65536)
            assert piece, "the sidecar closed the connection before the first chunk"
            received += piece
    (call,) = records(sidecar, 1)
    assert call["status"] == "truncated" and len(call["completion_token_ids"]) < 6
    still_up(sidecar)


def test_non_model_traffic_passes_through_unrecorded(start_sidecar, fake_upstream):
    with FakeUpstream() as other:
        sidecar = start_sidecar(fake_upstream.url, mode="regular")
        with httpx.Client(proxy=sidecar.url, timeout=30) as http:
            got = http.get(f"{other.url}/some/page?q=1")
            posted = http.post(f"{other.url}{CHAT}", json=BODY)  # a model path, but not a model host
            modelled = http.post(f"{fake_upstream.url}{CHAT}", json=BODY)
        assert got.json() == {"path": "/some/page?q=1", "upstream": "fake"}
        assert posted.status_code == 200 and "return_token_ids" not in json.loads(other.requests[-1]["body"])
        assert modelled.status_code == 200
        (call,) = records(sidecar, 1)
        assert call["host"] == fake_upstream.url.removeprefix("http://")


def test_a_stream_ending_with_an_error_event_and_a_null_logprob_are_never_recorded_ok(start_sidecar, fake_upstream):
    """The harness gets what the upstream sent; the record says the upstream failed, or that a logprob it gave
    is not one (and where), instead of ``ok``."""
    sidecar = start_sidecar(fake_upstream.url)
    with httpx.stream("POST", f"{sidecar.url}{CHAT}", json={**BODY, "stream": True},
                      headers={"x-fake": "error-event"}, timeout=30) as answer:  # fmt: skip
        events = [line for line in answer.iter_lines() if line.startswith("data:")]
    assert "engine died" in events[-2] and events[-1] == "data: [DONE]"
    whole = httpx.post(f"{sidecar.url}{CHAT}", json=BODY, headers={"x-fake": "null-logprob"}, timeout=30)
    assert whole.status_code == 200
    failed, null = records(sidecar, 2)
    assert failed["status"] == "upstream_error" and "engine died" in failed["error"]
    assert null["status"] == "error" and "position(s) 2" in null["error"] and null["n_unknown_logprobs"] == 1
    still_up(sidecar)


def raw_post(sidecar, target: str, body: dict) -> tuple[int, dict]:
    """POST with this request target sent byte for byte (an HTTP client would drop a ``#...`` part)."""
    content = json.dumps(body).encode()
    head = (f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1:{sidecar.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(content)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", sidecar.port), timeout=60) as connection:
        connection.sendall(head + content)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    try:
        return int(status_line.split()[1]), json.loads(payload or b"null")
    except ValueError:
        return int(status_line.split()[1]), {"raw": payload[:200].decode("utf-8", "replace")}


def test_a_path_ending_like_a_model_route_reaches_no_other_policy_route(start_sidecar, policy_server, vllm):
    """The agent's shell can send any request target. vLLM drops a ``#...`` part, so a target that *ends* like a
    routed model path (``/v1/messages/count_tokens``: served, not recorded) once reached whatever came before the
    ``#``: the policy server's admin routes (``/pause`` stalls every rollout) and unrecorded samples. The policy is
    sent each API's own path, never the client's."""
    sidecar = start_sidecar(policy_server.base_url)
    try:
        status, _ = raw_post(sidecar, "/pause#/v1/messages/count_tokens", BODY)
        assert vllm.get("/is_paused").json()["is_paused"] is False, "the agent paused the policy server"
        status, answer = raw_post(sidecar, f"{CHAT}#/v1/messages/count_tokens", BODY)
        assert "choices" not in answer, f"an unrecorded sample was served ({status}): {answer}"
        counted = httpx.post(f"{sidecar.url}/v1/messages/count_tokens", json={**BODY, "max_tokens": 8}, timeout=120)
        assert counted.status_code == 200 and "input_tokens" in counted.json()  # the real route is still served
    finally:
        vllm.post("/resume")
    still_up(sidecar)
    assert all(c["path"] == CHAT for c in records(sidecar, 1))
