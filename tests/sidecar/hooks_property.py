"""Run in the sidecar's environment (mitmproxy): the addon's real hooks, in-process, fed odd JSON for every wire API
(``property``), or one of the named cases (``CASES``).

``tests/sidecar/test_hooks_property.py`` runs this file with the sidecar's Python (hypothesis made importable
beside it); it exits non-zero with the falsifying example when a property fails. For every call:
- the request that goes upstream is either fully prepared (the policy's model name, the API's upstream path, the
  token-id fields asked, the completion bound within the context, no field that steers vLLM's internals) or the
  harness's original (its path and its bytes), routed to the policy server either way;
- the call ends in exactly one record in the real write-ahead log, whatever the upstream answers.
No server is started: the policy version and the replica's context are fixed, tokens-in is off.
"""

import asyncio
import json
import socket
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mitmproxy import http
from mitmproxy.connection import Server
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.test import taddons, tflow, tutils

from sidecar.addon import Forge
from sidecar.apis import MAX_TOKEN_FIELDS
from sidecar.continuation import Decision
from sidecar.replicas import ReplicaSet, parse_upstreams
from sidecar.store import open_store
from sidecar.writer import RecordWriter

POLICY = "policy-under-training"
CONTEXT = 4096
UPSTREAM = ("127.0.0.1", 9)  # never connected to: the hooks alone are driven
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "messages": "/v1/messages?beta=true"}  # fmt: skip
UPSTREAM_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
                  "messages": "/v1/chat/completions"}  # fmt: skip
ASKED = {"chat": "return_token_ids", "completions": "return_token_ids", "responses": "enable_response_messages",
         "messages": "return_token_ids"}  # fmt: skip
INTERNAL = ("kv_transfer_params", "cache_salt", "priority", "vllm_xargs")  # the harness's, never sent on

# Text as a harness may send it: lone surrogate escapes included (JavaScript writes them for a string cut mid-pair).
texts = st.one_of(st.text(max_size=8), st.sampled_from(["\ud83d", "tool output cut \ud83d", "\udc00x", "You are"]))
odd = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)


