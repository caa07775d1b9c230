"""The record writer: a write-ahead log in SQLite, flushed to the store as Parquet files that appear atomically.

Every record is committed to the WAL (``<wal-dir>/wal.sqlite``) before the harness gets its answer (records of
calls that end together may share one transaction: ``append_many``), so a ``kill -9`` loses nothing delivered:
SQLite's journal makes each commit atomic (a torn write rolls back only itself) and ``--fsync`` says when it
reaches the disk: ``always`` (every commit, survives a machine crash), ``interval`` (the default: a checkpoint each
second, so a machine crash loses at most about a second; a process kill loses nothing) or ``never`` (the OS
decides). Rows are plain JSON plus little-endian int32/float32 blobs for
the ids, readable by any Python.

The flusher thread cuts the pending rows of a table into numbered batches (by rows, bytes or age) and writes
each batch as Parquet named ``<sidecar-id>-<table>-b<batch>.parquet``; the rows leave the WAL only after the
store took every file. Names never collide: the sidecar id is random per WAL database, batch numbers never
repeat, and a batch replayed after a crash rewrites exactly the rows it had. The store is never asked to replace
an object: a name already there is that same batch, written before the crash. A row that cannot be converted
(should one ever get past ``CallRecord``) is moved to ``<wal-dir>/quarantine/`` and counted; the rest go on.
While the store is down batches wait on disk (retried with backoff); past ``max_disk_bytes`` new records are
dropped with a loud log line and a metric, never by blocking or failing the harness's call.

The WAL also keeps each episode's next call number (``seq``), so call order survives a restart.
"""

import base64
import json
import logging
import marshal
import os
import sqlite3
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from sidecar import codec
from sidecar.metrics import Metrics
from sidecar.record import SCHEMA_VERSION, TABLES
from sidecar.store import Store

log = logging.getLogger("openforge.sidecar")

WAL_FILE = "wal.sqlite"
FSYNC_POLICIES = {"always": "FULL", "interval": "NORMAL", "never": "OFF"}
CHECKPOINT_INTERVAL_S = 1.0
# The longest a row waits for a value still to come (``complete``) before it is batched without it: as long as the
# version question after a call takes when the server is busy (vLLM answers it between engine steps: a fresh
# server's first steps took over 10 s; sidecar/version.py), with room for calls that ended while an earlier
# question was out. Only a slow answer makes rows wait (the rows after a held one wait with it, to keep their order).
HOLD_S = 45.0
CUT_EVERY_S = 1.0  # how often the flusher looks for a batch to cut (unless --flush-seconds is shorter)
MAX_EPISODE_COUNTERS = 100_000  # seq counters kept; the least recently used beyond this are forgotten
# The id columns travel as packed little-endian bytes and become list arrays without a Python loop.
ID_COLUMNS = {"prompt_suffix_ids": "i", "completion_token_ids": "i", "completion_logprobs": "f"}
_BLOBS = tuple(ID_COLUMNS)
_TEXTS = ("request_json", "response_json")  # big strings get columns of their own: not escaped into the JSON
_RAW = (*_BLOBS, *_TEXTS)
TIME_COLUMNS = ("started_at", "first_token_at", "finished_at", "at")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT, tbl TEXT NOT NULL, size INTEGER NOT NULL, logged_at REAL NOT NULL,
    fields TEXT NOT NULL, prompt_suffix_ids BLOB, completion_token_ids BLOB, completion_logprobs BLOB,
    request_json TEXT, response_json TEXT);
