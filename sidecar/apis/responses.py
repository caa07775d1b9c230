"""OpenAI Responses (Codex's only API) as vLLM serves it: ids from ``enable_response_messages``, logprobs from
``include: ["message.output_text.logprobs"]``, both hidden from the harness.

vLLM gives the token ids of the rendered prompt (``input_messages[].tokens``) and of the sampled output
(``output_messages[].tokens``) in the whole answer, and when streaming only in ``response.completed``: a stream
cut before that event has text and logprobs but no ids.

Logprobs come only inside ``message`` items' ``output_text`` parts, and how many depends on the path (vLLM 0.32,
``responses/serving.py``, one ``output_messages`` entry holding every sampled id):
- whole answer: the message's part carries the logprobs of *every* sampled id, the function-call text and the
  end-of-turn id included; an answer without text (only a ``function_call``) carries none;
- stream: each text delta carries the logprobs of the ids sampled in its step; steps the tool parser swallows
  (function-call text) or that add no text (the end of turn) carry none, so the final message holds those of
  the text ids only.
They are aligned here, never guessed: as many logprobs as ids is one each, in order. Fewer (a stream: its steps
that sent no text carry none, and those can lie anywhere) are placed on the first ids only as far as their tokens
surely are those ids' (``_placeable_prefix``: they spell the start of the output text, ``output_messages[].message``,
ASCII and before any tool-tag start); every other id is NaN, counted as an unknown logprob (the trainer recomputes
it), and the record's ``note`` says so. More logprobs than ids make the call an error that says why.
``response.failed`` and ``error`` events are the upstream's failure: recorded as such, never ``ok``.
What the harness gets is what vLLM writes when not asked: message lists null, delta logprobs ``[]``, the
logprobs of finished text parts null, ``top_logprobs`` null.

Requests are normalised to what vLLM serves (``normalise_request``), the same way on every call so that a
conversation's prompts extend each other. Codex's default model sends its tools as an ``additional_tools`` input
item (a developer-role item holding namespaces of tools) beside an empty ``tools``; vLLM refuses that item. So:
- the tools of ``additional_tools`` items join ``tools`` (first definition of a name wins) and the items leave
  ``input``;
- the ``functions`` namespace is the plain tools' own: its tools join ``tools`` directly (the model sees ``exec``,
  not ``functions__exec``); other namespaces stay (vLLM shows their function tools as ``<namespace>__<name>`` and
  answers a call with its ``namespace``), but a ``custom`` tool inside one is lifted out, as vLLM shows only
  function tools of a namespace;
- a ``custom`` tool's ``grammar`` format is dropped: vLLM serves free-form custom tools only (as a function with
  one string argument, its call given back to the harness as a ``custom_tool_call``, streamed and not); the
  policy is then not held to the grammar, and the harness checks the input as it does any model's.
"""

import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sidecar import response_store
from sidecar.apis import openai
from sidecar.apis.base import DataStream, Prepared, Sampled, clear, compact, logprob, text_of
from sidecar.apis.registry import ANSWERED, RECORDED, REFUSED, Api, register
from sidecar.sse import parse_data

PATHS = ("/v1/responses", "/responses")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
NO_LOGPROBS_NOTE = "vLLM gave no logprobs for this output (function-call output has none): completion_logprobs NaN"
FAILED_EVENTS = ("response.failed", "error")


@dataclass
class Additions(Prepared):
    """What the sidecar added to a Responses request (vLLM's output messages, the output-text logprobs)."""

    harness_messages: bool  # the harness asked for enable_response_messages itself
    harness_logprobs: bool  # ... or for the output-text logprobs
    harness_top_logprobs: bool
    upstream_path: str | None = None
    # The sidecar's: remember an answer as the harness got it (store on; sidecar/response_store.py)
    keep: Callable[[dict[str, Any]], None] | None = None

    def finish(self, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
        return finish(self, answer)

    def stream_state(self) -> "StreamState":
        return StreamState(self)

    def error_event(self, message: str) -> bytes:
        failure = {"type": "error", "code": "proxy_error", "message": message, "param": None}
        return f"event: error\ndata: {compact(failure)}\n\n".encode()


FUNCTIONS_NAMESPACE = "functions"
ADDITIONAL_TOOLS = "additional_tools"


def _served_tool(tool: Any) -> Any:
    """A custom tool without its grammar (vLLM serves free-form ones only); any other tool as it is."""
    if not (isinstance(tool, dict) and tool.get("type") == "custom" and isinstance(tool.get("format"), dict)):
        return tool
    return {k: v for k, v in tool.items() if k != "format"} if tool["format"].get("type") == "grammar" else tool


def _flat_tools(tools: list[Any]) -> list[Any]:
    """Tools as vLLM serves them: the ``functions`` namespace opened, custom tools out of other namespaces."""
    out: list[Any] = []
    for tool in tools:
        if not (isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("tools"), list)):
            out.append(_served_tool(tool))
        elif tool.get("name") == FUNCTIONS_NAMESPACE:
            out += [_served_tool(inner) for inner in tool["tools"]]
        else:
            inner = [t for t in tool["tools"] if not (isinstance(t, dict) and t.get("type") == "custom")]
            out += [_served_tool(t) for t in tool["tools"] if isinstance(t, dict) and t.get("type") == "custom"]
            if inner:
                out.append({**tool, "tools": inner})
    return out


