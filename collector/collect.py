"""Incremental collection: the store's call and reward files → segments and episodes, kept in a state folder.

The state folder (``<store>/_collector`` for a local store, else ``$FORGE_CACHE/collector/<hash of the URI>``,
or ``--state DIR``) holds a manifest of the files already read (path, size, mtime, the episodes each holds)
and the assembled segments and episodes, split into ``SHARDS`` shards by a hash of the episode id
(``shards/segments-007.parquet`` and ``shards/episodes-007.parquet``; a shard without episodes has no files).
A run lists the store (only one run's partitions when given ``run``), reads only files that are new or
changed, rebuilds the episodes those files touch (with their calls from older files, read with an
``episode_id`` filter) and rewrites only the shards those episodes fall in: an update costs what it touches,
not the size of the state, and the result equals a full rebuild. Sidecars publish files atomically (a hidden
temporary name, then a rename; on S3 an object exists once uploaded), and hidden files are skipped, so running
beside writing sidecars is safe: a file that lands during a run is read by the next one.

A run that stops half way leaves a consistent state: the episodes it rebuilds are written to ``pending.json``
before any shard changes and the manifest is written last, so the next run reads the same files again and
rebuilds those episodes whatever the store holds by then.
"""

import fcntl
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from tqdm import tqdm

from collector.assemble import (
    CALL_COLUMNS,
    NO_EPISODE_ID,
    OPTIONAL_CALL_COLUMNS,
    REWARD_COLUMNS,
    assemble,
    mark_unfinished,
    unfinished_episodes,
)
from collector.episode import EPISODE_SCHEMA, SEGMENT_SCHEMA
from forge.errors import ForgeError
from forge.paths import cache_dir
from sidecar.record import CALL_SCHEMA, REWARD_SCHEMA
from sidecar.store import Store, StoreError, open_store

STATE_VERSION = "2"  # bump when the state's files change meaning: an old state is then rebuilt (2: shards)
SHARDS = 64  # at 1M calls (1.8 GB of tokens) a shard holds ~28 MB: what one new episode rewrites
DEFAULT_IDLE_SECONDS = 600.0
DEFAULT_RUN = "default"  # the partition the sidecar files calls without a run id under (calls/run=default/)
READ_THREADS = 4
ASSEMBLY_BATCH_CALLS = 50_000
STATE_ROW_GROUP = 1000  # segments per row group: the writer buffers one group, not the whole shard
# What a state's files mean: its version, the shard count and both schemas. Another one is rebuilt, not read.
STATE_FINGERPRINT = hashlib.sha256(f"{STATE_VERSION}/{SHARDS}/{SEGMENT_SCHEMA}/{EPISODE_SCHEMA}".encode()).hexdigest()[
    :16
]

MANIFEST_SCHEMA = pa.schema(
    [
        pa.field("path", pa.string(), nullable=False),
        pa.field("table", pa.string(), nullable=False),
        pa.field("size", pa.int64(), nullable=False),
        pa.field("mtime_ns", pa.int64()),
        pa.field("episode_ids", pa.list_(pa.string()), nullable=False),
    ],
    metadata={"openforge.state_version": STATE_VERSION, "openforge.state_fingerprint": STATE_FINGERPRINT},
)
_COLUMNS = {"calls": CALL_COLUMNS, "rewards": REWARD_COLUMNS}
_SCHEMAS = {"calls": CALL_SCHEMA, "rewards": REWARD_SCHEMA}
_KINDS = {"segments": SEGMENT_SCHEMA, "episodes": EPISODE_SCHEMA}


@dataclass(frozen=True)
class StoreFile:
    path: str
    table: str
    size: int
    mtime_ns: int | None


def shard_of(episode_ids: Iterable[str]) -> np.ndarray:
    """Each episode's shard: a hash of its id that does not change between processes or Python versions."""
    return np.array(
        [int.from_bytes(hashlib.blake2b(e.encode(), digest_size=8).digest(), "little") % SHARDS for e in episode_ids],
        dtype=np.int64,
    )


def _row_shards(table: pa.Table) -> np.ndarray:
    """The shard of every row of a segments or episodes table (hashing each distinct episode id once)."""
    encoded = pc.dictionary_encode(table["episode_id"].combine_chunks())
    return shard_of(encoded.dictionary.to_pylist())[encoded.indices.to_numpy(zero_copy_only=False)]


