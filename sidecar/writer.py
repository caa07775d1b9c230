"""The record writer: a local write-ahead log, flushed to the store as Parquet files that appear atomically.

Every record is appended to the current WAL segment of its table with one unbuffered write before the harness
gets its answer, so a ``kill -9`` loses nothing delivered. A segment is closed by rows, bytes or age; the flusher
thread turns each closed segment into Parquet files named after it (``<sidecar-id>-<table>-<n>.parquet``) and
deletes it only after the store took them. A restart replays what is left under the same names, so a segment
written just before a crash is replaced whole, not duplicated. While the store is down segments wait on disk
(retried with backoff); past ``max_disk_bytes`` new records are dropped with a loud log line and a metric,
never by blocking or failing the harness's call.
"""

import logging
import marshal
import os
import struct
import threading
import time
import zlib
from array import array
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from sidecar.metrics import Metrics
from sidecar.record import SCHEMA_VERSION, TABLES
from sidecar.store import Store

log = logging.getLogger("openforge.sidecar")

_FRAME = struct.Struct("<II")  # payload length, adler32 (a torn or garbled tail is detected)
ID_COLUMNS = {"prompt_suffix_ids": "i", "completion_token_ids": "i", "completion_logprobs": "f"}
TIME_COLUMNS = ("started_at", "first_token_at", "finished_at", "at")


def pack_ids(values: list[int]) -> bytes:
    return array("i", values).tobytes()


def pack_floats(values: list[float]) -> bytes:
    return array("f", values).tobytes()


def now_us() -> int:
    return time.time_ns() // 1000


class Segment:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("ab", buffering=0)
        self.rows = 0
        self.bytes = self.file.tell()
        self.opened = time.monotonic()

    def append(self, payload: bytes) -> None:
        self.file.write(_FRAME.pack(len(payload), zlib.adler32(payload)) + payload)  # one syscall per record
        self.rows += 1
        self.bytes += _FRAME.size + len(payload)


def read_segment(path: Path) -> list[dict[str, Any]]:
    """The complete records of a segment; a torn or corrupt tail (a crash mid-write) ends it."""
    data = path.read_bytes()
    rows, offset = [], 0
    while offset + _FRAME.size <= len(data):
        length, checksum = _FRAME.unpack_from(data, offset)
        payload = data[offset + _FRAME.size : offset + _FRAME.size + length]
        if len(payload) < length or zlib.adler32(payload) != checksum:
            log.warning("%s: torn record at byte %d (a crash mid-write); the records before it are kept", path, offset)
            break
        rows.append(marshal.loads(payload))
        offset += _FRAME.size + length
    return rows


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


