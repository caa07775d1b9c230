"""Incremental collection: the store's call and reward files → segments and episodes, kept in a state folder.

The state folder (``<store>/_collector`` for a local store, else ``$FORGE_CACHE/collector/<hash of the URI>``,
or ``--state DIR``) holds a manifest of the files already read (path, size, mtime, the episodes each holds)
and the assembled segments and episodes. A run lists the store, reads only files that are new or changed,
rebuilds the episodes those files touch (with their calls from older files, read with an ``episode_id`` filter)
and keeps every other episode as it was, so the result equals a full rebuild. Sidecars publish files
atomically (a hidden temporary name, then a rename; on S3 an object exists once uploaded), and hidden files are
skipped, so running beside writing sidecars is safe: a file that lands during a run is read by the next one.
"""

import fcntl
import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from tqdm import tqdm

from collector.assemble import CALL_COLUMNS, NO_EPISODE_ID, REWARD_COLUMNS, assemble, finalize
from collector.episode import EPISODE_SCHEMA, SEGMENT_SCHEMA
from forge.errors import ForgeError
from forge.paths import cache_dir
from sidecar.record import CALL_SCHEMA, REWARD_SCHEMA
from sidecar.store import Store, StoreError, open_store

STATE_VERSION = "1"  # bump when the state's files change meaning: an old state is then rebuilt
DEFAULT_IDLE_SECONDS = 600.0
READ_THREADS = 4
ASSEMBLY_BATCH_CALLS = 50_000
STATE_ROW_GROUP = 1000  # segments per row group: the writer buffers one group, not the whole state

MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),
        pa.field("table", pa.string(), nullable=False),
        pa.field("size", pa.int64(), nullable=False),
        pa.field("mtime_ns", pa.int64()),
        pa.field("episode_ids", pa.list_(pa.string()), nullable=False),
    ],
    metadata={"openforge.state_version": STATE_VERSION},
)
_COLUMNS = {"calls": CALL_COLUMNS, "rewards": REWARD_COLUMNS}
_SCHEMAS = {"calls": CALL_SCHEMA, "rewards": REWARD_SCHEMA}


@dataclass(frozen=True)
class StoreFile:
    path: str
    table: str
    size: int
    mtime_ns: int | None


@dataclass
class Collection:
    """The assembled store: one row per segment and one per episode, and what this run read."""

    segments: pa.Table
    episodes: pa.Table
    files_read: int
    episodes_rebuilt: int


def default_state_dir(store_uri: str) -> Path:
    parsed = urlparse(store_uri)
    if parsed.scheme in ("", "file"):
        return Path(os.path.abspath(parsed.path if parsed.scheme == "file" else store_uri)) / "_collector"
    return cache_dir() / "collector" / hashlib.sha256(store_uri.rstrip("/").encode()).hexdigest()[:16]


def open_existing_store(store_uri: str, s3_endpoint: str | None) -> Store:
    parsed = urlparse(store_uri)
    if parsed.scheme in ("", "file"):
        root = os.path.abspath(parsed.path if parsed.scheme == "file" else store_uri)
        if not os.path.isdir(root):
            raise ForgeError(f"no store at {root}: pass --store FOLDER or s3://bucket/prefix")
    try:
        return open_store(store_uri, s3_endpoint)
    except StoreError as error:
        raise ForgeError(str(error)) from error


