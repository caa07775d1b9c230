"""Transparent mode's decisions: which TLS connections the sidecar opens and which it passes through untouched.

In a pod every outbound 80/443 connection of the harness arrives here (`forge net-init`). A TLS connection is
opened (decrypted with our CA, served from the policy and recorded) only when its SNI names a model host; any
other connection, and one without SNI, is passed through as raw TCP to its original destination, so the client
checks that server's own certificate and nothing of it is read or recorded. Model hosts are matched by name
(SNI or Host), never by address: in a pod without internet the model host need not resolve to anything real.

Fail closed (what happens when a part is down while the rules are in place):
- The sidecar is down: connections to 80/443 are refused (the REDIRECT target has no listener); nothing bypasses
  recording, the harness sees its usual connection error and retries or fails.
- The policy server is down: the harness gets an error in its API's format (``sidecar.apis.errors``), status
  502, and the call is recorded with status ``upstream_error``; the original model host is never tried instead.
"""

INTERCEPT = "intercept"
PASSTHROUGH = "passthrough"


def model_host_names(hosts: str) -> set[str]:
    """``--model-hosts`` (comma-separated, optional :port) as lowercase names."""
    return {h.strip().lower().rstrip(".") for h in hosts.split(",") if h.strip()}


def is_model_host(name: str | None, port: int | None, model_hosts: set[str]) -> bool:
    if not name:
        return False
    name = name.lower().rstrip(".")
    return name in model_hosts or (port is not None and f"{name}:{port}" in model_hosts)


def tls_decision(sni: str | None, port: int | None, model_hosts: set[str]) -> str:
    """Open a TLS connection only for a model host named in its SNI; pass every other one through."""
    return INTERCEPT if is_model_host(sni, port, model_hosts) else PASSTHROUGH


def preferred_alpn(client_offers: "list[bytes] | tuple[bytes, ...]", http2: bool) -> bytes | None:
    """The protocol to answer an opened connection's ALPN with, as a real model host would: h2 when offered.

    mitmproxy otherwise takes the client's first choice, and httpx/httpcore offer "http/1.1" before "h2" even
    when configured for HTTP/2 only (it then speaks h2 over a connection negotiated as HTTP/1.1).
    """
    if http2 and b"h2" in client_offers:
        return b"h2"
    return None
