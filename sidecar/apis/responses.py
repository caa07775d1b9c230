"""OpenAI Responses (Codex's only API) as vLLM serves it: ids from ``enable_response_messages``, logprobs from
``include: ["message.output_text.logprobs"]``, both hidden from the harness.

vLLM gives the token ids of the rendered prompt (``input_messages[].tokens``) and of the sampled output
(``output_messages[].tokens``) in the whole answer, and when streaming only in ``response.completed``: a stream
cut before that event has text and logprobs but no ids. Logprobs come for output text only: an answer with a
``function_call`` item records its ids with NaN logprobs, and a stream's final response lacks the end-of-turn
token's logprob (NaN); the record's ``note`` says so. Ids are always exact; a NaN logprob means "not given".
What the harness gets is what vLLM writes when not asked: message lists null, delta logprobs ``[]``, the
logprobs of finished text parts null, ``top_logprobs`` null.
"""

import json
import math
from dataclasses import dataclass
from typing import Any

from sidecar.apis.base import DataStream, Sampled, clear, compact, logprob

PATHS = ("/v1/responses", "/responses")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
NO_LOGPROBS_NOTE = "vLLM gives no logprobs for function-call output: completion_logprobs are NaN"


@dataclass
class Additions:
    api: str
    stream: bool
    harness_messages: bool  # the harness asked for enable_response_messages itself
    harness_logprobs: bool  # ... or for the output-text logprobs
    harness_top_logprobs: bool
    upstream_path: str | None = None


def prepare_request(api: str, body: dict[str, Any]) -> Additions:
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


def sampled_from_response(response: dict[str, Any]) -> Sampled:
    inputs = response.get("input_messages") or []
    outputs = response.get("output_messages") or []
    prompt: list[int] | None = None
    if inputs:
        prompt = [token for message in inputs for token in message.get("tokens") or []]
    completion = [token for message in outputs for token in message.get("tokens") or []]
    logprobs = [
        logprob(entry.get("logprob"))
        for item in response.get("output") or []
        if item.get("type") == "message"
        for content in item.get("content") or []
        if content.get("type") == "output_text"
        for entry in content.get("logprobs") or []
    ]
    note = None
    missing = len(completion) - len(logprobs)
    if any(item.get("type") == "function_call" for item in response.get("output") or []):
        note, logprobs = NO_LOGPROBS_NOTE, [math.nan] * len(completion)
    elif missing > 0:  # a stream's final response lacks the end-of-turn token's logprob
        note, logprobs = (
            f"vLLM gave no logprob for the last {missing} of {len(completion)} ids: NaN",
            logprobs + [math.nan] * missing,
        )
    elif missing < 0:
        note, logprobs = (
            f"{len(logprobs)} logprobs for {len(completion)} ids: completion_logprobs left NaN",
            [math.nan] * len(completion),
        )
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
    )


def finish(added: Additions, answer: dict[str, Any]) -> tuple[Sampled, dict[str, Any]]:
    sampled = sampled_from_response(answer)
    strip_response(answer, added)
    return sampled, answer


class StreamState(DataStream):
    """Passes the event stream on live; takes the ids from ``response.completed`` and hides what was added."""

    def __init__(self, added: Additions) -> None:
        self.added = added
        self.sampled = Sampled()
        self.text: list[str] = []
        self.logprobs: list[float] = []
        self.items: list[dict[str, Any]] = []
        self.done = False  # saw the final response event
        self.events = 0

    def on_event(self, data: str) -> str | None:
        self.events += 1
        try:
            event = json.loads(data)
        except ValueError:
            return data
        if not isinstance(event, dict):
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
                {"call_id": c.get("call_id"), "name": c.get("name"), "arguments": c.get("arguments")} for c in calls
            ]
        if not self.done:
            out["logprobs_seen"] = len(self.logprobs)
        return out
