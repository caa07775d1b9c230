"""Request preparation: a model call's upstream request (the policy's model name, the completion bound, the token
ids asked, stored Responses resolved) and what its record says of the request, prepared whole before any of it
is applied (``addon.Forge._begin``), so that a failure half way never sends a half-prepared call."""

import json
import logging
from typing import Any

from mitmproxy import http

from sidecar import apis, codec, harness, identity
from sidecar.call import Call
from sidecar.metrics import Metrics
from sidecar.policy import upstream_headers
from sidecar.record import SAMPLING_KEYS
from sidecar.redact import redacted_text, secrets_in_body
from sidecar.replicas import Replica
from sidecar.response_store import ResponseStore, input_items
from sidecar.routing import Router

log = logging.getLogger("openforge.sidecar")

HOP_SECRETS = ("authorization", "x-api-key", "api-key")  # the policy server needs none of the harness's keys
_STRIPPED = tuple(name.encode() for name in (identity.EPISODE_HEADER, identity.TASK_HEADER, *HOP_SECRETS))
MAX_RECORDED_BODY = 4 << 20  # bodies bigger than this are recorded as a note, not copied


def prepare(
flow: http.HTTPFlow, call: Call, headers: dict[str, str], replica: Replica, router: Router, stored: ResponseStore,
metrics: Metrics,
) -> tuple[str, bytes] | None:  # fmt: skip
    """A model call's upstream path and body (the policy's model name, the completion bound, the ids asked),
    with what its record says of the request set on ``call``; None: it goes on as it came (not a JSON object,
    or not translatable: vLLM judges it). Reads the flow, changes none of it."""
    api = call.api
    try:
        content = flow.request.get_content(strict=True) or b""
        body = codec.loads(content)
        if not isinstance(body, dict):
            raise ValueError("the body is not a JSON object")
    except ValueError as error:  # malformed JSON, non-JSON content type, undecodable encoding
        call.error = f"request is not a JSON object ({type(error).__name__}); passed through unchanged"
        call.request_json = json.dumps({"note": "unparsable request", "bytes": len(flow.request.raw_content or b"")})
        call.harness = harness.detect(api, headers, None)
        return None
    call.secrets += secrets_in_body(body)
    call.harness = harness.detect(api, headers, body)
    size = len(content)
    # The record keeps the request as the harness sent it (redacted), not as the upstream got it.
    call.request_json = (
        redacted_text(content.decode("utf-8", "replace"), call.secrets)
        if size <= MAX_RECORDED_BODY
        else json.dumps({"note": "request body too large to copy", "bytes": size})
    )
    if apis.drop_internal_fields(body):
        metrics.inc("internal_fields_dropped_total")
    model = body.get("model")  # a harness may send any JSON here: a name that is not a string is kept as JSON
    call.model_requested = model if isinstance(model, str) or model is None else json.dumps(model)
    served = router.served_model(call.model_requested)
    if served:
        body["model"] = served
    call.policy_model = router.policy_model
    bound = apis.bound_completion(api, body, router.max_completion_tokens, replica.context)
    module = apis.module_for(api)
    # previous_response_id and item_reference resolved from this episode's answers; the call it extends by id
    if apis.spec(api).stateful and (continued := stored.resolve(call.episode_id, body)):
        flow.metadata["forge_continues"] = continued  # (tokens-in: sidecar/continuation.py)
    try:
        added = module.prepare_request(api, body)
    except ValueError as error:  # a request we cannot translate goes on as it came; vLLM judges it
        call.error = f"request not translated ({error}); passed through unchanged"
        return None
    if isinstance(added, apis.responses.Additions) and body.get("store") is not False:
        sent, kept = input_items(body.get("input")), stored

        def keep(answer: dict[str, Any]) -> None:  # never the call's failure: its answer and record go on
            try:
                kept.keep(call.episode_id, call.call_id, sent, answer)
            except Exception as error:  # the answer cannot be referred to later (404 then)
                metrics.inc("responses_not_kept_total")
                log.error("a Responses answer was not kept (%s: %s)", type(error).__name__, error)

        added.keep = keep
    prepared = (added.upstream_path or apis.spec(api).upstream_path(flow.request.path), codec.dumps(body))
    sampling = json.dumps({k: body[k] for k in SAMPLING_KEYS if k in body}, sort_keys=True)
    call.bound, call.module, call.added, call.sampling = bound, module, added, sampling  # last: nothing fails after
    return prepared


def strip_hop_secrets(flow: http.HTTPFlow) -> None:
    """The harness's keys and OpenForge's identity headers never reach the policy server (its own key may)."""
    present = {name.lower() for name, _ in flow.request.headers.fields}
    for name in _STRIPPED:
        if name in present:
            flow.request.headers.pop(name.decode(), None)
    flow.request.headers.update(upstream_headers())
