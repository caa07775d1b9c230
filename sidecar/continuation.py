"""Tokens-in continuation: a call whose history the harness resent as text is served from the ids the policy sampled.

A harness resends the previous answer as text; the chat template re-tokenizes it, and the canonical tokenization
need not be the one the policy sampled (a sampled ``Punct`` comes back as ``P`` + ``unct``, two sampled ``\\n`` as
one ``\\n\\n``). The prompt then no longer extends the previous call's prompt + completion ids, and the episode
forks. Here, before a call goes upstream:

1. its prompt is rendered by the policy server's own template (``/v1/chat/completions/render``: ids and the
   sampling parameters vLLM would use);
2. if the rendered ids extend an earlier call of the episode (prompt + completion) nothing is done: the normal
   path already continues the segment;
3. else, with E the earlier call's ids and R the rendered ones, diverging at k: R's copy of E[k:] ends at the
   same count of end-of-turn tokens (special tokens are never re-tokenized); if E[k:] and that part of R decode
   to the same text (``/detokenize``), the call is a re-tokenization and is served tokens-in from E + the rest of
   R through ``/v1/completions`` (token-id prompt, the rendered sampling parameters); otherwise it is a real
   rewrite (compaction, sub-agent, edited history, changed tool-call ids) and goes on as today (it forks).

The answer is turned back into the chat answer vLLM would have given (hermes tool calls parsed as vLLM's parser
does) and handed to the wire API's own module (Chat Completions, or Anthropic Messages translated from it), so
the harness gets its own format.

OpenAI Responses (Codex) is rendered by ``/v1/responses/render`` (vLLM turns ``instructions``, ``input`` items and
tools into chat messages and renders them with the same template) and served by vLLM's own ``/v1/responses`` with
the prompt ids given: its decode-side token reuse (``kv_transfer_params.prompt_token_ids``, vLLM 0.32
``renderers/online_renderer.py``) skips templating and tokenizing and runs everything else as on the normal path
(tool parsing into ``function_call`` / ``custom_tool_call`` items, the streamed events, usage). The answer is the
normal path's by construction and the Responses module takes it back as always. vLLM ignores the ids for a prompt
with non-text content (it renders it): the answer's own prompt ids are compared with the ids sent, and such a call
is recorded as served normally. Nothing is ever re-tokenized for training: the prompt ids are sampled ids plus
the template's rendering of what the harness added; the completion ids are the ones vLLM sampled.

Fail-open: any failure before the call goes out leaves it on the normal path; a tokens-in answer that is an
error is replaced by the normal path's answer (asked again), and the record's note says why. The record's
``continuation`` column says what was found: ``tokens_in`` (served so), ``retokenized`` (text extends, ids do not,
served normally: ``observe`` mode, or a fallback), ``rewrite`` (the text differs), null (not examined).
"""

import asyncio
import json
import logging
import os
import re
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sidecar import codec
from sidecar.apis import CompletionBound, responses
from sidecar.apis.base import Sampled, Served, compact
from sidecar.apis.base import StreamState as BaseStreamState
from sidecar.apis.errors import error_body, error_headers
from sidecar.call import Call, Decision
from sidecar.sse import DONE, parse_event

if TYPE_CHECKING:
    from mitmproxy import http


class Relaying(Protocol):
    """What ``fall_back`` needs of the sidecar: record a call, and relay a stream's pieces (``sidecar/relay.py``)."""

    def record(self, flow: "http.HTTPFlow", call: Call, status: str) -> None: ...

    def on_stream_data(self, flow: "http.HTTPFlow", call: Call, data: bytes) -> list[bytes]: ...


