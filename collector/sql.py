"""DuckDB over the store: the views ``calls`` (whole prompts rebuilt), ``rewards``, ``episodes``, ``segments``.

``episodes`` and ``segments`` come from the collector's incremental state (``collector.collect``): asked for,
the store's new files are read and the episodes they touch rebuilt first.

Never ``INSTALL``: extension auto-install and auto-load are off; for S3 the httpfs extension is loaded from the
file the PyPI package ``duckdb-extension-httpfs`` ships. The collector reads the sidecar's record schema
(``sidecar.record``), with the data flow.
"""

import os
import re
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlparse

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from duckdb.func import FunctionNullHandling, PythonUDFType

from collector.collect import DEFAULT_IDLE_SECONDS, DEFAULT_RUN, Collection, collect
from collector.episode import SEGMENT_SCHEMA
from forge.errors import ForgeError
from sidecar.record import TABLES
from sidecar.store import s3_endpoint_url

# A call whose prompt extends an earlier one is stored as (parent_call_id, prefix_len, prompt_suffix_ids): its
# whole prompt is the parent's prompt + completion, cut at prefix_len, + the suffix. Rebuilt one episode at a
# time by ``whole_prompts`` (a vectorised Python function DuckDB calls with each episode's calls): every call's
# sequence is built once from its parent's, so an episode costs the size of its whole prompts, where a
# recursive query re-joined every call of the store once per turn of the longest chain.
WHOLE_PROMPTS_SQL = """
SELECT w.c.call_id AS call_id, w.c.prompt_token_ids AS prompt_token_ids
FROM (
    SELECT unnest(forge_whole_prompts(list({'call_id': call_id, 'parent_call_id': parent_call_id,
                  'prefix_len': prefix_len, 'prompt_suffix_ids': prompt_suffix_ids,
                  'completion_token_ids': completion_token_ids}))) AS c
    FROM calls_raw GROUP BY episode_id
) w
"""
# A request stored as a difference from an earlier call's (``sidecar.request_delta``) is rebuilt the same way, one
# episode at a time, parents first, by ``whole_requests``.
WHOLE_REQUESTS_SQL = """
SELECT w.c.call_id AS call_id, w.c.request_json AS request_json
FROM (
    SELECT unnest(forge_whole_requests(list({'call_id': call_id, 'parent': request_parent_call_id,
                  'prefix': request_prefix_chars, 'suffix': request_suffix_chars, 'text': request_json}))) AS c
    FROM calls_raw GROUP BY episode_id
) w
"""
REQUEST_DELTA_COLUMNS = ("request_parent_call_id", "request_prefix_chars", "request_suffix_chars")
# Trainable tokens without a behaviour logprob: the record's count, or (records written before it) the NaNs.
UNKNOWN_LOGPROBS_SQL = (
    "CASE WHEN len(completion_logprobs) = len(completion_token_ids) "
    "THEN len(list_filter(completion_logprobs, x -> isnan(x))) ELSE coalesce(len(completion_token_ids), 0) END"
)
_CALL_TYPE = (
    "STRUCT(call_id VARCHAR, parent_call_id VARCHAR, prefix_len INTEGER, prompt_suffix_ids INTEGER[], "
    "completion_token_ids INTEGER[])[]"
)
_PROMPT_TYPE = "STRUCT(call_id VARCHAR, prompt_token_ids INTEGER[])[]"
_REQUEST_TYPE = "STRUCT(call_id VARCHAR, parent VARCHAR, prefix INTEGER, suffix INTEGER, text VARCHAR)[]"
_WHOLE_REQUEST_TYPE = "STRUCT(call_id VARCHAR, request_json VARCHAR)[]"


