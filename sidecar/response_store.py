"""Stateful OpenAI Responses, served from what the sidecar served: ``previous_response_id``, ``item_reference``,
``GET``/``DELETE /v1/responses/{id}``.

The OpenAI SDKs, the Agents SDK and the Vercel AI SDK default to ``store: true``: a tool loop's next request sends
``previous_response_id`` (the new input is appended to that response's input and output) or refers to earlier
items by id (``{"type": "item_reference", "id": ...}``) instead of sending the history. vLLM keeps no such state
(0.32 ignores ``store`` unless ``VLLM_ENABLE_RESPONSES_API_STORE``, and refuses ``item_reference``), so the sidecar
resolves both from the answers it served, per episode, and sends vLLM the whole input. The ids the harness refers
to are the ones it got: vLLM's response and item ids, relayed unchanged (the sidecar keeps them, no map needed).

- What is kept: for each answer served with ``store`` not false, the input vLLM was sent (resolved) and the answer
  as the harness got it, under the episode that made the call; items by id (output items, and input items the
  harness sent with an id). A call with ``store: false`` keeps nothing (today's behaviour); its references are
  still resolved, as the real API does.
- Episodes are walls: an id is looked up in the calling episode only. Another episode's response or item is
  answered exactly as an unknown one (404, the API's own error), so an agent can neither read nor splice another
  episode's records, nor learn that an id exists.
- Bounded: at most ``max_responses`` answers are kept (the oldest go first); a dropped one is "not found", as an
  expired one is at OpenAI.
- A restart keeps them: the sidecar writes each kept answer (and each drop) through to ``responses.sqlite`` in its
  WAL folder (the sidecar's uid only, mode 0600: the harness's own conversation, unredacted, as vLLM must be sent
  it; never a record), on a thread of its own so no call waits for the disk, and reads them back at start. A
  graceful stop writes everything first; a killed sidecar loses at most the answers of its last moments (their
  references are then 404, as an expired id's).
"""

import copy
import json
import logging
import os
import queue
import re
import sqlite3
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar import codec

log = logging.getLogger("openforge.sidecar")

MAX_RESPONSES = 4096
MAX_DISK_BYTES = 256 << 20  # responses.sqlite's bound (the oldest answers go first); the WAL has its own
MAX_QUEUED = 4096  # answers waiting for the disk; past it one is not written (a restart forgets it), counted
REFERENCE = "item_reference"
DB_FILE = "responses.sqlite"
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kept (n INTEGER PRIMARY KEY AUTOINCREMENT, response_id TEXT UNIQUE NOT NULL, "
    "episode TEXT NOT NULL, call_id TEXT NOT NULL, input BLOB NOT NULL, response BLOB NOT NULL)"
)