def either(normal: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(normal, odd)


def fields(required: dict[str, st.SearchStrategy[Any]], optional: dict[str, st.SearchStrategy[Any]]) -> Any:
    return st.fixed_dictionaries({k: either(v) for k, v in required.items()},
                                 optional={k: either(v) for k, v in optional.items()})  # fmt: skip


bounds = {name: st.integers(1, 200_000) | st.sampled_from([100.0, "100"]) for name in
          ("max_tokens", "max_completion_tokens", "max_output_tokens")}  # fmt: skip
chat_messages = st.lists(
    fields({"role": st.sampled_from(["system", "user", "assistant", "developer"]), "content": texts}, {}), max_size=3
)
function_tool = fields({"type": st.just("function"), "name": texts}, {"parameters": st.just({"type": "object"})})
internal = {name: odd for name in INTERNAL}
BODIES = {
    "chat": fields({"model": texts, "messages": chat_messages},
                   {"stream": st.booleans(), "tools": st.lists(fields({"type": st.just("function"),
                    "function": function_tool}, {}), max_size=2), "logprobs": st.booleans(), **internal,
                    "max_tokens": bounds["max_tokens"], "max_completion_tokens": bounds["max_completion_tokens"]}),
    "completions": fields({"model": texts, "prompt": texts}, {"stream": st.booleans(), "max_tokens":
                          bounds["max_tokens"], **internal}),
    "responses": fields({"model": texts, "input": st.lists(either(fields({"role": st.sampled_from(["user",
                         "developer"]), "content": texts}, {})), max_size=3)},
                        {"instructions": texts, "tools": st.lists(function_tool, max_size=3), "stream": st.booleans(),
                         "include": st.just([]), "max_output_tokens": bounds["max_output_tokens"], **internal}),
    "messages": fields({"model": texts, "max_tokens": bounds["max_tokens"], "messages": st.lists(fields(
                        {"role": st.sampled_from(["user", "assistant"]), "content": either(st.lists(fields(
                            {"type": st.just("text"), "text": texts}, {}), max_size=2))}, {}), max_size=3)},
                       {"system": either(st.lists(fields({"type": st.just("text"), "text": texts}, {}), max_size=2)),
                        "stream": st.booleans(), "tools": st.lists(fields({"name": texts, "input_schema":
                        st.just({"type": "object"})}, {}), max_size=2), **internal}),
}  # fmt: skip
episode_headers = st.one_of(st.none(), st.binary(min_size=1, max_size=6), st.just(b"ep-\xff\xfe"))
# What the upstream does with the call: an answer (whole or streamed), an error, or a reset connection.
outcomes = st.sampled_from(["ok", "ok_stream", "error_json", "error_html", "reset"])


def answer(api: str, outcome: str) -> http.Response | None:
    if outcome == "reset":
        return None
    if outcome == "error_json":
        return tutils.tresp(status_code=400, headers=http.Headers(content_type="application/json"),
                            content=b'{"error":{"message":"bad request"}}')  # fmt: skip
    if outcome == "error_html":
        return tutils.tresp(status_code=502, headers=http.Headers(content_type="text/html"), content=b"<html>")
    whole: dict[str, Any]
    events: list[dict[str, Any]]
    if api == "responses":
        whole = {"id": "resp_1", "object": "response", "model": POLICY, "status": "completed", "output": [],
                 "input_messages": [{"tokens": [1, 2]}], "output_messages": [{"tokens": [3]}]}  # fmt: skip
        events = [{"type": "response.completed", "response": whole}]
    else:
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": "stop",
            "token_ids": [3],
            "logprobs": {"content": [{"token": "x", "logprob": -0.5}], "token_logprobs": [-0.5]},
        }
        message = {"role": "assistant", "content": "x"}
        whole = {"id": "c1", "model": POLICY, "prompt_token_ids": [1, 2],
                 "choices": [{**choice, "message": message, "text": "x"}]}  # fmt: skip
        events = [{"id": "c1", "model": POLICY, "prompt_token_ids": [1, 2], "choices": [{**choice, "delta": message}]}]
    if outcome == "ok":
        return tutils.tresp(headers=http.Headers(content_type="application/json"), content=json.dumps(whole).encode())
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return tutils.tresp(headers=http.Headers(content_type="text/event-stream"), content=body.encode())


def check_upstream(api: str, flow: http.HTTPFlow, original_path: str, original: bytes, whole: bool) -> None:
    request = flow.request
    assert (request.host, request.port) == UPSTREAM, f"sent to {request.host}:{request.port}, not the policy"
    assert "authorization" not in request.headers, "the harness's key went upstream"
    if (request.path, request.raw_content) == (original_path, original) and not whole:
        return  # the original, untouched
    body = json.loads(request.raw_content or b"")  # prepared: all of it
    assert request.path == UPSTREAM_PATHS[api], f"body prepared but path {request.path!r}"
    assert body.get("model") == POLICY, f"model {body.get('model')!r}"
    assert body.get(ASKED[api]) is True, f"{ASKED[api]} not asked"
    served_api = "chat" if api == "messages" else api
    for name in MAX_TOKEN_FIELDS[served_api]:
        value = body.get(name)
        assert not isinstance(value, int) or value <= CONTEXT, f"{name}={value} above the context"
    assert not set(INTERNAL) & set(body), f"internal fields sent on: {set(INTERNAL) & set(body)}"


def make_forge(tmp: Path) -> tuple[Forge, RecordWriter, taddons.context]:
    forge = Forge()
    tctx = taddons.context(forge)
    tctx.configure(forge, forge_tokens_in="off")
    writer = RecordWriter(tmp / "wal", open_store(str(tmp / "store")), forge.metrics)
    forge.relay.writer, forge.relay.sidecar_id, forge.router.writer = writer, writer.sidecar_id, writer
    forge.router.policy_version = forge.relay.policy_version = "7"
    forge.router.policy_model, forge.router.tokens_in_mode = POLICY, "off"
    forge.model_hosts = {"api.openai.com", "api.anthropic.com"}
    forge.router.model_map = [("*", "")]
    forge.router.replicas = ReplicaSet(parse_upstreams(f"http://{UPSTREAM[0]}:{UPSTREAM[1]}"))
    forge.router.replicas.all()[0].context = CONTEXT
    return forge, writer, tctx


