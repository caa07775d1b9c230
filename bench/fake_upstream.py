"""A fast stand-in for vLLM that answers fixed vLLM-shaped Chat Completions, for what a real vLLM cannot do.

Used where the proxy itself is measured (the benchmarks: a real model's latency would drown the proxy's) and
where failures must be injected on demand (tests: 5xx, a reset mid-stream, slow chunks). Token exactness is
always tested against the real vLLM; this server only answers in its shape, with ``prompt_token_ids``,
``token_ids`` and logprobs when asked. A request picks a behaviour with the header ``x-fake``:
``500``, ``reset-mid-stream``, ``slow`` (chunks 0.3 s apart), or nothing for a normal answer.

Run alone: python bench/fake_upstream.py PORT
"""

import collections
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMPLETION_IDS = [67, 93, 308, 60, 4153, 2]
PIECES = ["S", "m", "ol", "L", "AM", ""]


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """A deterministic token id per character of the messages (no tokenizer needed)."""
    text = "".join(str(m.get("content")) for m in body.get("messages") or [])
    return [1] + [32 + (ord(c) % 4000) for c in text]


def chat_answer(body: dict[str, Any]) -> dict[str, Any]:
    ids = bool(body.get("return_token_ids"))
    logprobs = {"content": [{"token": p, "logprob": -0.5, "bytes": [], "top_logprobs": []} for p in PIECES]}
    return {
        "id": f"chatcmpl-{time.monotonic_ns():x}", "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model"),
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": "".join(PIECES), "refusal": None},
            "logprobs": logprobs if body.get("logprobs") else None, "finish_reason": "stop", "stop_reason": 2,
            "token_ids": COMPLETION_IDS if ids else None,
        }],
        "usage": {"prompt_tokens": len(prompt_ids(body)), "completion_tokens": 6, "total_tokens": 0},
        "prompt_token_ids": prompt_ids(body) if ids else None,
    }  # fmt: skip


def chat_chunks(body: dict[str, Any]) -> list[dict[str, Any]]:
    ids = bool(body.get("return_token_ids"))
    base = {"id": f"chatcmpl-{time.monotonic_ns():x}", "object": "chat.completion.chunk", "created": 0,
            "model": body.get("model")}  # fmt: skip
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    chunks = [{**base, "choices": [first], "prompt_token_ids": prompt_ids(body) if ids else None}]
    for token, piece in zip(COMPLETION_IDS, PIECES, strict=True):
        last = token == COMPLETION_IDS[-1]
        lp = {"content": [{"token": piece, "logprob": -0.5, "bytes": [], "top_logprobs": []}]}
        chunks.append({**base, "choices": [{
            "index": 0, "delta": {} if last else {"content": piece}, "logprobs": lp if body.get("logprobs") else None,
            "finish_reason": "stop" if last else None, "token_ids": [token] if ids else None,
        }]})  # fmt: skip
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 6}})
    return chunks


