"""The policy server's one HTTP client (sidecar.policy.PolicyServerClient) against a stand-in server: keep-alive,
a connection the server closed meanwhile, timeouts, errors that say what happened, a raw exchange that passes an
HTTP error on, and the clients several threads share (PolicyServerClients)."""

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sidecar.policy import PolicyServerClient, PolicyServerClients, PolicyServerError
from trainer.serve import free_port


class StandIn(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.connections = 0
        self.seen: list[tuple[str, str, bytes]] = []
        self.close_after_answer = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StandIn

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def log_message(self, *args: object) -> None:
        pass

    def answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.server.close_after_answer:
            self.close_connection = True

    def do_GET(self) -> None:
        self.server.seen.append(("GET", self.path, b""))
        if self.path == "/weight_info":
            self.answer(200, b'{"weight_version": "7"}')
        elif self.path.startswith("/slow"):
            time.sleep(float(self.path.partition("?")[2] or 2))
            self.answer(200, b"{}")
        else:
            self.answer(404, b'{"detail": "Not Found"}')

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.seen.append(("POST", self.path, body))
        if self.path == "/v1/completions" and len(self.server.seen) > 1:  # began to answer, then the server died
            self.send_response(200)
            self.send_header("content-length", "100")
            self.end_headers()
            self.wfile.write(b'{"choi')
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()  # a reset mid-answer
            self.close_connection = True
        elif self.path == "/v1/load_lora_adapter":
            self.answer(200, b"Success: LoRA adapter loaded.", "text/plain")
        elif self.path == "/resume":
            self.answer(200, b"")
        else:
            self.answer(400, b'{"error": "no such adapter"}')


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_requests_share_one_kept_alive_connection_and_answers_come_as_json_text_or_none(stand_in):
    client = PolicyServerClient(f"{stand_in.url}/v1/")
    assert client.base_url == stand_in.url
    assert client.get("/weight_info") == {"weight_version": "7"}
    assert client.post("/v1/load_lora_adapter", {"lora_name": "a"}) == "Success: LoRA adapter loaded."
    assert client.post("/resume") is None
    assert stand_in.connections == 1
    assert stand_in.seen[1] == ("POST", "/v1/load_lora_adapter", json.dumps({"lora_name": "a"}).encode())
    client.close()


def test_a_connection_the_server_closed_meanwhile_is_replaced_silently(stand_in):
    client = PolicyServerClient(stand_in.url)
    stand_in.close_after_answer = True  # the server closes after answering, without saying so in its headers
    assert client.get("/weight_info") == {"weight_version": "7"}
    time.sleep(0.1)
    assert client.get("/weight_info") == {"weight_version": "7"}
    assert stand_in.connections == 2


def test_an_http_error_says_the_route_the_status_and_the_body(stand_in):
    client = PolicyServerClient(stand_in.url)
    with pytest.raises(PolicyServerError, match="refused /v1/unload_lora_adapter: HTTP 400") as refused:
        client.post("/v1/unload_lora_adapter", {"lora_name": "a"})
    assert (refused.value.status, refused.value.body) == (400, '{"error": "no such adapter"}')
    assert client.request("GET", "/nothing") == (404, b'{"detail": "Not Found"}')  # the status, for a caller to judge


def test_a_server_that_does_not_answer_in_time_or_is_not_there_is_one_error_without_a_status(stand_in):
    client = PolicyServerClient(stand_in.url, timeout=0.3)
    started = time.monotonic()
    with pytest.raises(PolicyServerError, match="did not answer in time") as late:
        client.get("/slow")
    assert time.monotonic() - started < 1.5 and late.value.status is None
    assert client.get("/slow", timeout=5) == {}  # a longer bound for one request
    with pytest.raises(PolicyServerError, match="is unreachable") as down:
        PolicyServerClient(f"http://127.0.0.1:{free_port()}").get("/weight_info")
    assert down.value.status is None


def test_an_exchange_sends_the_body_as_it_is_and_gives_an_http_error_as_an_answer(stand_in):
    client = PolicyServerClient(stand_in.url)
    status, headers, body = client.exchange("POST", "/v1/chat/completions", b'{"a": 1}', 5, {"x-k": "v"})
    assert (status, headers.get("content-type"), body) == (400, "application/json", b'{"error": "no such adapter"}')
    assert stand_in.seen[-1] == ("POST", "/v1/chat/completions", b'{"a": 1}')
    status, headers, body = client.exchange("POST", "/v1/load_lora_adapter", b"{}")
    assert (status, headers.get("content-type")) == (200, "text/plain") and stand_in.connections == 1
    client.close()


def test_clients_of_several_threads_do_not_wait_for_each_other_and_stay_alive(stand_in):
    clients = PolicyServerClients(stand_in.url, timeout=5)
    started = time.monotonic()
    threads = [threading.Thread(target=clients.get, args=("/slow?0.5",)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert time.monotonic() - started < 1.5  # four at once, not one after another (2 s)
    assert stand_in.connections == 4
    for _ in range(3):
        assert clients.get("/weight_info") == {"weight_version": "7"}  # on one of the four kept connections
    assert stand_in.connections == 4
    clients.close()


def test_a_request_whose_answer_began_is_not_sent_again(stand_in):
    """A kept-alive connection the server reset *after* it began to answer ran the request: a generation must not
    run twice (only a connection closed before any answer is replaced and the request sent again)."""
    client = PolicyServerClient(stand_in.url)
    assert client.get("/weight_info") == {"weight_version": "7"}  # the connection is now a reused one
    with pytest.raises(PolicyServerError, match="unreachable"):
        client.post("/v1/completions", {"prompt": [1], "max_tokens": 8})
    assert [seen[1] for seen in stand_in.seen] == ["/weight_info", "/v1/completions"]
    client.close()


def test_the_servers_key_goes_with_every_request_of_a_pool(stand_in, monkeypatch):
    from sidecar.policy import upstream_headers

    seen: list[str | None] = []
    original = Handler.do_GET

    def remember(handler: Handler) -> None:
        seen.append(handler.headers.get("authorization"))
        original(handler)

    monkeypatch.setattr(Handler, "do_GET", remember)
    monkeypatch.setenv("FORGE_UPSTREAM_API_KEY", "policy-key")
    pool = PolicyServerClients(stand_in.url, headers=upstream_headers())
    assert pool.get("/weight_info") == {"weight_version": "7"}
    assert seen == ["Bearer policy-key"]  # the health poll's questions too (vLLM --api-key answers 401 without)
    pool.close()