class Collector:
    def __init__(
        self, store_uri: str, s3_endpoint: str | None = None, state_dir: Path | None = None,
        idle_seconds: float = DEFAULT_IDLE_SECONDS, progress: bool | None = None,
    ) -> None:  # fmt: skip
        self.store = open_existing_store(store_uri, s3_endpoint)
        self.state_dir = Path(state_dir) if state_dir else default_state_dir(store_uri)
        self.idle_seconds = idle_seconds
        self.progress = progress  # None: a bar only on a terminal

    def list_files(self) -> list[StoreFile]:
        found = []
        for table in ("calls", "rewards"):
            selector = pafs.FileSelector(self.store.path(table), recursive=True, allow_not_found=True)
            try:
                infos = self.store.filesystem.get_file_info(selector)
            except OSError as error:
                raise ForgeError(f"cannot list {self.store.uri}: {str(error).splitlines()[0]}") from error
            for info in infos:
                # Hidden names are files still being written (`.name.tmp`), never read.
                hidden = info.base_name.startswith(".") or "/." in info.path[len(self.store.root) :]
                if info.type == pafs.FileType.File and info.base_name.endswith(".parquet") and not hidden:
                    found.append(StoreFile(info.path, table, info.size or 0, info.mtime_ns))
        return sorted(found, key=lambda f: f.path)

    def read(
        self, files: list[StoreFile], table: str, episodes: set[str] | None = None, what: str = "reading"
    ) -> list[pa.Table]:
        """The rows of each of ``files`` (all of one table), optionally only those of the given episodes."""
        columns = _COLUMNS[table]
        filters = None
        if episodes is not None:
            filters = pc.field("episode_id").isin(sorted(episodes))
            if NO_EPISODE_ID in episodes:
                filters = filters | pc.field("episode_id").is_null()

        def read_one(file: StoreFile) -> pa.Table:
            try:
                read = pq.read_table(file.path, filesystem=self.store.filesystem, columns=columns, filters=filters)
            except (OSError, pa.ArrowInvalid) as error:
                raise ForgeError(f"cannot read {file.path}: {str(error).splitlines()[0]}") from error
            return read.cast(pa.schema([_SCHEMAS[table].field(c) for c in columns]))

        with ThreadPoolExecutor(READ_THREADS) as pool:
            return list(
                tqdm(pool.map(read_one, files), total=len(files), desc=f"{what} {table}", unit="file",
                     disable=self._no_bar(len(files)), leave=False)
            )  # fmt: skip

    def _no_bar(self, n: int) -> bool | None:
        if self.progress is None:
            return None if n > 1 else True
        return not self.progress

    def update(self, rebuild: bool = False) -> Collection:
        """Read what is new since the last run, rebuild the episodes it touches, save the state."""
        with self._locked():
            manifest, old_segments, old_episodes = ({}, None, None) if rebuild else self._load_state()
            current = self.list_files()
            current_paths = {f.path for f in current}
            changed = [f for f in current if _changed(manifest.get(f.path), f)]
            gone = [row for path, row in manifest.items() if path not in current_paths]
            touched: set[str] = set()
            for row in gone + [manifest[f.path] for f in changed if f.path in manifest]:
                touched.update(row["episode_ids"])
            new_rows: dict[str, list[pa.Table]] = {}
            file_episodes: dict[str, list[str]] = {}
            for table in ("calls", "rewards"):
                files = [f for f in changed if f.table == table]
                new_rows[table] = self.read(files, table, what="reading new")
                for f, rows in zip(files, new_rows[table], strict=True):
                    file_episodes[f.path] = sorted(
                        pc.unique(pc.fill_null(rows["episode_id"], NO_EPISODE_ID)).to_pylist()
                    )
                    touched.update(file_episodes[f.path])

            unchanged = [f for f in current if f.path in manifest and not _changed(manifest[f.path], f)]
            inputs: dict[str, pa.Table] = {}
            for table in ("calls", "rewards"):
                older = [f for f in unchanged if f.table == table and touched & set(manifest[f.path]["episode_ids"])]
                extra = self.read(older, table, episodes=touched, what="re-reading") if older else []
                empty = pa.Table.from_pylist([], schema=_SCHEMAS[table]).select(_COLUMNS[table])
                inputs[table] = pa.concat_tables([empty, *new_rows[table], *extra])

            if touched or old_segments is None:
                segments, episodes = self.assemble(inputs["calls"], inputs["rewards"])
                if old_segments is not None and old_episodes is not None:  # assemble's output is already sorted
                    keep = pa.array(sorted(touched), pa.string())
                    segments = _merge_sorted(old_segments, segments, keep)
                    episodes = _merge_sorted(old_episodes, episodes, keep)
            else:
                assert old_episodes is not None
                segments, episodes = old_segments, old_episodes
            del new_rows, inputs  # the calls read are done with: free them before the state is written
            new_manifest = {
                f.path: {"path": f.path, "table": f.table, "size": f.size, "mtime_ns": f.mtime_ns,
                         "episode_ids": file_episodes[f.path] if f.path in file_episodes
                         else manifest[f.path]["episode_ids"]}
                for f in current
            }  # fmt: skip
            if changed or gone or rebuild or old_segments is None:
                self._save_state(new_manifest, segments, episodes)
            final_segments, final_episodes = finalize(segments, episodes, self.idle_seconds)
            return Collection(final_segments, final_episodes, len(changed), len(touched))

    def assemble(self, calls: pa.Table, rewards: pa.Table) -> tuple[pa.Table, pa.Table]:
        """Assemble a few thousand episodes at a time: memory grows with the output, not with the work arrays."""
        if calls.num_rows <= ASSEMBLY_BATCH_CALLS:
            return assemble(calls, rewards)
        calls = calls.combine_chunks()  # one copy: a take from many chunks would concatenate them for every batch
        episode_ids = pc.fill_null(calls["episode_id"], NO_EPISODE_ID)
        order = pc.sort_indices(episode_ids).to_numpy()
        sorted_ids = episode_ids.take(pa.array(order)).to_numpy(zero_copy_only=False)
        starts = np.flatnonzero(np.concatenate([[True], sorted_ids[1:] != sorted_ids[:-1]]))  # each episode's first
        cuts = [0]
        for start in starts:
            if start - cuts[-1] >= ASSEMBLY_BATCH_CALLS:
                cuts.append(int(start))
        cuts.append(len(order))
        parts = []
        for lo, hi in tqdm(list(itertools.pairwise(cuts)), desc="assembling", unit="batch",
                           disable=self._no_bar(len(cuts) - 1), leave=False):  # fmt: skip
            parts.append(assemble(calls.take(pa.array(order[lo:hi])), rewards))
        return pa.concat_tables([s for s, _ in parts]), pa.concat_tables([e for _, e in parts])

    @contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ForgeError(f"cannot create the collector's state folder {self.state_dir}: {error}") from error
        with open(self.state_dir / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one collector at a time per state folder
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _load_state(self) -> tuple[dict[str, dict], pa.Table | None, pa.Table | None]:
        paths = [self.state_dir / name for name in ("manifest.parquet", "segments.parquet", "episodes.parquet")]
        if not all(p.exists() for p in paths):
            return {}, None, None
        manifest = pq.read_table(paths[0])
        if (manifest.schema.metadata or {}).get(b"openforge.state_version") != STATE_VERSION.encode():
            return {}, None, None  # written by another version: rebuild
        segments, episodes = pq.read_table(paths[1]), pq.read_table(paths[2])
        if segments.schema != SEGMENT_SCHEMA or episodes.schema != EPISODE_SCHEMA:
            return {}, None, None
        return {row["path"]: row for row in manifest.to_pylist()}, segments, episodes

    def _save_state(self, manifest: dict[str, dict], segments: pa.Table, episodes: pa.Table) -> None:
        rows = [manifest[p] for p in sorted(manifest)]
        _write_atomic(segments, self.state_dir / "segments.parquet")
        _write_atomic(episodes, self.state_dir / "episodes.parquet")
        # The manifest last: a crash before it leaves the old manifest, and the next run reads those files again.
        _write_atomic(pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA), self.state_dir / "manifest.parquet")