# vLLM's rendering and detokenizing (sidecar/continuation.py asks them): the stand-in has none, as a server without
# them; continuation then leaves the call on the normal path (fail-open).
SIDE_PATHS = ("/render", "/detokenize", "/tokenize")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in separate writes: no 40 ms delayed-ACK stall

    def log_message(self, *args: Any) -> None:
        pass

    def handle_one_request(self) -> None:
        """With ``keep_alive_s`` set, a kept-alive connection whose next request comes after that much idle time is
        closed unanswered: what uvicorn (vLLM) does when its keep-alive timer fires while its busy event loop has
        not yet read a request that arrived (the race a proxy reusing idle connections loses)."""
        limit = self.server.keep_alive_s  # type: ignore[attr-defined]
        answered = getattr(self, "answered_at", None)
        if limit and answered is not None:
            head = self.rfile.peek(1)  # type: ignore[attr-defined]  # the next request's first bytes (or the EOF)
            if time.monotonic() - answered > limit:
                self.server.closed_idle.append(head.split(b"\r\n", 1)[0].decode("latin-1"))  # type: ignore[attr-defined]
                self.close_connection = True
                return
        super().handle_one_request()
        self.answered_at = time.monotonic()

    def send_json(self, code: int, value: Any) -> None:
        data = json.dumps(value, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.startswith("/v1/models"):
            model = {"id": "fake-policy", "object": "model", "max_model_len": 16384}  # vLLM's context, as the tests'
            self.send_json(200, {"object": "list", "data": [model]})
        elif self.path.startswith("/weight_info"):
            self.server.weight_questions += 1  # type: ignore[attr-defined]
            time.sleep(self.server.weight_delay_s)  # type: ignore[attr-defined]  # vLLM: after the engine step
            self.send_json(200, {"weight_version": self.server.weight_version})  # type: ignore[attr-defined]
        else:
            self.send_json(200, {"path": self.path, "upstream": "fake"})

    def do_POST(self) -> None:
        body_bytes = self.rfile.read(int(self.headers.get("content-length") or 0))
        requests = self.server.requests  # type: ignore[attr-defined]
        if len(requests) < 10_000:  # tests look at the last requests; benchmarks send many more
            requests.append({"path": self.path, "headers": dict(self.headers), "body": body_bytes})
        behaviour = self.headers.get("x-fake", "")
        if self.path.split("?", 1)[0].endswith(SIDE_PATHS):  # the sidecar's side questions (tokens-in): not served
            self.send_json(404, {"error": {"message": "not served by the stand-in", "type": "NotFound", "code": 404}})
            return  # a test's scripted answer is for the model call, never taken by these
        script = self.server.script  # type: ignore[attr-defined]
        if script:  # a test's exact answer: status, content type, body (an event stream is sent chunked)
            self.send_scripted(*script.popleft())
            return
        if behaviour == "slow-start":  # a long prefill: nothing for a while, then the answer
            time.sleep(float(self.headers.get("x-fake-seconds", "3")))
        if behaviour == "500":
            self.send_json(500, {"error": {"message": "injected failure", "type": "InternalServerError", "code": 500}})
            return
        try:
            body = json.loads(body_bytes)
        except ValueError:
            self.send_json(400, {"error": {"message": "invalid JSON", "type": "BadRequestError", "code": 400}})
            return
        if not body.get("stream"):
            answer = chat_answer(body)
            if behaviour == "null-logprob" and answer["choices"][0]["logprobs"]:
                answer["choices"][0]["logprobs"]["content"][2]["logprob"] = None  # not a sampled token's logprob
            self.send_json(200, answer)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        chunks = chat_chunks(body)
        for i, chunk in enumerate(chunks):
            if behaviour == "reset-mid-stream" and i == 3:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                self.connection.close()  # RST: the upstream dies mid-answer
                return
            if behaviour == "error-event" and i == 3:  # vLLM's way to end a stream that failed mid-way
                failure = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
                self.write_chunk(f"data: {json.dumps(failure)}\n\n".encode())
                break
            self.write_chunk(f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode())
            if behaviour == "slow":
                time.sleep(0.3)
        self.write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def send_scripted(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        if "event-stream" in content_type:
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            if body:
                self.write_chunk(body)
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


class Server(ThreadingHTTPServer):
    request_queue_size = 512  # 64 clients connect at once in the benchmarks


class FakeUpstream:
    def __init__(self, port: int = 0, weight_delay_s: float = 0.0, keep_alive_s: float = 0.0) -> None:
        self.server = Server(("127.0.0.1", port), Handler)
        self.server.weight_delay_s = weight_delay_s  # type: ignore[attr-defined]
        self.server.keep_alive_s = keep_alive_s  # type: ignore[attr-defined]  # 0: kept alive for ever
        self.server.closed_idle = []  # type: ignore[attr-defined]  # request lines closed on by keep_alive_s
        self.server.daemon_threads = True
        self.server.requests = []  # type: ignore[attr-defined]
        self.server.weight_version = "fake-1"  # type: ignore[attr-defined]
        self.server.weight_questions = 0  # type: ignore[attr-defined]
        self.server.script = collections.deque()  # type: ignore[attr-defined]

    @property
    def weight_questions(self) -> int:
        """How many times GET /weight_info was asked."""
        return self.server.weight_questions  # type: ignore[attr-defined]

    @property
    def closed_idle(self) -> list[str]:
        """The request lines (as far as read) of the kept-alive connections closed unanswered because they had
        idled past ``keep_alive_s``."""
        return self.server.closed_idle  # type: ignore[attr-defined]

    @property
    def weight_version(self) -> str:
        return self.server.weight_version  # type: ignore[attr-defined]

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self.server.weight_version = version  # type: ignore[attr-defined]

    def answer_next(self, status: int, content_type: str, body: bytes) -> None:
        """The next POST gets exactly this answer."""
        self.server.script.append((status, content_type, body))  # type: ignore[attr-defined]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def requests(self) -> list[dict[str, Any]]:
        return self.server.requests  # type: ignore[attr-defined]

    def __enter__(self) -> "FakeUpstream":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    with FakeUpstream(int(sys.argv[1]) if len(sys.argv) > 1 else 0) as upstream:
        print(upstream.url, flush=True)
        threading.Event().wait()