class NotFound(Exception):
    """A reference the episode cannot resolve: answered 404 in OpenAI's format."""

    def __init__(self, message: str, param: str | None, code: str | None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> bytes:
        error = {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": self.code}
        return json.dumps({"error": error}, separators=(",", ":")).encode()


def response_not_found(response_id: str, param: str | None = "previous_response_id") -> NotFound:
    """``previous_response_id`` unknown (param set), or ``GET``/``DELETE`` of an unknown response (param None)."""
    if param is None:
        return NotFound(f"Response with id '{response_id}' not found.", None, None)
    return NotFound(f"Previous response with id '{response_id}' not found.", param, "previous_response_not_found")


def item_not_found(item_id: str) -> NotFound:
    return NotFound(f"Item with id '{item_id}' not found.", "input", None)


@dataclass
class Kept:
    """One answer served: who asked, what vLLM was sent as input, what the harness got."""

    episode: str
    call_id: str  # the call record that served it
    input: list[Any]
    response: dict[str, Any]
    item_ids: list[str] = field(default_factory=list)  # the ids first kept with it

    def conversation(self) -> list[Any]:
        """What a request continuing it begins with: its input, then its output."""
        return self.input + list(self.response.get("output") or [])


def input_items(value: Any) -> list[Any]:
    """A request's ``input`` as a list of items (a string is one user message, as the API reads it)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value) if isinstance(value, list) else []


CALL_ITEMS = ("function_call", "custom_tool_call")


def _arguments(value: Any) -> Any:
    try:
        return json.loads(value) if isinstance(value, str) else value
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth: compared as the text
        return value


def same_call(a: Any, b: Any) -> bool:
    """Two tool-call items that say the same: type, call id, name and arguments (as JSON values: a client may
    serialize them again) or input. The ids and status a client drops or adds are not compared."""
    if not (isinstance(a, dict) and isinstance(b, dict)) or a.get("type") not in CALL_ITEMS:
        return False
    if any(a.get(key) != b.get(key) for key in ("type", "call_id", "name", "input")):
        return False
    return _arguments(a.get("arguments")) == _arguments(b.get("arguments"))


def has_references(body: dict[str, Any]) -> bool:
    items = body.get("input")
    return bool(body.get("previous_response_id")) or (
        isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == REFERENCE for i in items)
    )


class ResponseStore:
    """The answers served with ``store`` on, per episode (thread-safe: the addon's loop and its stream callbacks)."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_disk_bytes: int = MAX_DISK_BYTES) -> None:
        self.max_responses = max_responses
        self.max_disk_bytes = max_disk_bytes
        self.responses: OrderedDict[str, Kept] = OrderedDict()
        self.items: dict[tuple[str, Any], Any] = {}  # (episode, item id: a str) -> the item
        self.owners: dict[tuple[str, Any], str] = {}  # (episode, output item id) -> the response that answered it
        self.calls: dict[tuple[str, Any], str] = {}  # (episode, an output tool call's call id) -> its item id
        self.lock = threading.Lock()
        self.writes: queue.Queue[tuple[str, Kept | None] | None] | None = None  # to the disk, when persisted
        self.writer: threading.Thread | None = None
        self.unwritten = 0  # answers the disk did not get (queue full, or the write failed): a restart forgets them

    def persist(self, folder: Path) -> int:
        """Keep the answers in ``folder``/responses.sqlite too, from now on; the ones kept there before (the last
        ``max_responses``) are read back first. Returns how many. The file is the sidecar's own: created 0600,
        never through a link, refused when another uid owns it."""
        path = folder / DB_FILE
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise PermissionError(f"{path} belongs to another user")
            os.fchmod(fd, 0o600)  # SQLite gives its -wal and -shm files the database's mode
        finally:
            os.close(fd)
        for beside in (folder / f"{DB_FILE}-wal", folder / f"{DB_FILE}-shm"):
            if beside.is_symlink():
                raise PermissionError(f"{beside} is a link")
            if beside.exists():
                beside.chmod(0o600)
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # a committed answer survives the process; a power cut may lose it
        db.execute(SCHEMA)
        rows = db.execute(
            "SELECT episode, call_id, input, response FROM kept ORDER BY n DESC LIMIT ?", (self.max_responses,)
        ).fetchall()
        read = 0
        for episode, call_id, sent, response in reversed(rows):
            try:  # a row that cannot be read back is skipped: the others are still served
                kept = Kept(str(episode), str(call_id), list(codec.loads(sent)), dict(codec.loads(response)))
                if isinstance(kept.response.get("id"), str):
                    self._keep(kept)
                    read += 1
            except Exception as error:
                log.error("a stored response could not be read back (%s); skipped", type(error).__name__)
        db.execute("DELETE FROM kept WHERE n <= (SELECT MAX(n) FROM kept) - ?", (self.max_responses,))
        (size,) = db.execute("SELECT COALESCE(SUM(length(input) + length(response)), 0) FROM kept").fetchone()
        self.writes = queue.Queue(MAX_QUEUED)
        self.writer = threading.Thread(
            target=self._write, args=(db, self.writes, int(size)), name="forge-responses", daemon=True
        )
        self.writer.start()
        return read

    def _write(self, db: sqlite3.Connection, writes: "queue.Queue[tuple[str, Kept | None] | None]", size: int) -> None:
        """The disk's side: each kept answer inserted, each dropped one deleted, in order, the file kept within
        ``max_disk_bytes`` (oldest first); ``None`` ends it."""
        while (op := writes.get()) is not None:
            response_id, kept = op
            try:
                if kept is None:
                    db.execute("DELETE FROM kept WHERE response_id = ?", (response_id,))
                    continue
                row = (codec.dumps(kept.input), codec.dumps(kept.response))
                db.execute(
                    "INSERT OR REPLACE INTO kept (response_id, episode, call_id, input, response) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (response_id, kept.episode, kept.call_id, *row),
                )
                size += len(row[0]) + len(row[1])
                while size > self.max_disk_bytes:
                    oldest = db.execute("SELECT n, length(input) + length(response) FROM kept ORDER BY n LIMIT 1")
                    if (found := oldest.fetchone()) is None:
                        break
                    db.execute("DELETE FROM kept WHERE n = ?", (found[0],))
                    size -= found[1]
            except Exception as error:  # the answer stays served from memory; the thread goes on
                self.unwritten += 1
                log.error("a stored response could not be written to disk (%s); a restart forgets it",
                          type(error).__name__)  # fmt: skip
        db.close()

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is queued and close the file (a graceful stop)."""
        if self.writes is not None and self.writer is not None:
            writes, self.writes = self.writes, None
            try:
                writes.put(None, timeout=timeout_s)
            except queue.Full:
                return
            self.writer.join(timeout_s)

    def _response(self, episode: str, response_id: Any, param: str | None = "previous_response_id") -> Kept:
        kept = self.responses.get(response_id) if isinstance(response_id, str) else None
        if kept is None or kept.episode != episode:  # another episode's: the same answer as an unknown id
            raise response_not_found(str(response_id), param)
        return kept

    def resolve(self, episode: str, body: dict[str, Any]) -> str | None:
        """Rewrite (in place) a request's ``previous_response_id`` and ``item_reference`` items into the whole
        input. Returns the call id of the answer this request continues by construction (its input begins with
        that answer's whole input and output: ``previous_response_id``, or references to its output after its
        input), else None. Raises ``NotFound``."""
        with self.lock:
            previous = body.pop("previous_response_id", None)
            items: list[Any] = []
            continued: Kept | None = None
            if previous is not None:
                continued = self._response(episode, previous)
                items = copy.deepcopy(continued.conversation())
            for item in input_items(body.get("input")):
                if isinstance(item, dict) and item.get("type") == REFERENCE:
                    key = (episode, item.get("id"))
                    found = self.items.get(key) if isinstance(key[1], str) else None
                    if found is None:
                        raise item_not_found(str(item.get("id")))
                    if previous is None and key in self.owners:
                        continued = self.responses.get(self.owners[key])
                    item = copy.deepcopy(found)
                elif previous is None and (owner := self._resent_call(episode, item)) is not None:
                    continued = self.responses.get(owner)  # the tool call the answer made, resent by value
                items.append(item)
            if previous is not None or has_references(body):
                body["input"] = items
            conversation = continued.conversation() if continued is not None else []
            if continued is None or len(items) < len(conversation):
                return None
            if not all(a == b or same_call(a, b) for a, b in zip(items, conversation, strict=False)):
                return None
            return continued.call_id

    def _resent_call(self, episode: str, item: Any) -> str | None:
        """The stored response whose output holds this tool call, when a client resends it by value (the Vercel AI
        SDK, the Agents SDK: a function call is never sent as a reference): the same call id, name and arguments."""
        if not isinstance(item, dict) or item.get("type") not in CALL_ITEMS or not isinstance(item.get("call_id"), str):
            return None
        stored_id = self.calls.get((episode, item["call_id"]))
        stored = self.items.get((episode, stored_id)) if stored_id is not None else None
        if stored is None or not same_call(item, stored):
            return None
        return self.owners.get((episode, stored_id))

    def keep(self, episode: str, call_id: str, sent: list[Any], response: dict[str, Any]) -> None:
        """Remember an answer served (``response`` as the harness got it) with the whole input it answered."""
        if not isinstance(response.get("id"), str):
            return
        with self.lock:
            kept = Kept(episode, call_id, sent, copy.deepcopy(response))
            for dropped in self._keep(kept):
                self._written(dropped, None)
            self._written(kept.response["id"], kept)

    def _written(self, response_id: str, kept: Kept | None) -> None:
        if self.writes is not None:
            try:
                self.writes.put_nowait((response_id, kept))
            except queue.Full:  # the disk is behind: never wait for it on a call's path
                self.unwritten += 1

    def _keep(self, kept: Kept) -> list[str]:
        """Index an answer by its response id and item ids (the lock held, or at start); the ids of the answers
        dropped to stay within ``max_responses``."""
        response_id = kept.response["id"]
        output = list(kept.response.get("output") or [])
        for item in [*kept.input, *output]:  # an id kept already stays its first owner's
            key = (kept.episode, item.get("id")) if isinstance(item, dict) else None
            if key is not None and isinstance(key[1], str) and key not in self.items:
                self.items[key] = item
                kept.item_ids.append(key[1])
                if any(item is out for out in output):
                    self.owners[key] = response_id
                    if item.get("type") in CALL_ITEMS and isinstance(item.get("call_id"), str):
                        self.calls[(kept.episode, item["call_id"])] = key[1]
        self.responses[response_id] = kept
        dropped = []
        while len(self.responses) > self.max_responses:
            gone, old = self.responses.popitem(last=False)
            self._forget(old)
            dropped.append(gone)
        return dropped

    def _forget(self, kept: Kept) -> None:
        for item_id in kept.item_ids:
            item = self.items.pop((kept.episode, item_id), None)
            self.owners.pop((kept.episode, item_id), None)
            call_id = item.get("call_id") if isinstance(item, dict) else None  # any JSON a client sent: a str only
            if isinstance(call_id, str) and self.calls.get((kept.episode, call_id)) == item_id:
                del self.calls[(kept.episode, call_id)]

    def get(self, episode: str, response_id: str) -> dict[str, Any]:
        with self.lock:
            return copy.deepcopy(self._response(episode, response_id, None).response)

    def input_items(self, episode: str, response_id: str) -> list[Any]:
        with self.lock:
            return copy.deepcopy(self._response(episode, response_id, None).input)

    def delete(self, episode: str, response_id: str) -> None:
        with self.lock:
            kept = self._response(episode, response_id, None)
            del self.responses[response_id]
            self._forget(kept)
            self._written(response_id, None)


STORED_PATH = re.compile(r"/responses/([^/]+)(/input_items)?$")


def stored_path(method: str, path: str) -> bool:
    """``GET``/``DELETE /v1/responses/{id}`` or ``GET /v1/responses/{id}/input_items``: answered from the store."""
    match = STORED_PATH.search(path.split("?", 1)[0].rstrip("/"))
    return match is not None and (method == "GET" or (method == "DELETE" and not match.group(2)))


def answer(store: ResponseStore, episode: str, method: str, path: str) -> tuple[int, bytes]:
    """The status and JSON body the real API gives for a stored response, from what this episode was served."""
    match = STORED_PATH.search(path.split("?", 1)[0].rstrip("/"))
    if match is None:
        raise ValueError(f"not a stored response's path: {path}")
    response_id = match.group(1)
    try:
        if method == "DELETE":
            store.delete(episode, response_id)
            body: Any = {"id": response_id, "object": "response", "deleted": True}
        elif match.group(2):
            data = [item for item in store.input_items(episode, response_id) if isinstance(item, dict)]
            ids = [item.get("id") for item in data]
            body = {"object": "list", "data": data, "first_id": ids[0] if ids else None,
                    "last_id": ids[-1] if ids else None, "has_more": False}  # fmt: skip
        else:
            body = store.get(episode, response_id)
    except NotFound as refusal:
        return 404, refusal.body()
    return 200, json.dumps(body, separators=(",", ":")).encode()