def _tool_key(tool: Any) -> tuple[Any, ...]:
    """Tools of one type and name are one tool; a tool named by anything but a string is its own."""
    if isinstance(tool, dict) and isinstance(tool.get("type"), str) and isinstance(tool.get("name"), str):
        return (tool["type"], tool["name"])
    return (id(tool),)


def normalise_request(body: dict[str, Any]) -> None:
    """Rewrite (in place) what vLLM does not serve as it came (see the module's docstring)."""
    items = body.get("input")
    extra: list[Any] = []
    items = items if isinstance(items, list) else []
    holders = [i for i in items if isinstance(i, dict) and i.get("type") == ADDITIONAL_TOOLS]
    if holders:
        extra = [tool for item in holders if isinstance(item.get("tools"), list) for tool in item["tools"]]
        body["input"] = [i for i in items if not (isinstance(i, dict) and i.get("type") == ADDITIONAL_TOOLS)]
    tools = body.get("tools")
    if not extra and not isinstance(tools, list):
        return
    flat, seen = [], set()
    for tool in _flat_tools((tools if isinstance(tools, list) else []) + extra):
        if (key := _tool_key(tool)) not in seen:
            seen.add(key)
            flat.append(tool)
    body["tools"] = flat


def prepare_request(api: str, body: dict[str, Any]) -> Additions:
    normalise_request(body)
    include = body.get("include") or []
    added = Additions(
        api=api,
        stream=bool(body.get("stream")),
        harness_messages=bool(body.get("enable_response_messages")),
        harness_logprobs=LOGPROBS_INCLUDE in include,
        harness_top_logprobs=body.get("top_logprobs") is not None,
    )
    body["enable_response_messages"] = True
    if not added.harness_logprobs:
        body["include"] = [*include, LOGPROBS_INCLUDE]
    return added


def _strip_content(content: dict[str, Any], added: Additions) -> bool:
    """Hide the logprobs of a finished text part; True if it changed."""
    if not added.harness_logprobs and content.get("type") == "output_text" and content.get("logprobs"):
        content["logprobs"] = None
        return True
    return False


def _strip_holder(holder: dict[str, Any], added: Additions) -> bool:
    """A text part, or an item holding parts; True if any changed."""
    changed = _strip_content(holder, added)
    for content in holder.get("content") or []:
        changed = _strip_content(content, added) or changed
    return changed


def strip_response(response: dict[str, Any], added: Additions) -> bool:
    """Undo in a response object what ``prepare_request`` made vLLM add; True if anything changed."""
    changed = False
    if not added.harness_messages:
        changed = clear(response, "input_messages") or changed
        changed = clear(response, "output_messages") or changed
    if not added.harness_logprobs and not added.harness_top_logprobs:
        changed = clear(response, "top_logprobs") or changed
    for item in response.get("output") or []:
        if isinstance(item, dict):
            changed = _strip_holder(item, added) or changed
    return changed


def _logprob_entries(response: dict[str, Any]) -> list[Any]:
    """The logprob entries of the output text, in output order."""
    return [
        entry
        for item in response.get("output") or []
        if isinstance(item, dict) and item.get("type") == "message"
        for content in item.get("content") or []
        if isinstance(content, dict) and content.get("type") == "output_text"
        for entry in content.get("logprobs") or []
    ]


# A tool parser holds back text that could begin its tag (hermes, which ``forge serve`` runs: ``<tool_call>``).
TAG_START = "<"


