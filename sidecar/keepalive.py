"""Kept-alive connections to the policy replicas, never reused once idle long enough for the server to close them.

An HTTP/1 server closes a kept-alive connection it has not heard from for a while (vLLM's uvicorn: 5 s,
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``). A request sent on it just as the server closes it is lost: the server reads it
after its timer fired (its event loop was busy, as a policy server's is) and closes the connection without an
answer; mitmproxy does not retry (a connection can only be seen closed by reading it) and the harness gets a 502
"server closed connection" — a call the harness would not have lost talking to the server directly, since the
sidecar's own work (preparing the request, committing the record) lengthens the idle time the server sees. So a
call's connection to its replica is reused only while it has been idle for less than ``upstream_idle_seconds``
(well under the server's keep-alive); past that the call gets a new connection and the idle one is left to the
server to close.

mitmproxy has no hook to choose the upstream connection: its HTTP layer reuses any open connection of the client's
connection to the same address. A connection whose read side is closed is not reused ("at least half-closed
already, we want a new one"), so marking it so retires it; when the server then closes it mitmproxy closes it too.
A retired connection stays open until the server closes it (vLLM: 5 s idle), so this assumes a policy server that
closes idle connections, as uvicorn does; against one that never does, each pause of a long-lived client connection
would leave one open until the client's connection ends.
"""

import time
from typing import Any

from mitmproxy import http
from mitmproxy.connection import ConnectionState

from sidecar.metrics import Metrics


class IdleUpstreams:
    """The policy connection each client connection last ended a call on, by replica address, and since when."""

    def __init__(self, metrics: Metrics, idle_s: float = 2.0) -> None:
        self.metrics = metrics
        self.idle_s = idle_s
        self.ended: dict[str, dict[tuple[str, int], tuple[Any, float]]] = {}  # client id -> address -> (conn, since)

    def call_ended(self, flow: http.HTTPFlow) -> None:
        """The flow's answer ended (or failed): its connection is idle from now."""
        server = flow.server_conn
        if server is not None and server.connected and server.address is not None:
            self.ended.setdefault(flow.client_conn.id, {})[tuple(server.address)] = (server, time.monotonic())

    def before_send(self, flow: http.HTTPFlow) -> None:
        """Called last before mitmproxy picks the flow's connection: an idle one too old for its replica is
        retired, so a new one is opened."""
        if flow.response is not None or not flow.request.http_version.startswith("HTTP/1"):
            return  # answered here, or an HTTP/2 client (mitmproxy gives each of its calls a new connection)
        last = self.ended.get(flow.client_conn.id, {}).pop((flow.request.host, flow.request.port), None)
        if last is None:
            return
        server, since = last
        if server.connected and time.monotonic() - since >= self.idle_s:
            server.state = ConnectionState.CAN_WRITE  # its read side taken as closed: mitmproxy opens a new one
            self.metrics.inc("upstream_idle_connections_retired_total")

    def client_gone(self, client_id: str) -> None:
        self.ended.pop(client_id, None)
