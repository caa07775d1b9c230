"""DuckDB over the store: the views ``calls`` (whole prompts rebuilt), ``rewards``, ``episodes``, ``segments``.

``episodes`` and ``segments`` come from the collector's incremental state (``collector.collect``): asked for,
the store's new files are read and the episodes they touch rebuilt first.

Never ``INSTALL``: extension auto-install and auto-load are off; for S3 the httpfs extension is loaded from the
file the PyPI package ``duckdb-extension-httpfs`` ships. The collector reads the sidecar's record schema
(``sidecar.record``), with the data flow.
"""

import os
import re
from pathlib import Path
from urllib.parse import urlparse

import duckdb
import pyarrow as pa

from collector.collect import DEFAULT_IDLE_SECONDS, collect
from forge.errors import ForgeError
from sidecar.record import TABLES
from sidecar.store import s3_endpoint_url

# A call whose prompt extends an earlier one is stored as (parent_call_id, prefix_len, prompt_suffix_ids):
# its whole prompt is the parent's prompt + completion, cut at prefix_len, + the suffix. Resolved along the
# chain of parents, which is as long as the episode has turns.
CALLS_VIEW = """
CREATE OR REPLACE VIEW calls AS
WITH RECURSIVE chain(call_id, prompt_token_ids, full_ids) AS (
    SELECT call_id, prompt_suffix_ids, list_concat(prompt_suffix_ids, completion_token_ids)
    FROM calls_raw WHERE parent_call_id IS NULL
    UNION ALL
    SELECT c.call_id,
           list_concat(p.full_ids[1:c.prefix_len], c.prompt_suffix_ids),
           list_concat(list_concat(p.full_ids[1:c.prefix_len], c.prompt_suffix_ids), c.completion_token_ids)
    FROM calls_raw c JOIN chain p ON c.parent_call_id = p.call_id
)
SELECT r.* EXCLUDE (prompt_suffix_ids), chain.prompt_token_ids
FROM calls_raw r LEFT JOIN chain USING (call_id)
"""


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
    idle_seconds: float | None = None,
) -> duckdb.DuckDBPyConnection:  # fmt: skip
    """A DuckDB connection with the store's views; with ``episodes``, also ``episodes`` and ``segments``."""
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
    for table, schema in TABLES.items():
        glob = f"{root}/{table}/**/*.parquet"
        has_files = con.execute("SELECT count(*) FROM glob(?)", [glob]).fetchone()
        if has_files and has_files[0]:
            source = f"read_parquet('{glob}', hive_partitioning = true, union_by_name = true)"
        else:  # an empty store still has the tables, with their columns
            con.register(f"_{table}_empty", pa.Table.from_pylist([], schema=schema))
            source = f"_{table}_empty"
        name = "calls_raw" if table == "calls" else table
        con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {source}")
    con.execute(CALLS_VIEW)
    if episodes:
        collection = collect(
            store, s3_endpoint, state_dir, DEFAULT_IDLE_SECONDS if idle_seconds is None else idle_seconds
        )
        con.register("segments", collection.segments)
        con.register("episodes", collection.episodes)
    return con


def mentions_episodes(query: str) -> bool:
    """Whether a query reads the views that need the collector to run first."""
    return re.search(r"\b(episodes|segments)\b", query, re.IGNORECASE) is not None
