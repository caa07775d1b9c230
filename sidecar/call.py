"""One model call in flight (``Call``, kept in ``flow.metadata["forge_call"]``) and what tokens-in found for it
(``Decision``): the state every part of the sidecar reads and writes while the call is served."""

from dataclasses import dataclass, field
from typing import Any

from sidecar.apis import CompletionBound
from sidecar.apis.base import Served, StreamState, WireApi
from sidecar.replicas import Replica
from sidecar.sse import EventFramer


@dataclass
class Decision:
    """What the examination of one call found (kept on the call; the record's ``continuation`` and ``note``)."""

    state: str  # tokens_in | retokenized | rewrite
    note: str | None = None
    original_path: str = ""
    original_body: bytes = b""
    inner_added: Served | None = None  # the wire API's own additions, for the normal path should tokens-in fail
    timings_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class Call:
    """One model call in flight (kept in ``flow.metadata``)."""

    call_id: str
    api: str
    episode_id: str
    task_id: str | None
    run_id: str
    seq: int
    started_at: int
    host: str = ""
    path: str = ""
    model_requested: str | None = None
    request_json: str | None = None
    secrets: list[str] = field(default_factory=list)
    policy_version: str | None = None  # the server's weight version just before the call was sent
    policy_model: str | None = None  # the policy's served name when the call was sent: its version is the policy's
    module: WireApi | None = None  # the wire API's module in sidecar.apis
    added: Served | None = None  # its Additions
    stream: StreamState | None = None  # a streamed answer's state
    framer: EventFramer | None = None
    first_token_at: int | None = None
    recorded: bool = False
    stream_failed: bool = False
    error: str | None = None
    sampling: str | None = None  # the sampling parameters sent upstream (JSON)
    bound: CompletionBound | None = None  # how the completion's length was bounded
    harness: str | None = None  # which harness made the call (sidecar.harness)
    user_agent: str | None = None
    continuation: Decision | None = None  # what tokens-in continuation found (sidecar/continuation.py)
    replica: Replica | None = None  # the policy replica it was sent to (sidecar/replicas.py)
    moved_from: str | None = None  # the replica that served the episode's previous call, when it moved
    moved_why: str | None = None
    version_why: str | None = None  # why the record's version is unknown, for its note
    group: list[tuple[dict[str, Any], bool, str]] | None = None  # set: its record waits for the group commit


def moved_note(call: Call, note: str | None) -> str | None:
    """The record's note with the replica move said, when the episode moved to another replica for this call."""
    if call.moved_from is None:
        return note
    moved = f"moved from replica {call.moved_from} ({call.moved_why or 'down'})"
    return "; ".join(filter(None, [note, moved]))


def note_of(decision: Decision | None, note: str | None) -> str | None:
    """The record's note with the continuation's added."""
    if decision is None or not decision.note or (note and decision.note in note):
        return note
    return "; ".join(filter(None, [note, decision.note]))
