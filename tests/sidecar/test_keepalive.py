"""A harness call is not lost to the policy server closing an idle kept-alive connection (sidecar/keepalive.py).

The stand-in upstream closes, unanswered, a kept-alive connection whose next request comes after 2.5 s of idle
time: what vLLM's uvicorn does at its 5 s keep-alive when its busy event loop reads a request only after the timer
fired. A harness that keeps its own connection to the sidecar alive and pauses between calls (every agent loop)
hit it: its call came back 502 "server closed connection" and its record said error (Qwen Code in CI)."""

import time

import httpx
import pytest

from bench.fake_upstream import FakeUpstream
from tests.support.sidecar import read_calls, wait_for

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.mark.integration
def test_a_call_after_a_pause_gets_a_fresh_policy_connection_and_is_served(start_sidecar):
    with FakeUpstream(keep_alive_s=2.5) as upstream:
        sidecar = start_sidecar(upstream.url)  # the default idle bound (2 s): no setting a user would have to know
        with httpx.Client(base_url=sidecar.url, timeout=30) as harness:  # one kept-alive connection, as SDKs keep
            answers = [harness.post(CHAT, json=BODY)]
            time.sleep(3.0)  # the agent runs a tool
            answers += [harness.post(CHAT, json=BODY), harness.post(CHAT, json=BODY)]
        assert [a.status_code for a in answers] == [200, 200, 200], [a.text[:200] for a in answers]
        calls = wait_for(lambda: len(read_calls(sidecar.store)) >= 3 and read_calls(sidecar.store), what="3 records")
        assert [c["status"] for c in calls] == ["ok", "ok", "ok"], [c["error"] for c in calls]
        lost = [line for line in upstream.closed_idle if CHAT in line]  # the health poll's client may lose its own
        assert not lost, f"a call was sent on a connection the server had given up: {lost}"