def records_of(writer: RecordWriter, call_id: str) -> list[dict[str, Any]]:
    rows = writer.db.execute("SELECT fields FROM records WHERE tbl = 'calls'").fetchall()
    return [fields for (text,) in rows if (fields := json.loads(text))["call_id"] == call_id]


async def model_call(forge: Forge, api: str, content: bytes, headers: http.Headers) -> http.HTTPFlow:
    """A harness's HTTPS call of the wire API to its model host, through the request hooks."""
    host = "api.anthropic.com" if api == "messages" else "api.openai.com"
    request = tutils.treq(host=host, port=443, scheme=b"https", method=b"POST", path=PATHS[api].encode(),
                          authority=host.encode(), headers=headers, content=content)  # fmt: skip
    flow = tflow.tflow(req=request)
    forge.requestheaders(flow)
    await forge.request(flow)
    return flow


async def one_call(forge: Forge, writer: RecordWriter, api: str, content: bytes, episode: bytes | None,
                   outcome: str, whole: bool = False) -> None:  # fmt: skip
    """One call through the hooks; ``whole``: a request the sidecar must prepare (not pass on as it came)."""
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-harness")]
    if episode is not None:
        headers.append((b"x-forge-episode-id", episode))
    flow = await model_call(forge, api, content, http.Headers(headers))
    call = flow.metadata.get("forge_call")
    assert call is not None, "a model call was never begun (it cannot be recorded)"
    if flow.response is None:  # sent upstream
        check_upstream(api, flow, PATHS[api], content, whole)
        flow.response = answer(api, outcome)
        if flow.response is None:
            flow.error = tflow.terr()
            forge.error(flow)
        else:
            forge.responseheaders(flow)
            if callable(flow.response.stream):  # mitmproxy passes the body through the stream function
                body = flow.response.stream(flow.response.raw_content or b"") + flow.response.stream(b"")
                flow.response.raw_content = b"".join(body) if isinstance(body, list) else body
            await forge.response(flow)
    else:  # answered by the sidecar: the API's own JSON error
        assert flow.response.status_code >= 400 and json.loads(flow.response.content or b"")
        await forge.response(flow)
    found = records_of(writer, call.call_id)
    assert len(found) == 1, f"{len(found)} records for one call"
    assert call.call_id not in forge.relay.in_flight, "the call is still in flight"


# The triggers found by hand, each once before the search and each to be prepared whole: a lone surrogate, a
# non-string system text, a tool whose name is a list, a non-UTF-8 episode header, vLLM-internal fields.
TRIGGERS = {
    "lone surrogate in a body": ("messages", {"model": "claude-x", "max_tokens": 128000, "messages": [
        {"role": "user", "content": "tool output cut \ud83d"}]}, None),
    "non-string system text": ("messages", {"model": "claude-x", "max_tokens": 128000, "system": [
        {"type": "text", "text": 5}], "messages": [{"role": "user", "content": "hi"}]}, None),
    "tool name a list": ("responses", {"model": "gpt-x", "input": "hi", "max_output_tokens": 128000, "tools": [
        {"type": "function", "name": ["a"]}, {"type": "function", "name": ["a"]}]}, None),
    "non-UTF-8 episode header": ("chat", {"model": "gpt-x", "max_tokens": 128000, "messages": [
        {"role": "user", "content": "hi"}]}, b"ep-\xff\xfe"),
    # Issue 21, item 2: vLLM's own fields from the harness never reach it (its prompt ids, cache salt, priority).
    "vLLM-internal fields": ("responses", {"model": "gpt-x", "input": "hi", "kv_transfer_params": {
        "prompt_token_ids": [1, 2, 3]}, "cache_salt": "v0", "priority": -100, "vllm_xargs": {"a": 1}}, None),
}  # fmt: skip


