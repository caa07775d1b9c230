"""Each harness's quirks as golden pairs, in the style of Linkerd's injector fixtures: ``golden/<case>.request.json``
is a request as the real harness sent it (redacted, long texts cut; its ``note`` says where it came from) and
``golden/<case>.upstream.json`` what the policy server receives from the real sidecar (`forge sidecar`, mitmdump)
for it, with the harness the record names. `FORGE_UPDATE_GOLDEN=1` rewrites the upstream files (then read the diff
before committing it).

The upstream is the stand-in (bench/fake_upstream.py, which says its context is 16384 tokens, as the test vLLM's):
what is compared is the request the policy server gets, not an answer.
"""

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from sidecar.apis import api_for
from sidecar.harness import detect
from tests.support.sidecar import read_calls, wait_for

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(p.name.removesuffix(".request.json") for p in GOLDEN.glob("*.request.json"))


def received(upstream_request: dict[str, Any]) -> dict[str, Any]:
    return {"path": upstream_request["path"], "body": json.loads(upstream_request["body"])}


def test_every_case_has_both_files():
    assert len(CASES) >= 15
    assert {p.name.removesuffix(".upstream.json") for p in GOLDEN.glob("*.upstream.json")} == set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_each_harness_is_known_by_its_own_request(case):
    """Every captured harness is labelled from its request alone (no operator setting), as its golden says."""
    sent = json.loads((GOLDEN / f"{case}.request.json").read_text())
    expected = json.loads((GOLDEN / f"{case}.upstream.json").read_text())["harness"]
    assert detect(api_for("POST", sent["path"]) or "", sent["headers"], sent["body"], environ={}) == expected
    assert expected not in ("other", None)


@pytest.mark.integration
def test_the_policy_server_receives_the_golden_request_and_the_record_names_the_harness(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url, episode_id=None)
    got: dict[str, dict[str, Any]] = {}
    for case in CASES:
        sent = json.loads((GOLDEN / f"{case}.request.json").read_text())
        before = len(fake_upstream.requests)
        httpx.post(f"{sidecar.url}{sent['path']}", json=sent["body"], timeout=30,
                   headers={**sent["headers"], "x-forge-episode-id": case})  # fmt: skip
        assert len(fake_upstream.requests) == before + 1, case
        got[case] = received(fake_upstream.requests[-1])
    calls = wait_for(lambda: (c := read_calls(sidecar.store)) and len(c) == len(CASES) and c, what="the records")
    for call in calls:
        got[call["episode_id"]]["harness"] = call["harness"]
    for case in CASES:
        expected_file = GOLDEN / f"{case}.upstream.json"
        if os.environ.get("FORGE_UPDATE_GOLDEN"):
            expected_file.write_text(json.dumps(got[case], indent=2, ensure_ascii=False) + "\n")
    assert {case: got[case] for case in CASES} == {
        case: json.loads((GOLDEN / f"{case}.upstream.json").read_text()) for case in CASES
    }


def test_the_evidence_comes_in_order_operator_harness_shape_sdk():
    mini = json.loads((GOLDEN / "mini-swe-agent.request.json").read_text())
    assert detect("chat", mini["headers"], mini["body"], environ={}) == "mini-swe-agent"
    assert detect("chat", mini["headers"], None, environ={}) == "openai-python"  # the user agent alone
    assert detect("chat", mini["headers"], mini["body"], environ={"FORGE_HARNESS": "my-agent"}) == "my-agent"
    assert detect("responses", {"originator": "codex_exec"}, {}, environ={}) == "codex"
    # The OpenAI Agents SDK for JavaScript (its own user agent over the openai package's; tests/sidecar/clients/)
    assert detect("responses", {"user-agent": "Agents/JavaScript 0.20.0"}, {"input": []}, environ={}) == "openai-agents"
    assert detect("chat", {"user-agent": "python-httpx/0.28"}, {"messages": []}, environ={}) == "other"
    assert detect("chat", {}, {"messages": "not a list"}, environ={}) is None
