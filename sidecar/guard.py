"""The policy guard: a policy server that cannot be reached, or answers an error that is not JSON, never shows the
harness an internal address or an HTML page; the harness gets its own API's JSON error and the call is recorded.
"""

import asyncio
from typing import TYPE_CHECKING

from mitmproxy import http

from sidecar.apis.errors import error_body, error_headers
from sidecar.metrics import Metrics

if TYPE_CHECKING:
    from sidecar.call import Call


class PolicyGuard:
    """Policy server down: the harness gets its API's JSON error (no internal address), and the call is recorded.

    mitmproxy answers a failed upstream connection itself, with an HTML page naming the address, and no hook can
    replace that page. So while the policy server is not known to be up (the poller says so, or a call to it
    failed), each model call first tries to connect, and a refusal is answered here. Known up, no probe is made
    (it would cost a connection per call): a server that dies between two polls (2 s) can still get one call
    mitmproxy's own page before the guard notices.
    """

    connect_timeout_s = 5.0

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.reachable: bool | None = None  # what the last model call to the policy server showed

    async def request(self, flow: http.HTTPFlow) -> None:
        call: Call | None = flow.metadata.get("forge_call")
        if call is None or flow.response is not None:
            return
        if self.metrics.get("upstream_up") == 1 and self.reachable is not False:
            return
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(flow.request.host, flow.request.port), self.connect_timeout_s
            )
            writer.close()
        except (OSError, TimeoutError) as error:
            self.reachable = False
            call.error = f"the policy server is unreachable ({type(error).__name__})"
            flow.metadata["forge_answered"] = True
            flow.response = http.Response.make(
                502, error_body(call.api, 502, "The policy server is unavailable; the call was recorded as failed.",
                                "policy_unavailable"),
                error_headers(call.api),
            )  # fmt: skip

    def error(self, flow: http.HTTPFlow) -> None:
        if "forge_call" in flow.metadata and flow.response is None:
            self.reachable = False  # the next model calls probe first

    def response(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        api = flow.metadata.get("forge_api")
        if api is None or response is None:
            return
        if "forge_call" in flow.metadata and not flow.metadata.get("forge_answered"):
            self.reachable = True
        if response.status_code < 400:
            return
        if "json" in response.headers.get("content-type", "") or "text/event-stream" in response.headers.get(
            "content-type", ""
        ):
            return
        message = f"The policy server answered {response.status_code} {response.reason}."
        response.headers.pop("content-encoding", None)
        for name, value in error_headers(api).items():
            response.headers[name] = value
        response.content = error_body(api, response.status_code, message)