def _placeable_prefix(tokens: list[Any], text: str) -> int:
    """How many of the first logprob entries are surely those of the first ids, in order: the longest run from the
    start whose tokens spell the start of ``text`` without a gap, each token ASCII and free of ``TAG_START``.

    A stream's logprobs skip every step that sent no text (vLLM 0.32, ``responses/serving.py``, studied on the
    real server), so where fewer logprobs than ids came, the missing ones can be anywhere, not only at the end:
    - a step the tool parser held back (text that could start ``<tool_call>``: ``<b>`` came as 9 ids, 7 logprobs,
      the ``<`` step's missing, its text sent with the next step's logprob);
    - the first pieces of a character split across ids (one emoji = 3 ids, one logprob, its token the whole
      character: its text spells the output, so only refusing non-ASCII tokens keeps it from being shifted);
    - the end of turn and the function-call text.
    A gap before an ASCII token that spells the text at its place needs a held-back tag start, so the run stops at
    the first token that has ``<``, is not ASCII, or does not spell the text there; the rest are not placed."""
    offset = 0
    for placed, token in enumerate(tokens):
        if not (isinstance(token, str) and token and token.isascii() and TAG_START not in token):
            return placed
        if not text.startswith(token, offset):
            return placed
        offset += len(token)
    return len(tokens)


def align_logprobs(entries: list[Any], ids: int, text: str | None) -> tuple[list[float], str | None, str | None]:
    """(logprobs, note, error): one logprob per id, NaN where none was given or where it cannot be placed for sure
    (see ``_placeable_prefix``); an error only for more logprobs than ids."""
    values = [logprob(entry.get("logprob") if isinstance(entry, dict) else None) for entry in entries]
    if not values:
        return [math.nan] * ids, (NO_LOGPROBS_NOTE if ids else None), None
    if len(values) == ids:
        return values, None, None
    if len(values) > ids:
        return [math.nan] * ids, None, f"{len(values)} logprobs for {ids} output ids: they cannot be aligned"
    tokens = [entry.get("token") if isinstance(entry, dict) else None for entry in entries]
    placed = _placeable_prefix(tokens, text) if text is not None else 0
    if placed == len(values):
        note = (f"vLLM gave logprobs for the first {placed} of {ids} ids (the output text); the last "
                f"{ids - placed} (function-call text, end of turn) are NaN")  # fmt: skip
    else:
        note = (f"vLLM gave {len(values)} logprobs for {ids} ids, skipping steps that sent no text (a tag start the "
                f"tool parser held back, part of a character): the first {placed} are placed, the other "
                f"{ids - placed} ids NaN (which ids the later logprobs belong to is unknown)")  # fmt: skip
    return values[:placed] + [math.nan] * (ids - placed), note, None


def failure_message(event: dict[str, Any]) -> str:
    """The upstream's words for a failed answer (``response.failed``'s ``response.error``, or an ``error`` event)."""
    response = event.get("response")
    failure = (response.get("error") if isinstance(response, dict) else None) or event.get("error") or event
    if isinstance(failure, dict):
        code, message = failure.get("code"), failure.get("message")
        return f"{event.get('type')}: {code}: {message}" if code else f"{event.get('type')}: {message}"
    return f"{event.get('type')}: {failure}"


def sampled_from_response(response: dict[str, Any]) -> Sampled:
    inputs = response.get("input_messages") or []
    outputs = response.get("output_messages") or []
    prompt: list[int] | None = None
    if inputs:
        prompt = [token for message in inputs for token in message.get("tokens") or []]
    completion = [token for message in outputs for token in message.get("tokens") or []]
    texts = [message.get("message") for message in outputs]
    text = "".join(texts) if all(isinstance(t, str) for t in texts) else None  # harmony models: not raw text
    logprobs, note, error = align_logprobs(_logprob_entries(response), len(completion), text)
    details = response.get("incomplete_details") or {}
    return Sampled(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        finish_reason=details.get("reason") or response.get("status"),
        usage=response.get("usage"),
        model=response.get("model"),
        response_id=response.get("id"),
        n_choices=1,
        note=note,
        error=error,
        upstream_error=failure_message({"type": "response.failed", "response": response})
        if response.get("status") == "failed"
        else None,
    )


KEPT_STATUSES = ("completed", "incomplete")  # an answer the harness can refer to afterwards


