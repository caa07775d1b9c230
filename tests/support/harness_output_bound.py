"""TEST-ONLY (a mitmdump script, never part of the sidecar): bound a harness's answers that the harness cannot bound.

Codex CLI 0.171 has no setting for its answers' length (no ``model_max_output_tokens`` in its config; its Responses
requests carry no ``max_output_tokens``), and SmolLM2-135M, a tiny sampling model, does not end its turn at Codex's
long prompt: each answer would run to the policy server's context, minutes per call on a CPU. So the Codex test puts
this reverse proxy between Codex and the sidecar. It adds ``max_output_tokens`` to a Responses request that sets
none — the field a harness with such a setting would send — and changes nothing else; the sidecar runs with no flags
beyond its endpoint, and records (and serves) the bound as the harness's own.

    mitmdump --mode reverse:SIDECAR_URL -s tests/support/harness_output_bound.py --set output_bound=96
"""

import json
from typing import Any

from mitmproxy import ctx, http


def load(loader: Any) -> None:
    loader.add_option("output_bound", int, 96, "max_output_tokens added to a Responses request that sets none.")


def request(flow: http.HTTPFlow) -> None:
    if flow.request.method != "POST" or not flow.request.path.split("?", 1)[0].rstrip("/").endswith("/responses"):
        return
    body = json.loads(flow.request.get_content(strict=True) or b"{}")
    if isinstance(body, dict) and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = ctx.options.output_bound
        flow.request.content = json.dumps(body, ensure_ascii=False).encode()


def responseheaders(flow: http.HTTPFlow) -> None:
    assert flow.response is not None
    flow.response.stream = True  # SSE passed on live