def _list_column(array: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A list<int32> array as (values, starts, lengths, valid), starts indexing values."""
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    return values, offsets[:-1], offsets[1:] - offsets[:-1], valid


def whole_prompts(episodes: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Per episode (a list of its calls' references), each call's whole prompt ids, NULL where they cannot be
    rebuilt (no ids, a parent not in the episode, a prefix longer than the parent's sequence).

    Calls are visited parents first (not by seq, which a restarted sidecar may have begun again), and each
    call's sequence (prompt + completion) is one copy of its parent's first prefix_len ids + its own ids: time
    and memory follow the size of the whole prompts, never the depth of the chain times the store.
    """
    if isinstance(episodes, pa.ChunkedArray):
        episodes = episodes.combine_chunks()
    per_episode = pc.fill_null(pc.list_value_length(episodes), 0).to_numpy()
    calls = episodes.flatten()
    fields = dict(zip([f.name for f in calls.type], calls.flatten(), strict=True))
    call_ids = fields["call_id"].to_pylist()
    parents = fields["parent_call_id"].to_pylist()
    prefix_lens = pc.fill_null(fields["prefix_len"], 0).to_numpy()
    suffix, s_start, s_len, s_valid = _list_column(fields["prompt_suffix_ids"])
    completion, c_start, c_len, _ = _list_column(fields["completion_token_ids"])
    prompts: list[np.ndarray | None] = [None] * len(call_ids)
    lo = 0
    for count in per_episode.tolist():
        hi = lo + count
        index = {call_ids[i]: i for i in range(lo, hi)}
        children: dict[int, list[int]] = defaultdict(list)
        stack = []
        for i in range(lo, hi):
            parent = parents[i]
            if parent is None:
                stack.append(i)
            elif parent in index:
                children[index[parent]].append(i)
        sequences: dict[int, np.ndarray] = {}  # prompt + completion of each rebuilt call of this episode
        while stack:
            i = stack.pop()
            if not s_valid[i]:
                continue  # no ids recorded: neither it nor what extends it can be rebuilt
            own = suffix[s_start[i] : s_start[i] + s_len[i]]
            done = completion[c_start[i] : c_start[i] + c_len[i]]
            if parents[i] is None:
                head = own[:0]
            else:
                head = sequences[index[parents[i]]]
                if prefix_lens[i] > len(head):
                    continue
                head = head[: prefix_lens[i]]
            sequences[i] = np.concatenate([head, own, done])
            prompts[i] = sequences[i][: len(head) + len(own)]
            stack.extend(children[i])
        lo = hi
    lengths = np.array([0 if p is None else len(p) for p in prompts], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]))  # 64-bit: a chunk's prompts may pass 2**31 ids
    values = np.concatenate([p for p in prompts if p is not None]) if lengths.any() else np.zeros(0, np.int32)
    missing = pa.array([p is None for p in prompts], pa.bool_())
    prompt_ids = pa.LargeListArray.from_arrays(offsets, pa.array(values, pa.int32()), mask=missing)
    rebuilt = pa.StructArray.from_arrays([fields["call_id"], prompt_ids], names=["call_id", "prompt_token_ids"])
    outer = pa.array(np.concatenate([[0], np.cumsum(per_episode)]).astype(np.int32))
    return pa.ListArray.from_arrays(outer, rebuilt)