def closed_port() -> int:
    """A loopback port nothing listens on (a policy server that went away)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def tokens_in_call(forge: Forge, answer_status: int, port: int | None = None) -> http.HTTPFlow:
    """A chat call as if served tokens-in, its answer an error; the policy server then gone, or the replica at
    ``port`` (the call's own: asked again by its replica's kept-alive clients)."""
    body = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}]}
    flow = await model_call(forge, "chat", json.dumps(body).encode(), http.Headers(content_type="application/json"))
    call = flow.metadata["forge_call"]
    original = flow.request.content or b""
    call.continuation = Decision("tokens_in", original_path=flow.request.path, original_body=original,
                                 inner_added=call.added)  # fmt: skip
    if port is not None:
        call.replica = ReplicaSet(parse_upstreams(f"http://127.0.0.1:{port}")).all()[0]
    flow.request.path, flow.request.port = "/v1/completions", port or closed_port()
    flow.response = tutils.tresp(status_code=answer_status, headers=http.Headers(content_type="application/json"),
                                 content=b'{"error":{"message":"from the tokens-in path"}}')  # fmt: skip
    forge.responseheaders(flow)
    await forge.response(flow)
    return flow


async def tokens_in_fallback_unreachable(forge: Forge, writer: RecordWriter) -> None:
    """Issue 21, item 7: the tokens-in answer is an error tokens-in could have caused (400), and the normal path
    cannot be reached: the harness gets its API's 502, and the call is recorded. An answer tokens-in cannot have
    caused (503) is passed on and recorded, never asked again."""
    for status, expected in ((400, 502), (503, 503)):
        flow = await tokens_in_call(forge, status)
        call = flow.metadata["forge_call"]
        assert flow.response is not None and flow.response.status_code == expected, flow.response
        assert json.loads(flow.response.content or b"")["error"]["message"]
        (record,) = records_of(writer, call.call_id)
        assert record["http_status"] == expected and record["status"] in ("error", "upstream_error"), record
        assert call.call_id not in forge.relay.in_flight, "the call is still in flight"


class Busy(BaseHTTPRequestHandler):
    """A policy server whose normal path answers an HTTP error (what it was asked is kept)."""

    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.server.asked.append((self.path, self.rfile.read(int(self.headers.get("content-length", 0)))))
        body = b'{"error":{"message":"busy"}}'
        self.send_response(503)
        self.send_header("content-type", "application/json; charset=utf-8")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


async def tokens_in_fallback_http_error(forge: Forge, writer: RecordWriter) -> None:
    """Issue 22, item 5: the normal path asked again (through the policy server client) answers an HTTP error: the
    harness gets that answer as it is (status, body, content type), recorded."""
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    server.asked = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        flow = await tokens_in_call(forge, 400, server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
    call = flow.metadata["forge_call"]
    assert server.asked == [(call.continuation.original_path, call.continuation.original_body)], server.asked
    assert flow.response is not None and flow.response.status_code == 503, flow.response
    assert flow.response.content == b'{"error":{"message":"busy"}}'
    assert flow.response.headers["content-type"] == "application/json; charset=utf-8"
    (record,) = records_of(writer, call.call_id)
    assert record["http_status"] == 503, record


async def replica_move_bounds_again(forge: Forge, writer: RecordWriter) -> None:
    """Issue 21, item 8: a call bounded for a replica with a large context, moved (its replica refuses the
    connection) to one with a smaller context, is bounded again for that one (else vLLM refuses it)."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        small = listening.getsockname()[1]
        forge.router.replicas = ReplicaSet(
            parse_upstreams(f"http://127.0.0.1:{closed_port()},http://127.0.0.1:{small}")
        )
        large, smaller = forge.router.replicas.all()
        if large.port == small:
            large, smaller = smaller, large
        large.context, smaller.context = 8192, 2048
        forge.router.replicas.served("episode-moved", large)
        body = {"model": "claude-x", "max_tokens": 128000, "messages": [{"role": "user", "content": "hi"}]}
        headers = http.Headers(content_type="application/json", x_forge_episode_id="episode-moved")
        flow = await model_call(forge, "messages", json.dumps(body).encode(), headers)
        assert flow.request.port == large.port and json.loads(flow.request.content or b"")["max_tokens"] == 8192
        await forge.server_connect(ServerConnectionHookData(Server(address=("127.0.0.1", large.port)),
                                                            flow.client_conn))  # fmt: skip
    sent = json.loads(flow.request.content or b"")
    assert flow.request.port == small, "not moved"
    assert sent["max_tokens"] <= 2048, f"moved with the bound of the replica it left: {sent['max_tokens']}"
    call = flow.metadata["forge_call"]
    assert call.bound.context == 2048 and call.bound.requested == 128000 and call.moved_from == large.url


