"""`forge inject serve`: the mutating admission webhook over HTTPS, a thin shell around `k8s.inject.review`.

Two paths, one per entry of the MutatingWebhookConfiguration (k8s/manifests/webhook.yaml): the API server calls
`/inject/namespace-enabled` for pods of namespaces labelled `openforge.io/inject=enabled` (its namespaceSelector
decided that, so the webhook needs no permission to read namespaces) and `/inject` for pods that opt in
themselves. `GET /healthz` answers the kubelet's probes. Nothing about a request is logged but its outcome.
"""

import json
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from forge.errors import ForgeError
from k8s.inject import review
from k8s.settings import InjectorSettings

NAMESPACE_LABELS = {"/inject": None, "/inject/namespace-enabled": "enabled"}
MAX_BODY = 8 << 20  # the API server's own request limit is 3 MiB for an object; a review wraps one


class WebhookServer:
    def __init__(
        self, host: str, port: int, cert: Path, key: Path, settings: InjectorSettings, log: Any = None
    ) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as error:
            raise ForgeError(f"cannot load the serving certificate {cert} / key {key}: {error}") from error
        log = log or (lambda line: print(line, file=sys.stderr, flush=True))

        class Handler(BaseHTTPRequestHandler):
            timeout = 15  # a client that stalls mid-request loses its thread after this many seconds

            def log_message(self, *args: Any) -> None:  # pods' specs may hold secrets in env: no access log
                pass

            def reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/healthz":
                    self.reply(200, {"ok": True})
                else:
                    self.reply(404, {"error": f"no such endpoint: GET {self.path}"})

            def do_POST(self) -> None:
                path = self.path.split("?", 1)[0]
                if path not in NAMESPACE_LABELS:
                    self.reply(404, {"error": f"no such endpoint: POST {path}"})
                    return
                length = int(self.headers.get("content-length") or 0)
                if length > MAX_BODY:
                    self.reply(413, {"error": "the AdmissionReview is too large"})
                    return
                answer = review(self.rfile.read(length), NAMESPACE_LABELS[path], settings)
                response = answer["response"]
                outcome = "patched" if "patch" in response else "allowed" if response["allowed"] else "denied"
                detail = response.get("status", {}).get("message", "")
                log(f"forge inject: {response['uid'] or '-'} {outcome}{': ' + detail if detail else ''}")
                self.reply(200, answer)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        # The handshake happens in the request's own thread (on first read), never in the accept loop.
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> "WebhookServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="forge-inject", daemon=True)
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