def _changed(known: dict | None, file: StoreFile) -> bool:
    return known is None or known["size"] != file.size or known["mtime_ns"] != file.mtime_ns


def _merge_sorted(old: pa.Table, new: pa.Table, replaced: pa.Array) -> pa.Table:
    """Old rows (sorted by episode) without the replaced episodes, merged with the new rows (sorted, only replaced
    episodes), in episode order: as zero-copy slices of the two tables, so a small update copies no tokens."""
    keep = np.flatnonzero(pc.invert(pc.is_in(old["episode_id"], replaced)).to_numpy(zero_copy_only=False))
    kept_ids = old["episode_id"].to_numpy(zero_copy_only=False)[keep]
    new_ids = new["episode_id"].to_numpy(zero_copy_only=False)
    insert_at = np.searchsorted(kept_ids, new_ids) if len(new_ids) else np.zeros(0, np.int64)
    parts: list[pa.Table] = []

    def old_rows(lo: int, hi: int) -> None:  # kept[lo:hi], as runs of consecutive old rows
        rows = keep[lo:hi]
        if len(rows) == 0:
            return
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        for run in np.split(rows, breaks):
            parts.append(old.slice(int(run[0]), len(run)))

    done = 0
    starts: list[int] = []
    if len(insert_at):  # the first new row of each insertion point
        starts = np.flatnonzero(np.concatenate([[True], insert_at[1:] != insert_at[:-1]])).tolist()
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(new_ids)
        old_rows(done, int(insert_at[start]))
        parts.append(new.slice(int(start), int(end - start)))
        done = int(insert_at[start])
    old_rows(done, len(keep))
    return pa.concat_tables(parts) if parts else new


def _write_atomic(table: pa.Table, target: Path) -> None:
    staging = target.with_name(f".{target.name}.tmp")
    strings = [f.name for f in table.schema if f.type == pa.string()]  # token ids gain nothing from a dictionary
    pq.write_table(table, staging, compression="zstd", use_dictionary=strings, row_group_size=STATE_ROW_GROUP)
    os.replace(staging, target)


def collect(
    store_uri: str, s3_endpoint: str | None = None, state_dir: Path | None = None,
    idle_seconds: float = DEFAULT_IDLE_SECONDS, rebuild: bool = False, progress: bool | None = None,
) -> Collection:  # fmt: skip
    return Collector(store_uri, s3_endpoint, state_dir, idle_seconds, progress).update(rebuild=rebuild)


def trainable(segments: pa.Table, statuses: Iterable[str] = ("complete",)) -> pa.Table:
    return segments.filter(pc.is_in(segments["status"], pa.array(list(statuses), pa.string())))