def whole_requests(episodes: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Per episode (a list of its calls' stored requests), each call's whole request text: a stored difference is
    applied to its parent's whole text (parents first); NULL where it cannot be rebuilt (its parent's row is not
    in the store, or the parent's text is shorter than the parts it says they share)."""
    if isinstance(episodes, pa.ChunkedArray):
        episodes = episodes.combine_chunks()
    out: list[list[dict[str, str | None]]] = []
    for calls in episodes.to_pylist():
        calls = calls or []
        index = {call["call_id"]: i for i, call in enumerate(calls)}
        children: dict[int, list[int]] = defaultdict(list)
        stack = []
        for i, call in enumerate(calls):
            if call["parent"] is None:
                stack.append(i)
            elif call["parent"] in index:
                children[index[call["parent"]]].append(i)
        whole: list[str | None] = [None] * len(calls)
        while stack:
            i = stack.pop()
            call = calls[i]
            text, prefix, suffix = call["text"], call["prefix"] or 0, call["suffix"] or 0
            if call["parent"] is not None:
                base = whole[index[call["parent"]]]
                if base is None or text is None or prefix + suffix > len(base):
                    continue  # cannot be rebuilt: it and what extends it stay NULL
                text = base[:prefix] + text + base[len(base) - suffix :]
            whole[i] = text
            stack.extend(children[i])
        out.append([{"call_id": call["call_id"], "request_json": whole[i]} for i, call in enumerate(calls)])
    return pa.array(out, type=pa.list_(pa.struct([("call_id", pa.string()), ("request_json", pa.string())])))


def httpfs_extension() -> Path:
    try:
        import duckdb_extension_httpfs
    except ImportError as error:
        raise ForgeError("S3 needs the httpfs extension: pip install duckdb-extension-httpfs (`make env`)") from error
    found = sorted(Path(duckdb_extension_httpfs.__file__).parent.rglob("httpfs.duckdb_extension"))
    if not found:
        raise ForgeError("duckdb-extension-httpfs holds no httpfs.duckdb_extension file: reinstall it")
    return found[-1]


def connect(
    store: str, s3_endpoint: str | None = None, episodes: bool = False, state_dir: Path | None = None,
    idle_seconds: float | None = None, run: str | None = None,
) -> duckdb.DuckDBPyConnection:  # fmt: skip
    """A DuckDB connection with the store's views; with ``episodes``, also ``episodes`` and ``segments``.

    With ``run``, only that run's partitions are listed and read (``calls/run=<run>/``, ``rewards/run=<run>/``).
    """
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    parsed = urlparse(store)
    if parsed.scheme == "s3":
        con.execute(f"LOAD '{httpfs_extension()}'")
        ep = s3_endpoint_url(s3_endpoint)
        con.execute(
            "CREATE SECRET forge_s3 (TYPE s3, KEY_ID ?, SECRET ?, REGION ?, ENDPOINT ?, URL_STYLE 'path', USE_SSL ?)",
            [
                os.environ.get("AWS_ACCESS_KEY_ID", ""), os.environ.get("AWS_SECRET_ACCESS_KEY", ""),
                os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), ep.netloc if ep else "s3.amazonaws.com",
                bool(ep is None or ep.scheme == "https"),
            ],
        )  # fmt: skip
        root = store.rstrip("/")
    elif parsed.scheme in ("", "file"):
        root = os.path.abspath(parsed.path if parsed.scheme == "file" else store)
        if not os.path.isdir(root):
            raise ForgeError(f"no store at {root}: pass --store FOLDER or s3://bucket/prefix")
    else:
        raise ForgeError(f"unsupported store {store!r}: use a local folder or s3://bucket/prefix")
    part = f"/run={run}" if run is not None else ""
    for table, schema in TABLES.items():
        # Not hidden names: a local store's files being written are hidden (and end in .tmp besides).
        glob = f"{root}/{table}{part}/**/[!.]*.parquet"
        has_files = con.execute("SELECT count(*) FROM glob(?)", [glob]).fetchone()
        if has_files and has_files[0]:
            source = f"read_parquet('{glob}', hive_partitioning = true, union_by_name = true)"
        else:  # an empty store still has the tables, with their columns
            con.register(f"_{table}_empty", pa.Table.from_pylist([], schema=schema))
            source = f"_{table}_empty"
        name = "calls_raw" if table == "calls" else table
        con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {source}")
    con.create_function(
        "forge_whole_prompts", whole_prompts, [duckdb.sqltype(_CALL_TYPE)], duckdb.sqltype(_PROMPT_TYPE),
        type=PythonUDFType.ARROW, null_handling=FunctionNullHandling.SPECIAL, side_effects=False,
    )  # fmt: skip
    con.create_function(
        "forge_whole_requests", whole_requests, [duckdb.sqltype(_REQUEST_TYPE)], duckdb.sqltype(_WHOLE_REQUEST_TYPE),
        type=PythonUDFType.ARROW, null_handling=FunctionNullHandling.SPECIAL, side_effects=False,
    )  # fmt: skip
    con.execute(f"CREATE OR REPLACE VIEW calls AS {_calls_view(con)}")
    if episodes:
        idle = DEFAULT_IDLE_SECONDS if idle_seconds is None else idle_seconds
        register_episodes(con, collect(store, s3_endpoint, state_dir, idle, run=run), run)
    return con


def _calls_view(con: duckdb.DuckDBPyConnection) -> str:
    """The ``calls`` view over ``calls_raw``: whole prompts and whole requests rebuilt; a column older files lack is
    there as NULL (files written before it was added)."""
    raw_columns = {row[0] for row in con.execute("DESCRIBE calls_raw").fetchall()}
    unknown = f"coalesce(r.n_unknown_logprobs, {UNKNOWN_LOGPROBS_SQL})"
    replace, extra, joins = [], [], [f"LEFT JOIN ({WHOLE_PROMPTS_SQL}) w USING (call_id)"]
    if "n_unknown_logprobs" in raw_columns:
        replace.append(f"{unknown} AS n_unknown_logprobs")
    else:  # files written before the column have none
        extra.append(f"{UNKNOWN_LOGPROBS_SQL} AS n_unknown_logprobs")
    if all(c in raw_columns for c in REQUEST_DELTA_COLUMNS):
        replace.append("q.request_json AS request_json")
        joins.append(f"LEFT JOIN ({WHOLE_REQUESTS_SQL}) q USING (call_id)")
    for field in TABLES["calls"]:
        if field.name not in raw_columns and field.name not in ("n_unknown_logprobs", "schema_version"):
            extra.append(f"CAST(NULL AS {_sql_type(field.type)}) AS {field.name}")
    columns = "r.* EXCLUDE (prompt_suffix_ids)" + (f" REPLACE ({', '.join(replace)})" if replace else "")
    columns = ", ".join([columns, *extra, "w.prompt_token_ids"])
    return f"SELECT {columns} FROM calls_raw r {' '.join(joins)}"


def _sql_type(kind: pa.DataType) -> str:
    if pa.types.is_integer(kind):
        return {8: "TINYINT", 16: "SMALLINT", 32: "INTEGER", 64: "BIGINT"}[kind.bit_width]
    if pa.types.is_list(kind):
        return f"{_sql_type(kind.value_type)}[]"
    if pa.types.is_timestamp(kind):
        return "TIMESTAMPTZ"
    return {pa.bool_(): "BOOLEAN", pa.float32(): "FLOAT", pa.float64(): "DOUBLE"}.get(kind, "VARCHAR")


def register_episodes(con: duckdb.DuckDBPyConnection, collection: Collection, run: str | None = None) -> None:
    """The views ``episodes`` (in memory: one row per episode) and ``segments`` (over the state's shard files,
    read by DuckDB as a query needs them, statuses made final as they are read); with ``run``, that run's."""
    con.register("_episodes", collection.episodes)
    con.register("_unfinished", pa.table({"episode_id": collection.unfinished}))
    con.register("_segments_empty", SEGMENT_SCHEMA.empty_table())
    of_run = "" if run is None else f"WHERE coalesce(run_id, {_literal(DEFAULT_RUN)}) = {_literal(run)}"
    con.execute(f"CREATE OR REPLACE VIEW episodes AS SELECT * FROM _episodes {of_run}")
    files = ", ".join(_literal(str(path)) for path in collection.segment_files)
    source = f"read_parquet([{files}])" if files else "_segments_empty"
    con.execute(
        "CREATE OR REPLACE VIEW segments AS SELECT * REPLACE (CASE WHEN episode_id IN "
        "(SELECT episode_id FROM _unfinished) THEN 'unfinished' ELSE status END AS status) "
        f"FROM {source} {of_run}"
    )


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def mentions_episodes(query: str) -> bool:
    """Whether a query reads the views that need the collector to run first."""
    return re.search(r"\b(episodes|segments)\b", query, re.IGNORECASE) is not None