log = logging.getLogger("openforge.sidecar")
MODES = ("auto", "observe", "off")
APIS = ("chat", "messages", "responses")  # the wire APIs served tokens-in
RENDER_PATH = "/v1/chat/completions/render"
RESPONSES_RENDER_PATH = "/v1/responses/render"
REUSED_IDS = "prompt_token_ids"  # vLLM's decode-side token reuse: kv_transfer_params[REUSED_IDS] is the prompt
COMPLETIONS_PATH = "/v1/completions"
HTTP_TIMEOUT_S = 10.0
TOKENS_IN_FAULTS = frozenset({400, 404, 413, 422})  # answers of /v1/completions a chat request would not get
MAX_CANDIDATES = 2  # earlier calls whose text is compared (each costs two /detokenize calls)
DECODE_BACKOFF = 8  # decode from a few ids before the divergence: never start inside a multi-byte character
# The rendered sampling parameters passed on to /v1/completions by the same name; those ignored (vLLM's internal
# bookkeeping, or what the sidecar sets itself); any other non-default one keeps the call on the normal path.
PASSED = {
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
    "stop", "stop_token_ids", "max_tokens", "min_tokens", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "bad_words",
}  # fmt: skip
IGNORED = {"logprobs", "output_kind", "skip_clone", "output_text_buffer_length", "skip_reading_prefix_cache", "n"}
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_REGEX = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM's hermes parser


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


def hermes_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool calls) as vLLM's hermes parser extracts them from a whole answer (None: no tool call)."""
    if TOOL_CALL_START not in text:
        return text, None
    try:
        found = [json.loads(a or b) for a, b in TOOL_CALL_REGEX.findall(text)]
        calls = [
            {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "type": "function",
             "function": {"name": f["name"], "arguments": json.dumps(f["arguments"], ensure_ascii=False)}}
            for f in found
        ]  # fmt: skip
    except Exception:  # vLLM logs it and answers the text as content
        return text, None
    content = text[: text.find(TOOL_CALL_START)]
    return (content or None), calls


