"""Tokens-in continuation: a call whose history the harness resent as text is served from the ids the policy sampled.

A harness resends the previous answer as text; the chat template re-tokenizes it, and the canonical tokenization
need not be the one the policy sampled (a sampled ``Punct`` comes back as ``P`` + ``unct``, two sampled ``\\n`` as
one ``\\n\\n``). The prompt then no longer extends the previous call's prompt + completion ids, and the episode
forks. Here, before a call goes upstream:

1. its prompt is rendered by the policy server's own template (``/v1/chat/completions/render``, or
   ``/v1/responses/render``: the ids vLLM would prompt with);
2. if the rendered ids extend an earlier call of the episode (prompt + completion) nothing is done: the normal
   path already continues the segment;
3. else, with E the earlier call's ids and R the rendered ones, diverging at k: R's copy of E[k:] ends at the
   same count of end-of-turn tokens (special tokens are never re-tokenized); if E[k:] and that part of R decode
   to the same text (``/detokenize``), the call is a re-tokenization and is served tokens-in from E + the rest of
   R; otherwise it is a real rewrite (compaction, sub-agent, edited history, changed tool-call ids) and goes on as
   today (it forks).

A call is served tokens-in by the endpoint the normal path uses, as its wire module prepared it, with the prompt
ids given: vLLM's decode-side token reuse (``kv_transfer_params.prompt_token_ids``; vLLM 0.32
``renderers/online_renderer.py``: ``_reused_prompt_token_ids``, called by ``OnlineRenderer.preprocess_chat`` for
``/v1/chat/completions`` and ``/v1/responses``) skips templating and tokenizing and runs everything else as on the
normal path: the completion bound from the ids' length (``get_max_tokens``), structured outputs for a required or
named tool choice, the server's tool and reasoning parsers, the stream, usage. Chat Completions calls and Anthropic
Messages calls (which ``sidecar/apis/messages.py`` serves through vLLM's chat endpoint) are rendered by
``/v1/chat/completions/render``; OpenAI Responses calls (Codex) by ``/v1/responses/render`` (vLLM turns
``instructions``, ``input`` items and tools into chat messages and renders them with the same template). The
answer is the normal path's by construction, and the wire module takes it back as always (``ReusedIds``). vLLM
ignores the ids for a prompt with non-text content (it renders it): the answer's own prompt ids are compared with
the ids sent, and such a call is recorded as served normally. Nothing is ever re-tokenized for training: the
prompt ids are sampled ids plus the template's rendering of what the harness added; the completion ids are the
ones vLLM sampled.

Fail-open: any failure before the call goes out leaves it on the normal path; a tokens-in answer that is an
error is replaced by the normal path's answer (asked again), and the record's note says why. The record's
``continuation`` column says what was found: ``tokens_in`` (served so), ``retokenized`` (text extends, ids do not,
served normally: ``observe`` mode, or a fallback), ``rewrite`` (the text differs), null (not examined).
"""

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sidecar import codec
from sidecar.apis import REGISTRY, CompletionBound, responses
from sidecar.apis.base import Sampled, Served
from sidecar.apis.base import StreamState as BaseStreamState
from sidecar.apis.errors import error_body, error_headers
from sidecar.call import Call, Decision
from sidecar.policy import PolicyServerClient, PolicyServerClients, PolicyServerError, upstream_headers
from sidecar.replicas import base_url as replica_url

if TYPE_CHECKING:
    from mitmproxy import http


class Relaying(Protocol):
    """What ``fall_back`` needs of the sidecar: record a call, and relay a stream's pieces (``sidecar/relay.py``)."""

    def record(self, flow: "http.HTTPFlow", call: Call, status: str) -> None: ...

    def on_stream_data(self, flow: "http.HTTPFlow", call: Call, data: bytes) -> list[bytes]: ...