CREATE TABLE IF NOT EXISTS batches (
    number INTEGER PRIMARY KEY AUTOINCREMENT, tbl TEXT NOT NULL, first_id INTEGER NOT NULL, last_id INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS episodes (episode_id TEXT PRIMARY KEY, next_seq INTEGER NOT NULL, touched REAL NOT NULL);
"""


_INSERT = f"INSERT INTO records (tbl, size, logged_at, fields, {', '.join(_RAW)}) VALUES ({', '.join('?' * 9)})"


def _encode(table: str, row: Mapping[str, Any]) -> tuple[str, str, list[Any], int]:
    """A record as the WAL stores it: (table, its plain fields as JSON, the raw columns, its size in bytes)."""
    fields = {k: v for k, v in row.items() if k not in _RAW}
    text = codec.dumps_text(fields, default=str)
    raw = [row.get(name) for name in _BLOBS] + [_text_or_none(row.get(name)) for name in _TEXTS]
    return table, text, raw, len(text) + sum(len(value) for value in raw if value)


def now_us() -> int:
    return time.time_ns() // 1000


def rows_to_table(rows: list[dict[str, Any]], table: str) -> pa.Table:
    """WAL rows to Arrow. Id columns travel as packed bytes and become list arrays without a Python loop."""
    schema = TABLES[table]
    columns: dict[str, pa.Array] = {}
    for field in schema:
        name = field.name
        if name == "schema_version":
            columns[name] = pa.array([SCHEMA_VERSION] * len(rows), field.type)
        elif name in ID_COLUMNS:
            packed = [row.get(name) for row in rows]
            offsets = array("i", [0])
            for chunk in packed:
                offsets.append(offsets[-1] + (len(chunk) // 4 if chunk else 0))
            value_type = pa.int32() if ID_COLUMNS[name] == "i" else pa.float32()
            values = pa.Array.from_buffers(
                value_type, offsets[-1], [None, pa.py_buffer(b"".join(c or b"" for c in packed))]
            )
            mask = pa.array([chunk is None for chunk in packed])
            columns[name] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, mask=mask)
        elif name in TIME_COLUMNS:
            columns[name] = pa.array([row.get(name) for row in rows], pa.int64()).cast(field.type)
        elif name == "components":
            columns[name] = pa.array([list((row.get(name) or {}).items()) or None for row in rows], field.type)
        else:
            columns[name] = pa.array([row.get(name) for row in rows], field.type)
    return pa.Table.from_pydict(columns, schema=schema)


def _day(row: dict[str, Any]) -> str:
    stamp = row.get("started_at") or row.get("at") or now_us()
    return datetime.fromtimestamp(stamp / 1e6, UTC).strftime("%Y-%m-%d")


class RecordWriter:
    """Append records (any thread, never blocks on the store); a background thread flushes them as Parquet."""

    def __init__(
        self,
        wal_dir: Path,
        store: Store,
        metrics: Metrics,
        max_rows: int = 2000,
        max_bytes: int = 64 << 20,
        max_age_s: float = 5.0,
        max_disk_bytes: int = 4 << 30,
        fsync: str = "interval",
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy {fsync!r}: use one of {', '.join(FSYNC_POLICIES)}")
        self.wal_dir = wal_dir
        self.store = store
        self.metrics = metrics
        self.max_rows, self.max_bytes, self.max_age_s = max_rows, max_bytes, max_age_s
        self.max_disk_bytes = max_disk_bytes
        self.fsync = fsync
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.backoff_until = 0.0
        self.backoff_s = 0.5
        self.last_checkpoint = time.monotonic()
        self.held: dict[int, float] = {}  # row id -> until when it waits for ``complete``
        self.thread = threading.Thread(target=self._run, name="forge-flusher", daemon=True)
        wal_dir.mkdir(parents=True, exist_ok=True)
        self.db = open_wal(wal_dir, fsync)
        self.pending_bytes = 0
        self.sidecar_id = self._meta("sidecar_id") or self._new_identity()
        self.seqs: OrderedDict[str, int] = OrderedDict()  # episode -> next seq, most recently used last
        imported = import_legacy_segments(wal_dir, self)
        self._recover_seqs()
        with self.lock:
            self.pending_bytes = self.db.execute("SELECT COALESCE(SUM(size), 0) FROM records").fetchone()[0]
            left = self.db.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        self.metrics.set("wal_records_replayed", left)
        if left:
            log.info("replaying %d records left in the write-ahead log (%d from an earlier release)", left, imported)

    # -- identity and call order ------------------------------------------------------------------------------
    def _meta(self, key: str) -> str | None:
        with self.lock:
            return self._meta_locked(key)

    def _new_identity(self) -> str:
        base = os.environ.get("POD_NAME") or os.uname().nodename
        identity = f"{''.join(c if c.isalnum() or c in '-_' else '-' for c in base)}-{os.urandom(4).hex()}"
        with self.lock:
            self.db.execute("INSERT INTO meta VALUES ('sidecar_id', ?)", (identity,))
        return identity

    def next_seq(self, episode_id: str) -> int:
        """The episode's next call number: a restarted sidecar goes on counting where it stopped.

        Counted in memory (no disk write per call). What persists it: the records themselves (a record in the WAL
        carries its seq; a restart reads the highest per episode back, ``_recover_seqs``), the ``episodes`` table
        (a batch's highest seq per episode is written there in the transaction that takes its rows out of the
        WAL), and a graceful close. A number handed to a call that was never recorded may be handed out again
        after a crash: no record carries it."""
        with self.lock:
            seq = self.seqs.pop(episode_id, None)
            if seq is None:
                found = self.db.execute("SELECT next_seq FROM episodes WHERE episode_id = ?", (episode_id,)).fetchone()
                seq = int(found[0]) if found else 0
            self.seqs[episode_id] = seq + 1
            if len(self.seqs) > MAX_EPISODE_COUNTERS:  # the least recently used counter goes to disk
                self._persist_seqs([self.seqs.popitem(last=False)])
        return seq

    def _persist_seqs(self, counters: list[tuple[str, int]]) -> None:
        """Raise the stored next seq of these episodes to at least these values (lock held)."""
        self.db.executemany(
            "INSERT INTO episodes VALUES (?, ?, ?) ON CONFLICT (episode_id) DO UPDATE "
            "SET next_seq = MAX(next_seq, excluded.next_seq), touched = excluded.touched",
            [(episode, value, time.time()) for episode, value in counters],
        )

    def _recover_seqs(self) -> None:
        """Fold the seqs of the call records still in the WAL (a crash before their flush) into ``episodes``."""
        with self.lock, self.db:
            self.db.execute(
                "INSERT INTO episodes (episode_id, next_seq, touched) "
                "SELECT json_extract(fields, '$.episode_id'), MAX(json_extract(fields, '$.seq')) + 1, ? FROM records "
                "WHERE tbl = 'calls' AND json_type(fields, '$.episode_id') = 'text' "
                "AND json_type(fields, '$.seq') = 'integer' GROUP BY 1 "
                "ON CONFLICT (episode_id) DO UPDATE SET next_seq = MAX(next_seq, excluded.next_seq)",
                (time.time(),),
            )

    # -- writing ----------------------------------------------------------------------------------------------
    def append(self, table: str, row: Mapping[str, Any], hold: bool = False) -> int | None:
        """Log one record durably; its WAL row id, or None (and a metric) when the disk bound is reached: the
        record is dropped. ``hold``: a value of the record is still to come (``complete``); the row waits for it,
        at most ``HOLD_S``, before it goes into a batch."""
        encoded = _encode(table, row)
        with self.lock:
            row_id = self._insert_locked(encoded, hold)
        if row_id is not None:
            self.metrics.inc("wal_commits_total")
            self.metrics.inc(f'records_logged_total{{table="{table}"}}')
        return row_id

    def append_many(self, records: Sequence[tuple[str, Mapping[str, Any], bool]]) -> list[int | Exception | None]:
        """Group commit: log several records (table, row, hold) in one transaction, each as ``append`` would; per
        record its row id, None (dropped at the disk bound) or the exception that kept it out. All are committed
        when this returns, or none of a failed transaction is: then each is tried alone, so one record that cannot
        be written never takes the others with it."""
        if len(records) == 1:
            return [self._append_or_error(*records[0])]
        encoded = [(_encode(table, row), hold) for table, row, hold in records]
        results: list[int | Exception | None] = []
        try:
            with self.lock:
                bytes_before, held_before = self.pending_bytes, dict(self.held)
                self.db.execute("BEGIN")
                try:
                    results = [self._insert_locked(one, hold) for one, hold in encoded]
                    self.db.execute("COMMIT")
                except BaseException:
                    self.db.execute("ROLLBACK")  # nothing of it was committed: no row id handed out stands
                    self.pending_bytes, self.held = bytes_before, held_before
                    raise
        except Exception as error:  # one at a time instead, each with its own outcome
            log.warning(
                "a group commit failed (%s: %s); its records are logged one by one", type(error).__name__, error
            )
            return [self._append_or_error(table, row, hold) for table, row, hold in records]
        self.metrics.inc("wal_commits_total")
        for (table, _, _), result in zip(records, results, strict=True):
            if result is not None:
                self.metrics.inc(f'records_logged_total{{table="{table}"}}')
        return results

    def _append_or_error(self, table: str, row: Mapping[str, Any], hold: bool) -> int | Exception | None:
        try:
            return self.append(table, row, hold)
        except Exception as error:
            return error

    def _insert_locked(self, encoded: tuple[str, str, list[Any], int], hold: bool) -> int | None:
        """One record into the WAL (lock held; committed at once unless inside a transaction)."""
        table, text, raw, size = encoded
        if self.pending_bytes + size > self.max_disk_bytes:
            self.metrics.inc("records_dropped_total")
            if self.metrics.get("records_dropped_total") % 100 == 1:
                log.error(
                    "record dropped: the write-ahead log holds %d bytes, over its bound of %d (the store is "
                    "unreachable or too slow); the harness's call was not affected",
                    self.pending_bytes,
                    self.max_disk_bytes,
                )
            return None
        row_id = int(self.db.execute(_INSERT, (table, size, time.time(), text, *raw)).lastrowid or 0)
        self.pending_bytes += size
        if hold:
            self.held[row_id] = time.monotonic() + HOLD_S
        return row_id

    def complete(self, row_id: int, values: dict[str, Any]) -> None:
        """Set values of a held row (e.g. the weight version asked after the call) and release it."""
        self.complete_many([row_id], values)

    def complete_many(self, row_ids: list[int], values: dict[str, Any]) -> None:
        """Set the same values in several held rows (one version question answers for every call it followed) and
        release them: one statement, the JSON edited by SQLite."""
        paths = ", ".join(f"'$.\"{key}\"', json(?)" for key in values)
        encoded = [json.dumps(value, default=str) for value in values.values()]
        with self.lock:
            waiting = [row_id for row_id in row_ids if self.held.pop(row_id, None) is not None]
            if len(waiting) < len(row_ids):  # already batched: the values stay unknown
                self.metrics.inc("records_completed_late_total", len(row_ids) - len(waiting))
            if waiting and values:
                rows = ", ".join("?" * len(waiting))
                self.db.execute(f"UPDATE records SET fields = json_set(fields, {paths}) WHERE id IN ({rows})",
                                (*encoded, *waiting))  # fmt: skip

    def pending(self) -> int:
        """Records not yet in the store."""
        with self.lock:
            return int(self.db.execute("SELECT COUNT(*) FROM records").fetchone()[0])

    # -- batching and flushing --------------------------------------------------------------------------------
    def start(self) -> "RecordWriter":
        self.thread.start()
        return self

    def _run(self) -> None:
        last_cut = 0.0
        while not self.stopping.is_set():
            self.wake.wait(0.2)
            self.wake.clear()
            try:
                # Looking for a batch to cut reads every pending row with the lock held (appends wait): at most
                # every CUT_EVERY_S, or every --flush-seconds when that is shorter.
                if time.monotonic() - last_cut >= min(CUT_EVERY_S, self.max_age_s):
                    last_cut = time.monotonic()
                    self.cut_batches()
                if time.monotonic() >= self.backoff_until:
                    self.flush_batches()
                self._housekeeping()
            except Exception as error:  # never let the flusher die: the next tick retries
                self.metrics.inc("internal_errors_total")
                log.error("the flusher failed (%s: %s); retrying", type(error).__name__, error)
                self.stopping.wait(1.0)

    def _housekeeping(self) -> None:
        if self.fsync == "interval" and time.monotonic() - self.last_checkpoint >= CHECKPOINT_INTERVAL_S:
            with self.lock:  # a checkpoint syncs the journal: commits before it survive a machine crash
                self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                self.db.execute(
                    "DELETE FROM episodes WHERE episode_id IN (SELECT episode_id FROM episodes ORDER BY touched DESC "
                    "LIMIT -1 OFFSET ?)",
                    (MAX_EPISODE_COUNTERS,),
                )
            self.last_checkpoint = time.monotonic()

    def cut_batches(self, everything: bool = False) -> None:
        """Close the pending rows of each table into batches: by rows, bytes or age (``everything``: all now)."""
        with self.lock:
            for (table,) in self.db.execute("SELECT DISTINCT tbl FROM records").fetchall():
                now = time.monotonic()
                for row_id in [r for r, until in self.held.items() if until <= now or everything]:
                    del self.held[row_id]  # its value never came: it goes on without it
                    self.metrics.inc("records_hold_expired_total")
                below = min(self.held, default=1 << 62)  # rows stay in order: nothing at or past a held row
                while True:
                    after = int(self._meta_locked(f"batched:{table}") or 0)
                    rows = self.db.execute(
                        "SELECT id, size, logged_at FROM records WHERE tbl = ? AND id > ? AND id < ? ORDER BY id "
                        "LIMIT ?",
                        (table, after, below, self.max_rows),
                    ).fetchall()
                    if not rows:
                        break
                    total, last = 0, rows[0][0]
                    for row_id, size, _ in rows:
                        if total and total + size > self.max_bytes:
                            break
                        total, last = total + size, row_id
                    full = len(rows) >= self.max_rows or total >= self.max_bytes or last != rows[-1][0]
                    if not (everything or full or time.time() - rows[0][2] >= self.max_age_s):
                        break
                    with self.db:  # one transaction: the batch and its cursor
                        self.db.execute(
                            "INSERT INTO batches (tbl, first_id, last_id) VALUES (?, ?, ?)", (table, rows[0][0], last)
                        )
                        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (f"batched:{table}", str(last)))

    def _meta_locked(self, key: str) -> str | None:
        found = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return found[0] if found else None

    def flush_batches(self) -> bool:
        """Write every closed batch to the store; True when none is left."""
        with self.lock:
            batches = self.db.execute("SELECT number, tbl, first_id, last_id FROM batches ORDER BY number").fetchall()
        for number, table, first, last in batches:
            try:
                self._flush_batch(number, table, first, last)
            except Exception as error:  # the store is down or refuses: keep the batch, retry later
                self.metrics.inc("store_write_errors_total")
                self.metrics.set("store_up", 0)
                log.error("could not write batch %d to the store (%s); retrying in %.1f s", number, error,
                          self.backoff_s)  # fmt: skip
                self.backoff_until = time.monotonic() + self.backoff_s
                self.backoff_s = min(self.backoff_s * 2, 30.0)
                return False
        self.backoff_s = 0.5
        self.metrics.set("store_up", 1)
        return True

    def _read_batch(self, table: str, first: int, last: int) -> list[dict[str, Any]]:
        with self.lock:
            found = self.db.execute(
                f"SELECT fields, {', '.join(_RAW)} FROM records WHERE tbl = ? AND id BETWEEN ? AND ? ORDER BY id",
                (table, first, last),
            ).fetchall()
        return [{**codec.loads(fields), **dict(zip(_RAW, raw, strict=True))} for fields, *raw in found]

    def _flush_batch(self, number: int, table: str, first: int, last: int) -> None:
        rows = self._read_batch(table, first, last)
        groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            groups[(str(row.get("run_id") or "default"), _day(row))].append(row)
        written = 0
        for (run, day), group in sorted(groups.items()):
            name = f"{table}/run={run}/date={day}/{self.sidecar_id}-{table}-b{number:08d}.parquet"
            arrow = self._convert(group, table, f"{table}-b{number:08d}-{run}-{day}")
            if arrow is not None and arrow.num_rows:
                if not self.store.write_parquet_new(name, arrow):
                    log.info("%s is already in the store (written before a restart): kept as it is", name)
                written += 1
        highest: dict[str, int] = {}  # each episode's next seq, kept on disk once its records leave the WAL
        for row in rows if table == "calls" else ():
            episode, seq = row.get("episode_id"), row.get("seq")
            if isinstance(episode, str) and isinstance(seq, int):
                highest[episode] = max(highest.get(episode, 0), seq + 1)
        with self.lock, self.db:  # the rows leave the WAL only now, in one transaction
            self._persist_seqs(list(highest.items()))
            where = ("tbl = ? AND id BETWEEN ? AND ?", (table, first, last))
            (freed,) = self.db.execute(
                f"SELECT COALESCE(SUM(size), 0) FROM records WHERE {where[0]}", where[1]
            ).fetchone()
            self.db.execute(f"DELETE FROM records WHERE {where[0]}", where[1])
            self.db.execute("DELETE FROM batches WHERE number = ?", (number,))
            self.pending_bytes -= freed  # the batch's own rows, not a scan of everything still waiting
        self.metrics.inc(f'records_stored_total{{table="{table}"}}', len(rows))
        self.metrics.inc("files_written_total", written)

    def _convert(self, rows: list[dict[str, Any]], table: str, label: str) -> pa.Table | None:
        """Rows to Arrow; rows that cannot be converted go to the quarantine folder, the others on."""
        try:
            return rows_to_table(rows, table)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            pass
        good, bad = [], []
        for row in rows:
            try:
                rows_to_table([row], table)
                good.append(row)
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as error:
                bad.append((row, f"{type(error).__name__}: {error}"))
        folder = self.wal_dir / "quarantine"
        folder.mkdir(exist_ok=True)
        with (folder / f"{label}.jsonl").open("a") as out:
            for row, reason in bad:
                out.write(json.dumps({"reason": reason, "row": _jsonable(row)}, default=str) + "\n")
        self.metrics.inc("records_quarantined_total", len(bad))
        log.error(
            "%d record(s) of %s could not be converted to Parquet (first: %s); moved to %s, the others go on",
            len(bad), label, bad[0][1], folder,
        )  # fmt: skip
        return rows_to_table(good, table) if good else None

    def close(self, timeout_s: float = 10.0, wait_held: bool = True) -> bool:
        """Batch and flush everything (SIGTERM); what the store does not take in time stays in the WAL. Rows held
        for a value still to come wait for it (within ``timeout_s``) unless ``wait_held`` is off: the sidecar
        settles its version questions first, on the event loop this call blocks."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5.0)
        deadline = time.monotonic() + timeout_s
        while wait_held and self.held and time.monotonic() < min(deadline, time.monotonic() + HOLD_S):
            time.sleep(0.02)
        done = False
        while True:
            self.cut_batches(everything=True)
            if self.flush_batches():
                done = True
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        with self.lock:
            with self.db:
                self._persist_seqs(list(self.seqs.items()))
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        if not done:
            log.error("shutting down with records not yet in the store: they stay in %s and are replayed", self.wal_dir)
        return done


def open_wal(wal_dir: Path, fsync: str = "interval") -> sqlite3.Connection:
    db = sqlite3.connect(wal_dir / WAL_FILE, isolation_level=None, check_same_thread=False, timeout=30.0)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA synchronous={FSYNC_POLICIES[fsync]}")
    db.executescript(_SCHEMA)
    return db


def pending_records(wal_dir: Path) -> int:
    """Records a stopped sidecar left in its WAL (0 when there is none): what a restart will replay."""
    if not (wal_dir / WAL_FILE).exists():
        return 0
    db = sqlite3.connect(f"file:{wal_dir / WAL_FILE}?mode=ro", uri=True, timeout=10.0)
    try:
        return int(db.execute("SELECT COUNT(*) FROM records").fetchone()[0])
    finally:
        db.close()


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) or value is None else json.dumps(value, default=str)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in row.items()}