def partial_tag_overlap(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def completions_request(
    model: str | None, prompt: list[int], rendered: dict[str, Any], rendered_len: int, asked_max: bool, stream: bool,
    max_tokens: int | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """The /v1/completions request serving a chat call tokens-in, from the parameters vLLM rendered for it; None
    when they hold one this path does not carry over (the call stays on the normal path).

    ``max_tokens``: the call's completion bound for this prompt (``CompletionBound.served``: the bound sent, and the
    room this prompt leaves in the context), when known. vLLM rendered its own from the re-tokenized prompt, whose
    length differs: without it, the room is corrected by that difference when the harness set no bound."""
    params = rendered.get("sampling_params") or {}
    body: dict[str, Any] = {"model": model, "prompt": prompt, "return_token_ids": True, "logprobs": 0}
    for name, value in params.items():
        if name in PASSED:
            body[name] = value
        elif name not in IGNORED and value not in (None, [], {}, False, 0):
            return None
    if params.get("n", 1) not in (None, 1):
        return None
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    elif not asked_max and isinstance(body.get("max_tokens"), int):  # vLLM's default: what the context leaves
        body["max_tokens"] -= len(prompt) - rendered_len
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] < 1:
        return None  # no room left: the normal path answers (vLLM's own error)
    for name in ("cache_salt", "priority"):
        if rendered.get(name) is not None:
            body[name] = rendered[name]
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


# -- the answer: completions → the chat answer vLLM would give --------------------------------------------------
@dataclass
class Additions:
    """A call served tokens-in (a ``Served``): the wire API's own additions, which take the chat answer made from
    the /v1/completions one back to the harness's format, and what that chat answer needs."""

    inner: Served  # the wire API's own additions (Chat Completions, or Anthropic Messages through chat)
    stream: bool
    tools: bool  # the request has tools and tool_choice auto: hermes parsing applies
    prompt_ids: list[int]
    note: str
    upstream_path: str | None = COMPLETIONS_PATH

    @property
    def api(self) -> str:
        return self.inner.api

    def finish(self, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
        return finish(self, answer)

    def stream_state(self) -> "StreamState":
        return StreamState(self)

    def error_event(self, message: str) -> bytes:
        """The end of a failed stream in the harness's own format (the inner module's, not /v1/completions')."""
        return self.inner.error_event(message)


def _chat_logprobs(values: list[Any], tokens: list[Any]) -> dict[str, Any]:
    return {"content": [{"token": t or "", "logprob": v, "bytes": None, "top_logprobs": []}
                        for v, t in zip(values, tokens + [None] * len(values), strict=False)]}  # fmt: skip


def chat_answer(added: Additions, answer: dict[str, Any]) -> dict[str, Any]:
    """A whole /v1/completions answer as vLLM's whole chat answer (ids and logprobs kept, for the inner module)."""
    choice = (answer.get("choices") or [{}])[0]
    text = choice.get("text") or ""
    content, calls = hermes_tool_calls(text) if added.tools else (text, None)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": None,
                               "audio": None, "function_call": None}  # fmt: skip
    if calls:
        message["tool_calls"] = calls
    message["reasoning"] = None
    logprobs = choice.get("logprobs") or {}
    return {
        "id": "chatcmpl-" + str(answer.get("id") or uuid.uuid4().hex).removeprefix("cmpl-"),
        "object": "chat.completion", "created": answer.get("created") or int(time.time()),
        "model": answer.get("model"),
        "choices": [{
            "index": 0, "message": message,
            "logprobs": _chat_logprobs(logprobs.get("token_logprobs") or [], logprobs.get("tokens") or []),
            "finish_reason": "tool_calls" if calls else (choice.get("finish_reason") or "stop"),
            "stop_reason": choice.get("stop_reason"), "token_ids": choice.get("token_ids"), "routed_experts": None,
        }],
        "service_tier": None, "system_fingerprint": answer.get("system_fingerprint"), "usage": answer.get("usage"),
        "prompt_logprobs": None, "prompt_token_ids": choice.get("prompt_token_ids") or added.prompt_ids,
        "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }  # fmt: skip


def finish(added: Additions, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
    sampled, out = added.inner.finish(chat_answer(added, answer))
    sampled.note = "; ".join(filter(None, [sampled.note, added.note]))
    return sampled, out


@dataclass
class ReusedIds:
    """A Responses call served tokens-in (a ``Served``): vLLM's own /v1/responses given the prompt ids, so the
    Responses module's additions take the answer back unchanged. vLLM falls back to rendering the prompt itself
    (non-text content); where the answer's prompt ids are not the ones sent, the decision says it was served
    normally (the record then holds what vLLM rendered, as on the normal path)."""

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
    """The Responses module's stream state, its ids checked as ``ReusedIds.check`` does."""

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
    def events(self) -> int:
        return self.inner.events

    def feed_event(self, raw: bytes) -> list[bytes]:
        return self.inner.feed_event(raw)

    def summary(self) -> dict[str, Any]:
        return {**self.inner.summary(), "served": "tokens-in"}


def reused_ids_request(body: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """The /v1/responses request serving a call tokens-in: the call as prepared, with its prompt ids given."""
    return {**body, "kv_transfer_params": {REUSED_IDS: prompt}}


class StreamState:
    """/v1/completions chunks in; vLLM-style chat chunks made from them go through the inner module's stream state
    (which gathers the ids and writes what the harness gets). Text is sent on live; with tools, from a possible
    ``<tool_call>`` on it is held back and parsed as a whole at the end (as vLLM's hermes parser would)."""

    def __init__(self, added: Additions) -> None:
        self.added = added
        self.inner = added.inner.stream_state()
        self.text = ""
        self.sent = 0  # characters of text sent on as content
        self.started = False
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.chat_id = "chatcmpl-" + uuid.uuid4().hex
        self.model: str | None = None
        self.created = int(time.time())

    @property
    def done(self) -> bool:
        return bool(self.inner.done)

    @property
    def sampled(self) -> Sampled:
        sampled: Sampled = self.inner.sampled
        if self.added.note not in (sampled.note or ""):
            sampled.note = "; ".join(filter(None, [sampled.note, self.added.note]))
        return sampled

    @property
    def events(self) -> int:
        return int(self.inner.events)

    @property
    def gather_error(self) -> str | None:
        return getattr(self.inner, "gather_error", None)

    def summary(self) -> dict[str, Any]:
        return {**self.inner.summary(), "served": "tokens-in"}

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {"id": self.chat_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices, **extra}  # fmt: skip
        return f"data: {compact(chunk)}\n\n".encode()

    def _sendable(self) -> str:
        if not self.added.tools:
            end = len(self.text)
        elif TOOL_CALL_START in self.text:
            end = self.text.index(TOOL_CALL_START)
        else:
            end = len(self.text) - partial_tag_overlap(self.text, TOOL_CALL_START)
        piece, self.sent = self.text[self.sent : max(end, self.sent)], max(end, self.sent)
        return piece

    def feed_event(self, raw: bytes) -> list[bytes]:
        parsed = parse_event(raw)
        if parsed.done:
            return self._feed(f"data: {DONE}\n\n".encode())
        chunk = parsed.payload
        if chunk is None:
            return []
        if parsed.error is not None:
            return self._feed(raw)
        self.model = self.model or chunk.get("model")
        events: list[bytes] = []
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if not self.started:
                self.started = True
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}  # fmt: skip
                prompt = choice.get("prompt_token_ids") or self.added.prompt_ids
                events.append(self._chunk([role], prompt_token_ids=prompt))
            self.text += choice.get("text") or ""
            logprobs = choice.get("logprobs") or {}
            ids = choice.get("token_ids") or []
            if ids:
                events.append(self._chunk([{
                    "index": 0, "delta": {"content": self._sendable()},
                    "logprobs": _chat_logprobs(logprobs.get("token_logprobs") or [], logprobs.get("tokens") or []),
                    "finish_reason": None, "token_ids": ids,
                }]))  # fmt: skip
            if choice.get("finish_reason"):
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
                events += self._close()
        if chunk.get("usage") is not None and not chunk.get("choices"):
            events.append(self._chunk([], usage=chunk["usage"]))
        out: list[bytes] = []
        for event in events:
            out += self._feed(event)
        return out

    def _close(self) -> list[bytes]:
        held = self.text[self.sent :]
        calls = None
        if self.added.tools and held:
            _, calls = hermes_tool_calls(self.text)
        events = []
        if calls:
            for index, call in enumerate(calls):
                events.append(self._chunk([{"index": 0, "delta": {"tool_calls": [{**call, "index": index}]},
                                            "logprobs": None, "finish_reason": None}]))  # fmt: skip
        elif held:
            self.sent = len(self.text)
            events.append(self._chunk([{"index": 0, "delta": {"content": held}, "logprobs": None,
                                        "finish_reason": None}]))  # fmt: skip
        reason = "tool_calls" if calls else self.finish_reason
        events.append(self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason,
                                    "stop_reason": self.stop_reason}]))  # fmt: skip
        return events

    def _feed(self, event: bytes) -> list[bytes]:
        return list(self.inner.feed_event(event))


