"""Request records grow linearly: through the real sidecar (`forge sidecar`, mitmdump) a 30-turn Claude-Code-shaped
conversation stores each later request as the part it does not share with the one before, and the collector's
``calls`` view (DuckDB over the real Parquet) gives every request back exactly as the harness sent it.

The upstream is the fast stand-in (bench/fake_upstream.py): what is measured is storage, not the model.
"""

import json

import pytest

from bench.request_records import conversation, send, stored_requests
from tests.support.sidecar import wait_for

pytestmark = pytest.mark.integration
TURNS = 30


def test_a_30_turn_conversation_stores_linear_request_bytes_and_reads_back_exactly(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url)
    bodies = conversation(TURNS)
    for body in bodies:
        send(sidecar.url, body)
    calls = wait_for(lambda: (c := stored_requests(sidecar.store)) and len(c) == TURNS and c, what="30 records")
    print(f"{'turn':>4} {'sent chars':>10} {'stored chars':>12}")
    for turn, call in enumerate(calls):
        print(f"{turn:>4} {len(call['whole']):>10} {len(call['stored']):>12}")

    # Read back exactly: the calls view's request_json is the text the harness sent, character for character.
    assert [c["whole"] for c in calls] == [json.dumps(body) for body in bodies]
    # Linear: each later request is stored as a reference to the one before and its new turn (a tool result of a
    # few hundred characters, the previous answer, the moved cache marker and the new billing line), a size that
    # does not grow with the conversation, while the whole request grows by about that much every turn.
    assert calls[0]["parent"] is None and calls[0]["stored"] == calls[0]["whole"]
    later = calls[1:]
    assert all(c["parent"] == p["call_id"] for p, c in zip(calls, later, strict=False))
    stored = [len(c["stored"]) for c in later]
    growth = [len(b["whole"]) - len(a["whole"]) for a, b in zip(calls, later, strict=False)]
    assert max(stored) < 2 * min(growth), (stored, growth)
    assert max(stored) - min(stored) < 100, stored  # flat: bytes per turn, not per conversation
    assert sum(len(c["stored"]) for c in calls) < 0.1 * sum(len(c["whole"]) for c in calls)