def shard_path(state_dir: Path, kind: str, shard: int) -> Path:
    return state_dir / "shards" / f"{kind}-{shard:03d}.parquet"


class Collection:
    """The assembled store: one row per segment and one per episode, read from the state's shards when asked
    (the episodes are small; the segments hold every token and are read shard by shard where that is enough)."""

    def __init__(self, state_dir: Path, idle_seconds: float, files_read: int, episodes_rebuilt: int) -> None:
        self.state_dir, self.idle_seconds = state_dir, idle_seconds
        self.files_read, self.episodes_rebuilt = files_read, episodes_rebuilt
        self.episodes = self._episodes()  # read under the collector's lock, with the segments' shard list
        self.segment_files = sorted((state_dir / "shards").glob("segments-*.parquet"))

    def _episodes(self) -> pa.Table:
        files = sorted((self.state_dir / "shards").glob("episodes-*.parquet"))
        raw = pa.concat_tables([EPISODE_SCHEMA.empty_table(), *_read_all(files)]).sort_by("episode_id")
        self.unfinished = unfinished_episodes(raw, self.idle_seconds)
        return mark_unfinished(raw, self.unfinished)

    def segment_shards(self) -> Iterator[pa.Table]:
        """The segments one shard at a time (sorted by episode within a shard), statuses final."""
        for path in self.segment_files:
            yield mark_unfinished(pq.read_table(path), self.unfinished)

    @cached_property
    def segments(self) -> pa.Table:
        """Every segment, in shard order (episode order within a shard): as a full rebuild gives them."""
        return pa.concat_tables([SEGMENT_SCHEMA.empty_table(), *self.segment_shards()])