log = logging.getLogger("openforge.sidecar")
MODES = ("auto", "observe", "off")
RENDER_PATH = "/v1/chat/completions/render"
RESPONSES_RENDER_PATH = "/v1/responses/render"
REUSED_IDS = "prompt_token_ids"  # vLLM's decode-side token reuse: kv_transfer_params[REUSED_IDS] is the prompt
HTTP_TIMEOUT_S = 10.0  # the render and detokenize questions
FALL_BACK_TIMEOUT_S = 600.0  # the normal path asked again: a whole answer
TOKENS_IN_FAULTS = frozenset({400, 404, 413, 422})  # answers the prompt ids may cause (too long, refused)
MAX_CANDIDATES = 2  # earlier calls whose text is compared (each costs two /detokenize calls)
DECODE_BACKOFF = 8  # decode from a few ids before the divergence: never start inside a multi-byte character


def strategy(api: str) -> str | None:
    """How a wire API is served tokens-in (its registry entry): rendered as "chat" or "responses"; None: not."""
    entry = REGISTRY.get(api)
    return entry.tokens_in if entry is not None else None


# -- the decision (pure) ----------------------------------------------------------------------------------------
def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Split:
    """Where a rendered prompt R re-renders an earlier sequence E: R[diverge:end] is R's copy of E[diverge:]."""

    diverge: int
    end: int  # R[end:] is what the harness added after E


def retokenized_split(earlier: list[int], rendered: list[int], end_of_turn: int) -> Split | None:
    """If R = E's text re-tokenized + more, where R's copy of E ends (to be checked by text); None if it cannot be.

    Special tokens are never split or merged by a re-tokenization, so R's copy of E[k:] holds as many end-of-turn
    ids as E[k:]; when E ends without one (the completion ran into its bound), the template closes the turn with
    one more, which belongs to the added part.
    """
    k = common_prefix(earlier, rendered)
    if k == len(earlier):
        return None  # the ids extend: nothing to do
    tail = earlier[k:]
    closed = tail[-1] == end_of_turn
    wanted = tail.count(end_of_turn) + (0 if closed else 1)
    seen = 0
    for index in range(k, len(rendered)):
        if rendered[index] == end_of_turn:
            seen += 1
            if seen == wanted:
                end = index + 1 if closed else index
                return Split(k, end) if end < len(rendered) else None
    return None