class RecordWriter:
    """Append records (any thread, never blocks on the store); a background thread flushes them as Parquet."""

    def __init__(
        self,
        wal_dir: Path,
        store: Store,
        sidecar_id: str,
        metrics: Metrics,
        max_rows: int = 2000,
        max_bytes: int = 64 << 20,
        max_age_s: float = 5.0,
        max_disk_bytes: int = 4 << 30,
    ) -> None:
        self.wal_dir = wal_dir
        self.store = store
        self.sidecar_id = sidecar_id
        self.metrics = metrics
        self.max_rows, self.max_bytes, self.max_age_s = max_rows, max_bytes, max_age_s
        self.max_disk_bytes = max_disk_bytes
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.current: dict[str, Segment] = {}
        self.next_number: dict[str, int] = defaultdict(int)
        self.closed_bytes = 0
        self.backoff_until = 0.0
        self.backoff_s = 0.5
        self.thread = threading.Thread(target=self._run, name="forge-flusher", daemon=True)
        wal_dir.mkdir(parents=True, exist_ok=True)
        left = self._closed_segments()  # left by an earlier run: replayed first
        for path in left:
            table, number = path.stem.rsplit("-", 1)
            self.next_number[table] = max(self.next_number[table], int(number) + 1)
            self.closed_bytes += path.stat().st_size
        self.metrics.set("wal_segments_replayed", len(left))

    # -- writing ----------------------------------------------------------------------------------------------
    def append(self, table: str, row: dict[str, Any]) -> bool:
        """Log one record durably. False (and a metric) when the disk bound is reached: the record is dropped."""
        payload = marshal.dumps(row)
        with self.lock:
            segment = self.current.get(table)
            in_use = self.closed_bytes + sum(s.bytes for s in self.current.values())
            if in_use + len(payload) > self.max_disk_bytes:
                self.metrics.inc("records_dropped_total")
                if self.metrics.get("records_dropped_total") % 100 == 1:
                    log.error(
                        "record dropped: the write-ahead log holds %d bytes, over its bound of %d (the store is "
                        "unreachable or too slow); the harness's call was not affected",
                        in_use,
                        self.max_disk_bytes,
                    )
                return False
            if segment is None:
                segment = self._open_segment(table)
            segment.append(payload)
            self.metrics.inc(f'records_logged_total{{table="{table}"}}')
            if segment.rows >= self.max_rows or segment.bytes >= self.max_bytes:
                self._rotate(table)
                self.wake.set()
        return True

    def _open_segment(self, table: str) -> Segment:
        number = self.next_number[table]
        self.next_number[table] += 1
        segment = Segment(self.wal_dir / f"{table}-{number:08d}.open")
        self.current[table] = segment
        return segment

    def _rotate(self, table: str) -> None:
        segment = self.current.pop(table, None)
        if segment is None:
            return
        segment.file.close()
        if segment.rows == 0:
            segment.path.unlink(missing_ok=True)
            return
        segment.path.rename(segment.path.with_suffix(".wal"))
        self.closed_bytes += segment.bytes

    def _closed_segments(self) -> list[Path]:
        # An ".open" segment left by a crash is as good as closed: its complete records are replayed.
        return sorted(
            list(self.wal_dir.glob("*.wal")) + [p for p in self.wal_dir.glob("*.open") if p not in self._open_paths()]
        )

    def _open_paths(self) -> set[Path]:
        return {s.path for s in self.current.values()}

    # -- flushing ---------------------------------------------------------------------------------------------
    def start(self) -> "RecordWriter":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.wake.wait(0.2)
            self.wake.clear()
            with self.lock:
                for table, segment in list(self.current.items()):
                    if segment.rows and time.monotonic() - segment.opened >= self.max_age_s:
                        self._rotate(table)
            if time.monotonic() >= self.backoff_until:
                self.flush_closed()

    def flush_closed(self) -> bool:
        """Write every closed segment to the store; True when none is left."""
        with self.lock:
            segments = self._closed_segments()
        for path in segments:
            try:
                self._flush_segment(path)
            except Exception as error:  # the store is down or refuses: keep the segment, retry later
                self.metrics.inc("store_write_errors_total")
                self.metrics.set("store_up", 0)
                log.error("could not write %s to the store (%s); retrying in %.1f s", path.name, error, self.backoff_s)
                self.backoff_until = time.monotonic() + self.backoff_s
                self.backoff_s = min(self.backoff_s * 2, 30.0)
                return False
        self.backoff_s = 0.5
        self.metrics.set("store_up", 1)
        return True

    def _flush_segment(self, path: Path) -> None:
        table, number = path.stem.rsplit("-", 1)
        rows = read_segment(path)
        groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            stamp = row.get("started_at") or row.get("at") or now_us()
            day = datetime.fromtimestamp(stamp / 1e6, UTC).strftime("%Y-%m-%d")
            groups[(row.get("run_id") or "default", day)].append(row)
        for (run, day), group in sorted(groups.items()):
            name = f"{table}/run={run}/date={day}/{self.sidecar_id}-{table}-{number}.parquet"
            self.store.write_parquet(name, rows_to_table(group, table))
        size = path.stat().st_size
        path.unlink()
        with self.lock:
            self.closed_bytes = max(0, self.closed_bytes - size)
        self.metrics.inc(f'records_stored_total{{table="{table}"}}', len(rows))
        self.metrics.inc("files_written_total", len(groups))

    def close(self, timeout_s: float = 10.0) -> bool:
        """Rotate and flush everything (SIGTERM); what the store does not take in time stays in the WAL."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2.0)
        with self.lock:
            for table in list(self.current):
                self._rotate(table)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.flush_closed():
                return True
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        log.error("shutting down with records not yet in the store: they stay in %s and are replayed", self.wal_dir)
        return False


def sidecar_identity(wal_dir: Path) -> str:
    """A stable id per WAL folder (so a restarted sidecar replays under its own name), unique per sidecar."""
    wal_dir.mkdir(parents=True, exist_ok=True)
    marker = wal_dir / "sidecar-id"
    if marker.exists():
        return marker.read_text().strip()
    base = os.environ.get("POD_NAME") or os.uname().nodename
    identity = f"{''.join(c if c.isalnum() or c in '-_' else '-' for c in base)}-{os.urandom(3).hex()}"
    marker.write_text(identity)
    return identity