# -- the previous release's WAL: marshal frames in <table>-<n>.wal/.open files, replayed once into SQLite --------
_LEGACY_FRAME = struct.Struct("<II")  # payload length, adler32


def read_legacy_segment(path: Path) -> list[dict[str, Any]]:
    """The complete records of a segment the previous release wrote; a torn frame ends it."""
    data = path.read_bytes()
    rows, offset = [], 0
    while offset + _LEGACY_FRAME.size <= len(data):
        length, checksum = _LEGACY_FRAME.unpack_from(data, offset)
        payload = data[offset + _LEGACY_FRAME.size : offset + _LEGACY_FRAME.size + length]
        if len(payload) < length or zlib.adler32(payload) != checksum:
            log.warning("%s: torn record at byte %d; the records before it are kept", path, offset)
            break
        rows.append(marshal.loads(payload))
        offset += _LEGACY_FRAME.size + length
    return rows


def import_legacy_segments(wal_dir: Path, writer: RecordWriter) -> int:
    """Move the previous release's segments into the SQLite WAL (then delete them); the number of records."""
    count = 0
    for path in sorted([*wal_dir.glob("*.wal"), *wal_dir.glob("*.open")]):
        table = path.stem.rsplit("-", 1)[0]
        if table not in TABLES:
            continue
        for row in read_legacy_segment(path):
            writer.append(table, row)
            count += 1
        with writer.lock:
            writer.db.execute("PRAGMA wal_checkpoint(FULL)")  # imported rows on disk before the old file goes
        path.unlink()
    return count