@dataclass
class ReusedIds:
    """A call served tokens-in (a ``Served``): vLLM's own endpoint given the prompt ids, so the wire module's
    additions take the answer back unchanged. vLLM falls back to rendering the prompt itself (non-text content);
    where the answer's prompt ids are not the ones sent, the decision says it was served normally (the record then
    holds what vLLM rendered, as on the normal path)."""

    inner: Served
    prompt_ids: list[int]
    decision: "Decision"

    @property
    def api(self) -> str:
        return self.inner.api

    @property
    def stream(self) -> bool:
        return self.inner.stream

    @property
    def upstream_path(self) -> str | None:
        return self.inner.upstream_path

    def check(self, sampled: Sampled) -> Sampled:
        if (
            sampled.prompt_ids is not None
            and sampled.prompt_ids != self.prompt_ids
            and self.decision.state == "tokens_in"
        ):
            self.decision.state = "retokenized"
            self.decision.note = "tokens-in: vLLM rendered the prompt instead of taking the ids given; served normally"
        return sampled

    def finish(self, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
        sampled, out = self.inner.finish(answer)
        return self.check(sampled), out

    def stream_state(self) -> "ReusedIdsStream":
        return ReusedIdsStream(self, self.inner.stream_state())

    def error_event(self, message: str) -> bytes:
        return self.inner.error_event(message)


class ReusedIdsStream:
    """The wire module's stream state, its ids checked as ``ReusedIds.check`` does."""

    def __init__(self, added: ReusedIds, inner: BaseStreamState) -> None:
        self.added = added
        self.inner = inner

    @property
    def done(self) -> bool:
        return self.inner.done

    @property
    def sampled(self) -> Sampled:
        return self.added.check(self.inner.sampled)

    @property
    def gather_error(self) -> str | None:  # the Messages module's: ids it could not gather
        return getattr(self.inner, "gather_error", None)

    def feed_event(self, raw: bytes) -> list[bytes]:
        return self.inner.feed_event(raw)

    def summary(self) -> dict[str, Any]:
        return {**self.inner.summary(), "served": "tokens-in"}


def reused_ids_request(body: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """The request serving a call tokens-in: the call as its wire module prepared it, with its prompt ids given."""
    return {**body, "kv_transfer_params": {REUSED_IDS: prompt}}


# -- the work around a call --------------------------------------------------------------------------------------
# Responses input items that carry what the model produced (a message of the assistant, a tool call, reasoning).
_ANSWER_ITEMS = frozenset({"function_call", "custom_tool_call", "reasoning", "local_shell_call", "mcp_call"})


def answers_in_history(api: str, body: dict[str, Any]) -> bool:
    """Whether the request sends an earlier answer back (the only text whose ids can have been sampled)."""
    if strategy(api) == "responses":
        items = body.get("input")
        return isinstance(items, list) and any(
            isinstance(i, dict) and (i.get("role") == "assistant" or i.get("type") in _ANSWER_ITEMS) for i in items
        )
    messages = body.get("messages")
    return isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


class Continuations:
    """The sidecar's tokens-in continuation: ``examine`` before a call goes upstream, ``fall_back`` if it failed."""

    def __init__(self, mode: str = "auto", base_url: str = "http://127.0.0.1:8000") -> None:
        if mode not in MODES:
            raise ValueError(f"tokens-in mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.base_url = base_url.rstrip("/")
        self.end_of_turn: dict[str, int] = {}  # per served model: the id the template closes a turn with
        # Kept-alive clients of the replica, one per call at work at once (a call's questions are made in turn).
        self.http = PolicyServerClients(self.base_url, HTTP_TIMEOUT_S, HTTP_TIMEOUT_S, headers=upstream_headers())

    def close(self) -> None:
        self.http.close()

    async def _call(self, path: str, payload: dict[str, Any]) -> Any:
        return await asyncio.to_thread(self.http.post, path, payload, HTTP_TIMEOUT_S)

    async def _end_of_turn(self, model: str) -> int:
        """The first id the template adds when it closes an assistant turn (rendered once per model)."""
        if model not in self.end_of_turn:
            turn = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
            closed, open_ = await asyncio.gather(
                self._call(RENDER_PATH, {"model": model, "messages": turn, "add_generation_prompt": False}),
                self._call(RENDER_PATH, {"model": model, "messages": turn, "add_generation_prompt": False,
                                         "continue_final_message": True}),
            )  # fmt: skip
            closed_ids, open_ids = closed["token_ids"], open_["token_ids"]
            if closed_ids[: len(open_ids)] != open_ids or len(closed_ids) == len(open_ids):
                raise ValueError("the chat template does not close an assistant turn with a token")
            self.end_of_turn[model] = closed_ids[len(open_ids)]
        return self.end_of_turn[model]

    async def _decode(self, model: str, ids: list[int]) -> str:
        return str((await self._call("/detokenize", {"model": model, "tokens": ids}))["prompt"])

    def eligible(self, api: str, body: dict[str, Any], added: Any) -> bool:
        """Chat and Messages calls (served through chat) with one choice and no ids or logprobs asked by the harness
        (any tool choice or response format: vLLM applies them to the ids as to its own rendering).
        Responses calls whose whole history is in the request (no ``previous_response_id``: vLLM would add stored
        turns the render does not see) and whose harness asked for no message ids or reuse of its own."""
        if self.mode == "off" or strategy(api) is None or added is None:
            return False
        if strategy(api) == "responses":
            return (isinstance(added, responses.Additions) and not added.harness_messages
                    and not body.get("previous_response_id") and body.get("kv_transfer_params") is None)  # fmt: skip
        chat = getattr(added, "chat", added)  # Messages: the additions of the chat request it is served as
        return not (chat.harness_ids or chat.harness_logprobs or body.get("n", 1) != 1 or body.get("prompt_logprobs"))

    async def examine(
        self, api: str, episode_sequences: list[tuple[str, bytes]], body: dict[str, Any], added: Any, path: str,
        bound: CompletionBound | None = None, continues: str | None = None,
    ) -> tuple[Decision, dict[str, Any] | None] | None:  # fmt: skip
        """For an eligible call with earlier calls in its episode: None (ids extend, or nothing to compare), or the
        decision and, when it is to be served tokens-in, the request (``reused_ids_request``).

        ``continues``: the call whose whole input and output this request's input begins with, known by id (a
        stored Responses answer, ``sidecar/response_store.py``). Its text is not compared: the template may not
        render all of it (a chat template that shows no tool calls), and the harness named that answer itself."""
        if not episode_sequences or not self.eligible(api, body, added):
            return None
        if not answers_in_history(api, body):
            return None  # no answer sent back as history: nothing sampled to re-tokenize (no render asked)
        started = time.perf_counter()
        model = str(body.get("model"))
        render_path = RESPONSES_RENDER_PATH if strategy(api) == "responses" else RENDER_PATH
        rendered = await self._call(render_path, {**body, "stream": False, "stream_options": None})
        rendered_ids: list[int] = rendered["token_ids"]
        timings = {"render_ms": (time.perf_counter() - started) * 1e3}
        # The earlier calls nearest to this prompt first: a prompt that extends one of them in ids needs nothing;
        # else the first whose text this prompt re-renders is continued tokens-in.
        scored = sorted(
            ((common_prefix(list(memoryview(packed).cast("i")), rendered_ids), index, packed)
             for index, (_, packed) in enumerate(episode_sequences)),
            key=lambda item: (item[0], item[1]), reverse=True,
        )  # fmt: skip
        end_of_turn = await self._end_of_turn(model)
        found: tuple[list[int], Split] | None = None
        named = dict(episode_sequences).get(continues) if continues else None
        if named is not None:  # the call the harness named by id: its split, its text not compared
            earlier = list(memoryview(named).cast("i"))
            if common_prefix(earlier, rendered_ids) == len(earlier):
                return None
            if (split := retokenized_split(earlier, rendered_ids, end_of_turn)) is not None:
                found = (earlier, split)
        for shared, _, packed in [] if found else scored[:MAX_CANDIDATES]:
            earlier = list(memoryview(packed).cast("i"))
            if shared == len(earlier):
                return None  # the prompt extends this call's ids: the normal path continues the segment
            split = retokenized_split(earlier, rendered_ids, end_of_turn)
            if split is None:
                continue
            start = max(0, split.diverge - DECODE_BACKOFF)
            ours, theirs = await asyncio.gather(
                self._decode(model, earlier[start:]), self._decode(model, rendered_ids[start : split.end])
            )
            if ours == theirs:
                found = (earlier, split)
                break
        timings["check_ms"] = (time.perf_counter() - started) * 1e3 - timings["render_ms"]
        if found is None:
            differs = "tokens-in: the prompt re-renders no earlier call's text (a rewrite)"
            return Decision("rewrite", note=differs, timings_ms=timings), None
        earlier, split = found
        prompt = earlier + rendered_ids[split.end :]
        # vLLM bounds the completion by the bound sent and the room this prompt leaves (``CompletionBound.served``)
        served_max = bound.served(len(prompt)) if bound is not None else None
        request = reused_ids_request(body, prompt) if served_max is None or served_max > 0 else None
        note = (f"served tokens-in: {len(earlier)} ids of an earlier call (re-tokenized from id {split.diverge}) + "
                f"{len(rendered_ids) - split.end} rendered")  # fmt: skip
        if named is not None and found[0] == list(memoryview(named).cast("i")):
            note += f", the call {continues} named by its response or item ids"
        decision = Decision("retokenized", note=note, original_path=path, original_body=b"", timings_ms=timings)
        if request is None:
            decision.note = "tokens-in: the prompt ids leave no room for a completion; served normally"
            return decision, None
        if self.mode == "observe":
            decision.note = "tokens-in (observe): re-tokenized history; served normally"
            return decision, None
        decision.state = "tokens_in"
        return decision, request

    async def prepare(self, flow: "http.HTTPFlow", call: Call, episode_sequences: list[tuple[str, bytes]]) -> None:
        """The addon's hook (``request``, after the wire API prepared the request and its completion bound was
        set): examine the call; serve it tokens-in when it applies. Fail-open."""
        if self.mode == "off" or call.added is None or not episode_sequences or strategy(call.api) is None:
            return
        try:
            body = codec.loads(flow.request.content or b"")  # the body prepare() wrote
            found = await self.examine(call.api, episode_sequences, body, call.added, flow.request.path, call.bound,
                                       flow.metadata.get("forge_continues"))  # fmt: skip
        except Exception as error:
            call.continuation = Decision("error", note=f"tokens-in not examined ({type(error).__name__}: {error})")
            return
        if found is None:
            return
        decision, request = found
        call.continuation = decision
        if request is None:
            return
        content = codec.dumps(request)  # before anything changes: the call goes whole, tokens-in or not
        decision.original_body = flow.request.content or b""
        decision.inner_added = call.added
        call.added = ReusedIds(inner=call.added, prompt_ids=request["kv_transfer_params"][REUSED_IDS],
                               decision=decision)  # fmt: skip
        flow.request.content = content

    async def fall_back(self, relay: Relaying, flow: "http.HTTPFlow", call: Call) -> bool:
        """The tokens-in answer is an error it could have caused (``caused_by_tokens_in``): ask the normal path
        instead and give the harness that answer. True when the call was recorded here (a stream, passed through
        the inner module's stream state, or a normal path that could not be reached: the API's 502)."""
        from mitmproxy import http

        from sidecar.sse import EventFramer

        decision = call.continuation
        response = flow.response
        assert decision is not None and decision.inner_added is not None and response is not None
        why = f"HTTP {response.status_code}: {(response.get_text(strict=False) or '')[:300]}"
        decision.state = "retokenized"
        decision.note = f"tokens-in failed ({why}); served by the normal path"
        call.added = decision.inner_added
        flow.request.path = decision.original_path
        flow.request.content = decision.original_body
        origin = replica_url(flow.request.scheme, flow.request.host, flow.request.port)
        headers = {"content-type": "application/json"}  # and the server's key: each client sends it

        def ask() -> tuple[int, bytes, str]:  # an HTTP error is the normal path's answer too: passed on as it is
            sent = ("POST", decision.original_path, decision.original_body, FALL_BACK_TIMEOUT_S, headers)
            if origin == self.base_url:
                status, answer_headers, content = self.http.exchange(*sent)
            else:  # the flow's replica is not this one's (never expected): a client of its own
                client = PolicyServerClient(origin, FALL_BACK_TIMEOUT_S, HTTP_TIMEOUT_S, upstream_headers())
                try:
                    status, answer_headers, content = client.exchange(*sent)
                finally:
                    client.close()
            return status, content, answer_headers.get("content-type", "")

        try:
            status, content, kind = await asyncio.to_thread(ask)
        except PolicyServerError as error:  # refused, timed out: the harness gets its API's 502, never tokens-in's
            cause = error.__cause__ or error
            call.error = f"tokens-in failed and the normal path could not be reached ({type(cause).__name__})"
            message = "The policy server is unavailable; the call was recorded as failed."
            flow.response = http.Response.make(
                502, error_body(call.api, 502, message, "policy_unavailable"), error_headers(call.api)
            )
            relay.record(flow, call, status="upstream_error")
            return True
        flow.response = http.Response.make(status, content, {"content-type": kind or "application/json"})
        if status < 400 and call.added.stream and "text/event-stream" in kind:
            call.stream = call.added.stream_state()
            call.framer = EventFramer()
            out = relay.on_stream_data(flow, call, content) + relay.on_stream_data(flow, call, b"")
            flow.response.content = b"".join(out)
            return True
        return False


def caused_by_tokens_in(status: int) -> bool:
    """An error answer the tokens-in request itself may have caused (its token-id prompt, its parameters); a server
    that is down, overloaded or refuses the key answers the normal path the same way: not asked again."""
    return status in TOKENS_IN_FAULTS