def finish(added: Additions, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
    sampled = sampled_from_response(answer)
    strip_response(answer, added)
    if added.keep is not None and answer.get("status") in KEPT_STATUSES:
        added.keep(answer)
    return sampled, answer


class StreamState(DataStream):
    """Passes the event stream on live; takes the ids from ``response.completed`` and hides what was added.

    vLLM (0.32) ends every stream with ``response.completed``, an answer cut short (status ``incomplete``) too; the
    API ends that one with ``response.incomplete``. It is passed on as vLLM sends it: pi (0.73) reads the usage and
    the response id from ``response.completed`` only, so under a rollout's completion bound (most answers cut) it
    would lose them (``tests/sidecar/test_harness_qwen_pi.py``). Known, and said in docs/status.md."""

    def __init__(self, added: Additions) -> None:
        self.added = added
        self.sampled = Sampled()
        self.text: list[str] = []
        self.logprobs: list[float] = []
        self.items: list[dict[str, Any]] = []
        self.done = False  # saw the final response event

    def on_event(self, data: str) -> str | None:
        event = parse_data(data).payload
        if event is None:
            return data
        kind = event.get("type") or ""
        changed = False
        if kind == "response.output_text.delta":
            self.text.append(event.get("delta") or "")
            self.logprobs += [logprob(e.get("logprob")) for e in event.get("logprobs") or []]
            if not self.added.harness_logprobs and event.get("logprobs"):
                event["logprobs"], changed = [], True
        elif kind == "response.output_item.done" and isinstance(event.get("item"), dict):
            self.items.append(event["item"])
        response = event.get("response")
        if isinstance(response, dict):
            self.sampled.response_id = self.sampled.response_id or response.get("id")
            self.sampled.model = self.sampled.model or response.get("model")
            if kind in ("response.completed", "response.incomplete", "response.failed"):
                self.sampled = sampled_from_response(response)
                self.done = True
            changed = strip_response(response, self.added) or changed
            if self.added.keep is not None and kind in ("response.completed", "response.incomplete"):
                self.added.keep(response)
        if kind in FAILED_EVENTS:  # the answer ends with the upstream's failure: recorded as that, never ok
            self.sampled.upstream_error = failure_message(event)
            self.done = True
        for key in ("part", "item"):
            holder = event.get(key)
            if isinstance(holder, dict):
                changed = _strip_holder(holder, self.added) or changed
        return compact(event) if changed else data

    def summary(self) -> dict[str, Any]:
        """The streamed answer as far as it went, for ``response_json``."""
        out: dict[str, Any] = {"stream": True, "model": self.sampled.model, "content": "".join(self.text)}
        calls = [item for item in self.items if item.get("type") == "function_call"]
        if calls:
            out["function_calls"] = [
                {"call_id": c.get("call_id"), "name": c.get("name"), "arguments": c.get("arguments"),
                 **({"namespace": c["namespace"]} if c.get("namespace") else {})}
                for c in calls
            ]  # fmt: skip
        custom = [item for item in self.items if item.get("type") == "custom_tool_call"]
        if custom:
            out["custom_tool_calls"] = [
                {"call_id": c.get("call_id"), "name": c.get("name"), "input": c.get("input")} for c in custom
            ]
        if not self.done:
            out["logprobs_seen"] = len(self.logprobs)
        return out


def system_prompt(body: Mapping[str, Any]) -> list[str]:
    """The instructions, and the first system (or developer) item of the input."""
    texts = [body["instructions"]] if isinstance(body.get("instructions"), str) else []
    items = body.get("input")
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and item.get("role") in openai.SYSTEM_ROLES:
            texts.append(text_of(item.get("content")))
            break
    return texts


register(Api("responses", "POST", PATHS, RECORDED, openai.DIALECT, module=sys.modules[__name__],
             max_token_fields=("max_output_tokens",), system_prompt=system_prompt, stateful=True,
             tokens_in="responses"))  # fmt: skip
# Codex tries a WebSocket on GET /v1/responses first; a plain refusal makes it POST at once.
register(Api("responses_socket", "GET", PATHS, REFUSED, openai.DIALECT, refusal=(426, {"error": {
    "message": "WebSocket transport is not served here: use POST", "type": "invalid_request_error",
    "code": "websocket_not_supported"}}, "websocket_refused_total")))  # fmt: skip
# GET/DELETE /v1/responses/{id}, GET .../input_items: from the answers this episode was served.
register(Api("responses_stored", "*", (), ANSWERED, openai.DIALECT, matches=response_store.stored_path,
             answer=response_store.answer))  # fmt: skip
