"""A TLS site of the test's "internet" namespace: answers any request with JSON naming itself, logs each request.

Run: python tls_site.py HOST CERT KEY LOG ADDRESS... (port 443 on each address; IPv6 addresses too)
"""

import json
import socket
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    host, cert, key, log_path, *addresses = sys.argv[1:]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            with lock, open(log_path, "a") as log:
                log.write(f"{self.command} {self.path}\n")
            body = json.dumps({"site": host, "method": self.command, "path": self.path}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def get_request(self):
            conn, address = self.socket.accept()
            return context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False), address

        def handle_error(self, request, client_address) -> None:
            pass  # a client that rejects our certificate is expected in some tests

    class Server6(Server):
        address_family = socket.AF_INET6

    servers = [(Server6 if ":" in a else Server)((a, 443), Handler) for a in addresses]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    servers[0].serve_forever()


if __name__ == "__main__":
    main()