def _read_all(paths: list[Path]) -> list[pa.Table]:
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return list(pool.map(pq.read_table, paths))


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
        idle_seconds: float = DEFAULT_IDLE_SECONDS, progress: bool | None = None, run: str | None = None,
    ) -> None:  # fmt: skip
        self.store = open_existing_store(store_uri, s3_endpoint)
        self.state_dir = Path(state_dir) if state_dir else default_state_dir(store_uri)
        self.idle_seconds = idle_seconds
        self.progress = progress  # None: a bar only on a terminal
        if run is not None and (not run or "/" in run or run.startswith(".")):
            raise ForgeError(f"--run {run!r}: a run id is one path segment (the store's run=<run> partition)")
        self.run = run  # list only this run's partitions (calls/run=<run>/, rewards/run=<run>/)

    def listed_prefixes(self) -> list[str]:
        """The folders a run lists: each table whole, or only one run's partition of it."""
        part = f"/run={self.run}" if self.run is not None else ""
        return [self.store.path(table) + part for table in ("calls", "rewards")]

    def in_scope(self, path: str) -> bool:
        return any(path.startswith(prefix + "/") for prefix in self.listed_prefixes())

    def list_files(self) -> list[StoreFile]:
        found = []
        for table, prefix in zip(("calls", "rewards"), self.listed_prefixes(), strict=True):
            selector = pafs.FileSelector(prefix, recursive=True, allow_not_found=True)
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
                wanted = columns + (OPTIONAL_CALL_COLUMNS if table == "calls" else [])
                try:
                    read = pq.read_table(file.path, filesystem=self.store.filesystem, columns=wanted, filters=filters)
                except pa.ArrowInvalid:  # a file from before an optional column existed: those it has
                    have = set(pq.read_schema(file.path, filesystem=self.store.filesystem).names)
                    wanted = columns + [c for c in OPTIONAL_CALL_COLUMNS if c in have and table == "calls"]
                    read = pq.read_table(file.path, filesystem=self.store.filesystem, columns=wanted, filters=filters)
            except (OSError, pa.ArrowInvalid) as error:
                raise ForgeError(f"cannot read {file.path}: {str(error).splitlines()[0]}") from error
            return read.cast(pa.schema([_SCHEMAS[table].field(c) for c in read.column_names]))

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
        """Read what is new since the last run, rebuild the episodes it touches, rewrite their shards."""
        with self._locked():
            manifest = None if rebuild else self._load_manifest()
            full = manifest is None  # no (usable) state: every shard is written
            if manifest is None:
                manifest = MANIFEST_SCHEMA.empty_table()
            known = {path: i for i, path in enumerate(manifest["path"].to_pylist())}
            sizes, mtimes = manifest["size"].to_pylist(), manifest["mtime_ns"].to_pylist()

            def is_changed(f: StoreFile) -> bool:
                i = known.get(f.path)
                return i is None or sizes[i] != f.size or mtimes[i] != f.mtime_ns

            current = self.list_files()
            current_paths = {f.path for f in current}
            changed = [f for f in current if is_changed(f)]
            # A scoped run (one run's partitions) cannot see the other partitions' files: they are kept as known.
            gone = [i for path, i in known.items() if path not in current_paths and self.in_scope(path)]
            replaced = [known[f.path] for f in changed if f.path in known]
            touched: set[str] = set() if full else self._load_pending()
            for i in gone + replaced:
                touched.update(manifest["episode_ids"][i].as_py())
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

            # Older files that hold calls or rewards of a touched episode: found in the manifest's episode lists.
            dropped = set(gone + replaced)
            holding: set[int] = set()
            if touched and manifest.num_rows:
                lists = manifest["episode_ids"].combine_chunks()
                hit = pc.is_in(pc.list_flatten(lists), pa.array(sorted(touched), pa.string()))
                holding = set(pc.filter(pc.list_parent_indices(lists), hit).to_pylist()) - dropped
            paths, tables = manifest["path"].to_pylist(), manifest["table"].to_pylist()
            inputs: dict[str, pa.Table] = {}
            for table in ("calls", "rewards"):
                older = [StoreFile(paths[i], table, sizes[i], mtimes[i]) for i in sorted(holding) if tables[i] == table]
                extra = self.read(older, table, episodes=touched, what="re-reading") if older else []
                empty = pa.Table.from_pylist([], schema=_SCHEMAS[table]).select(_COLUMNS[table])
                inputs[table] = pa.concat_tables([empty, *new_rows[table], *extra], promote_options="default")
            segments, episodes = self.assemble(inputs["calls"], inputs["rewards"])
            del new_rows, inputs  # the calls read are done with: free them before the state is written

            if full:
                self._write_all_shards(segments, episodes)
            elif touched:
                self._write_pending(touched)  # before any shard changes: a stopped run is redone from here
                self._write_touched_shards(segments, episodes, touched)
            if full or changed or gone:
                keep = np.ones(manifest.num_rows, dtype=bool)
                keep[list(dropped)] = False
                added = pa.Table.from_pylist(
                    [{"path": f.path, "table": f.table, "size": f.size, "mtime_ns": f.mtime_ns,
                      "episode_ids": file_episodes[f.path]} for f in changed],
                    schema=MANIFEST_SCHEMA,
                )  # fmt: skip
                # The manifest last: a crash before it leaves the old one, and the next run reads those files again.
                _write_atomic(
                    pa.concat_tables([manifest.filter(pa.array(keep)), added]), self.state_dir / "manifest.parquet"
                )
            (self.state_dir / "pending.json").unlink(missing_ok=True)
            return Collection(self.state_dir, self.idle_seconds, len(changed), len(touched))

    def assemble(self, calls: pa.Table, rewards: pa.Table) -> tuple[pa.Table, pa.Table]:
        """Segments and episodes in shard order (by episode id within a shard), so each shard's rows are one
        slice; a few thousand episodes at a time: memory grows with the output, not with the work arrays."""
        episode_ids = pc.fill_null(calls["episode_id"], NO_EPISODE_ID).combine_chunks()
        encoded = pc.dictionary_encode(episode_ids)
        distinct = encoded.dictionary.to_pylist()
        rank = np.empty(len(distinct), np.int64)
        rank[np.argsort(np.array(distinct, dtype=object), kind="stable")] = np.arange(len(distinct))
        position = shard_of(distinct) * max(len(distinct), 1) + rank  # shard first, then episode id
        per_call = position[encoded.indices.to_numpy(zero_copy_only=False)]
        if calls.num_rows <= ASSEMBLY_BATCH_CALLS:
            return assemble(calls, rewards, pa.array(per_call))
        calls = calls.combine_chunks()  # one copy: a take from many chunks would concatenate them for every batch
        order = np.argsort(per_call, kind="stable")
        sorted_position = per_call[order]
        starts = np.flatnonzero(np.concatenate([[True], sorted_position[1:] != sorted_position[:-1]]))
        cuts = [0]
        for start in starts:  # each episode's first call
            if start - cuts[-1] >= ASSEMBLY_BATCH_CALLS:
                cuts.append(int(start))
        cuts.append(len(order))
        parts = []
        for lo, hi in tqdm(list(itertools.pairwise(cuts)), desc="assembling", unit="batch",
                           disable=self._no_bar(len(cuts) - 1), leave=False):  # fmt: skip
            rows = pa.array(order[lo:hi])
            parts.append(assemble(calls.take(rows), rewards, pa.array(per_call[order[lo:hi]])))
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

    def _load_manifest(self) -> pa.Table | None:
        """The manifest of a state this version wrote, else None (the state is then rebuilt)."""
        path = self.state_dir / "manifest.parquet"
        if not path.exists():
            return None
        manifest = pq.read_table(path)
        if (manifest.schema.metadata or {}).get(b"openforge.state_fingerprint") != STATE_FINGERPRINT.encode():
            return None  # written by another version, or with another shard count or schema
        return manifest.cast(MANIFEST_SCHEMA)

    def _load_pending(self) -> set[str]:
        """The episodes a stopped run was rebuilding (they are rebuilt again)."""
        try:
            return set(json.loads((self.state_dir / "pending.json").read_text()))
        except FileNotFoundError:
            return set()

    def _write_pending(self, touched: set[str]) -> None:
        staging = self.state_dir / ".pending.json.tmp"
        staging.write_text(json.dumps(sorted(touched | self._load_pending())))
        os.replace(staging, self.state_dir / "pending.json")

    def _write_all_shards(self, segments: pa.Table, episodes: pa.Table) -> None:
        """A full rebuild: every shard written from the assembled tables, shards no longer used removed."""
        (self.state_dir / "shards").mkdir(exist_ok=True)
        jobs = [
            (rows, shard_path(self.state_dir, kind, shard))
            for kind, table in (("segments", segments), ("episodes", episodes))
            for shard, rows in _shard_slices(table)
        ]
        with ThreadPoolExecutor(READ_THREADS) as pool:  # Parquet's encoding and compression release the GIL
            list(pool.map(lambda job: _write_atomic(*job), jobs))
        written = {target for _, target in jobs}
        for stale in (self.state_dir / "shards").glob("*.parquet"):
            if stale not in written:
                stale.unlink()
        for old in ("segments.parquet", "episodes.parquet"):  # a version 1 state's single files
            (self.state_dir / old).unlink(missing_ok=True)

    def _write_touched_shards(self, segments: pa.Table, episodes: pa.Table, touched: set[str]) -> None:
        """Each shard a touched episode falls in: its other episodes kept, the touched ones replaced."""
        (self.state_dir / "shards").mkdir(exist_ok=True)
        touched_ids = sorted(touched)
        touched_shards = shard_of(touched_ids)
        assembled = {
            kind: dict(_shard_slices(table)) for kind, table in (("segments", segments), ("episodes", episodes))
        }

        def rewrite(kind: str, shard: int) -> None:
            target = shard_path(self.state_dir, kind, shard)
            new = assembled[kind].get(shard, _KINDS[kind].empty_table())
            replaced = pa.array([e for e, s in zip(touched_ids, touched_shards, strict=True) if s == shard])
            if target.exists():
                old = pq.read_table(target)
                if old.schema != _KINDS[kind]:
                    raise ForgeError(f"{target} is not a state shard of this version: collect with --rebuild")
                new = _merge_sorted(old, new, replaced)
            if new.num_rows:
                _write_atomic(new, target)
            else:
                target.unlink(missing_ok=True)

        jobs = [(kind, shard) for kind in ("segments", "episodes") for shard in np.unique(touched_shards).tolist()]
        with ThreadPoolExecutor(READ_THREADS) as pool:  # a few shards at a time: reading and writing release the GIL
            list(pool.map(lambda job: rewrite(*job), jobs))


def _shard_slices(table: pa.Table) -> Iterator[tuple[int, pa.Table]]:
    """A table in shard order as (shard, its rows): zero-copy slices."""
    if table.num_rows == 0:
        return
    shards = _row_shards(table)
    bounds = [0, *(np.flatnonzero(np.diff(shards)) + 1).tolist(), len(shards)]
    for lo, hi in itertools.pairwise(bounds):
        yield int(shards[lo]), table.slice(lo, hi - lo)


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
    run: str | None = None,
) -> Collection:  # fmt: skip
    return Collector(store_uri, s3_endpoint, state_dir, idle_seconds, progress, run).update(rebuild=rebuild)


def trainable(segments: pa.Table, statuses: Iterable[str] = ("complete",)) -> pa.Table:
    return segments.filter(pc.is_in(segments["status"], pa.array(list(statuses), pa.string())))