async def replicas_that_leave_dns_are_forgotten(forge: Forge, writer: RecordWriter) -> None:
    """Issue 21, item 10: when DNS no longer lists a replica, its version clock (stopped), tokens-in client and
    gauge go with it; the replica that stays keeps its own."""
    listed = ["127.0.0.1", "127.0.0.2"]
    forge.router.replicas = ReplicaSet(parse_upstreams(f"dns+http://policy.test:{closed_port()}"),
                                resolver=lambda name, port: list(listed), refresh_s=0.0)  # fmt: skip
    stay, leave = forge.router.replicas.all()
    clocks = {r.url: forge.router.clock(r) for r in (stay, leave)}
    for replica in (stay, leave):
        forge.router.continuations_for(replica)
    forge.router.replica_metrics()
    assert f'replica_up{{replica="{leave.url}"}}' in forge.metrics.render()
    listed.remove(leave.host)
    poller = threading.Thread(target=forge.router.watch, daemon=True)
    poller.start()
    deadline = time.monotonic() + 10
    while leave.url in forge.router.versions and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    forge.router.stop.set()
    poller.join(10)
    assert set(forge.router.versions) == set(forge.router.continuations) == {stay.url}, (
        forge.router.versions,
        forge.router.continuations,
    )
    assert clocks[leave.url].stopped and not clocks[stay.url].stopped
    assert leave.url not in forge.metrics.render() and stay.url in forge.metrics.render()
    clocks[stay.url].stop()


CASES = {
    "replicas-that-leave-dns-are-forgotten": replicas_that_leave_dns_are_forgotten,
    "tokens-in-fallback-unreachable": tokens_in_fallback_unreachable,
    "tokens-in-fallback-http-error": tokens_in_fallback_http_error,
    "replica-move-bounds-again": replica_move_bounds_again,
}


def main() -> None:
    """``property [EXAMPLES]`` (the default): the triggers, then the search; or the name of one case of CASES."""
    tmp = Path(tempfile.mkdtemp(prefix="forge-hooks-"))
    forge, writer, tctx = make_forge(tmp)
    loop = asyncio.new_event_loop()
    if len(sys.argv) > 1 and sys.argv[1] in CASES:
        with tctx:
            loop.run_until_complete(CASES[sys.argv[1]](forge, writer))
        print("ok")
        return
    examples = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    with tctx:
        failed = []
        for name, (api, body, episode) in TRIGGERS.items():
            try:
                loop.run_until_complete(
                    one_call(forge, writer, api, json.dumps(body).encode(), episode, "ok", whole=True)
                )
            except AssertionError as error:
                failed.append(f"{name}: {error}")
        print("\n".join(["triggers failed:", *failed]) if failed else "triggers ok", flush=True)
        apis_ = st.sampled_from(sorted(BODIES))

        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(data=st.data(), episode=episode_headers, outcome=outcomes)
        def every_call_is_prepared_whole_and_recorded_once(data: Any, episode: bytes | None, outcome: str) -> None:
            api = data.draw(apis_, label="api")
            body = data.draw(BODIES[api], label="body")
            content = json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as the escape \\ud83d
            loop.run_until_complete(one_call(forge, writer, api, content, episode, outcome))

        every_call_is_prepared_whole_and_recorded_once()
    if failed:
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