# -- the work around a call --------------------------------------------------------------------------------------
def _post(url: str, payload: dict[str, Any], timeout: float = HTTP_TIMEOUT_S) -> Any:
    headers = {"content-type": "application/json"}
    if key := os.environ.get("FORGE_UPSTREAM_API_KEY"):  # the policy server's key, as the addon sends it
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.load(answer)


# Responses input items that carry what the model produced (a message of the assistant, a tool call, reasoning).
_ANSWER_ITEMS = frozenset({"function_call", "custom_tool_call", "reasoning", "local_shell_call", "mcp_call"})


def answers_in_history(api: str, body: dict[str, Any]) -> bool:
    """Whether the request sends an earlier answer back (the only text whose ids can have been sampled)."""
    if api == "responses":
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

    async def _call(self, path: str, payload: dict[str, Any]) -> Any:
        return await asyncio.to_thread(_post, self.base_url + path, payload)

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
        """Chat and Messages calls (served through chat) with one choice, no ids or logprobs asked by the harness,
        and tool choice auto or none (required/named ones are structured outputs: the normal path only).
        Responses calls whose whole history is in the request (no ``previous_response_id``: vLLM would add stored
        turns the render does not see) and whose harness asked for no message ids or reuse of its own."""
        if self.mode == "off" or api not in APIS or added is None:
            return False
        if api == "responses":
            return (isinstance(added, responses.Additions) and not added.harness_messages
                    and not body.get("previous_response_id") and body.get("kv_transfer_params") is None)  # fmt: skip
        chat = added.chat if api == "messages" else added
        if chat.harness_ids or chat.harness_logprobs or body.get("n", 1) != 1 or body.get("prompt_logprobs"):
            return False
        return body.get("tool_choice") in (None, "auto", "none") and not body.get("response_format")

    async def examine(
        self, api: str, episode_sequences: list[tuple[str, bytes]], body: dict[str, Any], added: Any, path: str,
        bound: CompletionBound | None = None, continues: str | None = None,
    ) -> tuple[Decision, dict[str, Any] | None] | None:  # fmt: skip
        """For an eligible call with earlier calls in its episode: None (ids extend, or nothing to compare), or the
        decision and, when it is to be served tokens-in, the /v1/completions request.

        ``continues``: the call whose whole input and output this request's input begins with, known by id (a
        stored Responses answer, ``sidecar/response_store.py``). Its text is not compared: the template may not
        render all of it (a chat template that shows no tool calls), and the harness named that answer itself."""
        if not episode_sequences or not self.eligible(api, body, added):
            return None
        if not answers_in_history(api, body):
            return None  # no answer sent back as history: nothing sampled to re-tokenize (no render asked)
        started = time.perf_counter()
        model = str(body.get("model"))
        render_path = RESPONSES_RENDER_PATH if api == "responses" else RENDER_PATH
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
        request: dict[str, Any] | None
        if api == "responses":  # vLLM bounds the completion by the room this prompt leaves, as on the normal path
            request = reused_ids_request(body, prompt)
        else:
            chat = added.chat if api == "messages" else added
            asked_max = any(isinstance(body.get(k), int) for k in ("max_tokens", "max_completion_tokens"))
            served_max = bound.served(len(prompt)) if bound is not None else None  # what the record says was served
            request = completions_request(model, prompt, rendered, len(rendered_ids), asked_max, chat.stream,
                                          served_max)  # fmt: skip
        note = (f"served tokens-in: {len(earlier)} ids of an earlier call (re-tokenized from id {split.diverge}) + "
                f"{len(rendered_ids) - split.end} rendered")  # fmt: skip
        if named is not None and found[0] == list(memoryview(named).cast("i")):
            note += f", the call {continues} named by its response or item ids"
        decision = Decision("retokenized", note=note, original_path=path, original_body=b"", timings_ms=timings)
        if request is None:
            decision.note = "tokens-in: a sampling parameter this path does not carry; served normally"
            return decision, None
        if self.mode == "observe":
            decision.note = "tokens-in (observe): re-tokenized history; served normally"
            return decision, None
        decision.state = "tokens_in"
        return decision, request

    async def prepare(self, flow: "http.HTTPFlow", call: Call, episode_sequences: list[tuple[str, bytes]]) -> None:
        """The addon's hook (``request``, after the wire API prepared the request and its completion bound was
        set): examine the call; serve it tokens-in when it applies. Fail-open."""
        if self.mode == "off" or call.added is None or not episode_sequences or call.api not in APIS:
            return
        try:
            body = json.loads(flow.request.content or b"")
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
        if call.api == "responses":
            call.added = ReusedIds(inner=call.added, prompt_ids=request["kv_transfer_params"][REUSED_IDS],
                                   decision=decision)  # fmt: skip
            flow.request.content = content
            return
        call.added = Additions(
            inner=call.added, stream=bool(request.get("stream")),
            tools=bool(body.get("tools")) and body.get("tool_choice") in (None, "auto"),
            prompt_ids=request["prompt"], note=decision.note or "",
        )  # fmt: skip
        flow.request.path, flow.request.content = COMPLETIONS_PATH, content

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
        url = f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}{decision.original_path}"
        headers = {"content-type": "application/json"}
        if authorization := flow.request.headers.get("authorization"):  # the upstream's key, as the addon set it
            headers["authorization"] = authorization

        def ask() -> tuple[int, bytes, str]:
            request = urllib.request.Request(url, data=decision.original_body, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=600) as answer:
                    return answer.status, answer.read(), answer.headers.get("content-type", "")
            except urllib.error.HTTPError as error:
                return error.code, error.read(), error.headers.get("content-type", "")

        try:
            status, content, kind = await asyncio.to_thread(ask)
        except OSError as error:  # refused, timed out: the harness gets its API's 502, never tokens-in's answer
            call.error = f"tokens-in failed and the normal path could not be reached ({type(error).__name__})"
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
