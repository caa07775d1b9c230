"""The collector's commands: `forge sql`, `forge episodes`, `forge collect`, `forge report`, `forge view`."""

import csv
import json
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click
import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from collector.collect import DEFAULT_IDLE_SECONDS, DEFAULT_RUN, collect, trainable
from collector.episode import EPISODE_STATUSES, SEGMENT_SCHEMA
from collector.sql import connect, mentions_episodes
from forge.errors import ForgeError
from sidecar.store import StoreError, open_store

MAX_CELL = 60


def cell(value: Any) -> str:
    text = "NULL" if value is None else str(value)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def print_table(columns: list[str], rows: list[tuple]) -> None:
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    click.echo(line)
    click.echo("  ".join("-" * w for w in widths))
    for row in cells:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    click.echo(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")


def print_result(columns: list[str], rows: list[tuple], fmt: str) -> None:
    if fmt == "json":
        click.echo(json.dumps([dict(zip(columns, row, strict=True)) for row in rows], default=str, indent=1))
    elif fmt == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        print_table(columns, rows)


def store_options(function: Callable) -> Callable:
    """--store, --s3-endpoint, --state: where the records are and where the collector keeps its state."""
    function = click.option(
        "--state", type=click.Path(file_okay=False, path_type=Path),
        help="The collector's state folder [default: STORE/_collector, or under $FORGE_CACHE for S3].",
    )(function)  # fmt: skip
    function = click.option("--s3-endpoint", help="S3-compatible endpoint URL (credentials from AWS_* variables).")(
        function
    )
    return click.option("--store", default="./forge-data", show_default=True, help="Folder or s3://bucket/prefix.")(
        function
    )


FORMAT = click.option(
    "--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True
)


def run_query(con: duckdb.DuckDBPyConnection, query: str) -> tuple[list[str], list[tuple]]:
    try:
        table = con.execute(query).arrow().read_all()  # Arrow, not fetchall: timestamps need no pytz
    except duckdb.Error as error:
        raise ForgeError(f"SQL error: {str(error).splitlines()[0]}") from error
    return table.column_names, [tuple(row.values()) for row in table.to_pylist(maps_as_pydicts="lossy")]


@click.command("sql", short_help="Run SQL over the store.")
@click.argument("query", required=False)
@store_options
@click.option("--run", help="Only this run: lists and reads only its partitions (calls/run=RUN/, rewards/run=RUN/).")
@FORMAT
def sql_command(
    query: str | None, store: str, s3_endpoint: str | None, state: Path | None, run: str | None, fmt: str
) -> None:
    """Run SQL over the store: views `calls` (whole prompt_token_ids), `rewards`, `episodes`, `segments`.

    Raw call rows are in `calls_raw`. Without QUERY, an interactive shell (statements end with `;`, `.quit`
    leaves). Example: forge sql "SELECT status, count(*) FROM episodes GROUP BY 1"
    """
    con = connect(store, s3_endpoint, episodes=query is None or mentions_episodes(query), state_dir=state, run=run)
    if query is not None:
        print_result(*run_query(con, query), fmt)
        return
    shell(con, fmt)


def shell(con: duckdb.DuckDBPyConnection, fmt: str) -> None:
    """A small SQL shell: readline history on a terminal, one result per `;`-terminated statement."""
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        click.echo(
            "forge sql: views calls, calls_raw, rewards, episodes, segments. End statements with ;  .quit leaves"
        )
    buffer: list[str] = []
    while True:
        try:
            line = input("forge> " if not buffer else "  ...> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and line == "":
            break
        line = line.rstrip("\n")
        if not buffer and line.strip() in (".quit", ".exit", "\\q"):
            break
        if not buffer and line.strip() == ".tables":
            line = "SELECT table_name FROM information_schema.tables ORDER BY 1;"
        buffer.append(line)
        statement = "\n".join(buffer).strip()
        if not statement.endswith(";"):
            if not statement:
                buffer.clear()
            continue
        buffer.clear()
        try:
            print_result(*run_query(con, statement), fmt)
        except ForgeError as error:
            click.echo(f"forge: {error}", err=True)


def parse_since(since: str) -> datetime:
    """An ISO date/time (UTC unless it says otherwise) or an age such as 30m, 2h, 7d."""
    if match := re.fullmatch(r"(\d+)([smhd])", since.strip()):
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match.group(2)]
        return datetime.now(UTC) - timedelta(**{unit: int(match.group(1))})
    try:
        parsed = datetime.fromisoformat(since)
    except ValueError as error:
        raise ForgeError(
            f"--since {since!r}: give an ISO date/time (2026-01-05T12:00) or an age (30m, 2h, 7d)"
        ) from error
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def episode_filter(
    table: pa.Table, run: str | None, task: str | None, statuses: tuple[str, ...], since: str | None
) -> pa.Table:
    """The rows (episodes or segments) of one run / task / statuses / finished since."""
    masks = []
    if run:  # the sidecar files calls without a run id under run=default
        masks.append(pc.equal(pc.fill_null(table["run_id"], DEFAULT_RUN), run))
    if task:
        masks.append(pc.equal(table["task_id"], task))
    if statuses:
        masks.append(pc.is_in(table["status"], pa.array(list(statuses), pa.string())))
    if since:
        moment = pa.scalar(parse_since(since), table.schema.field("finished_at").type)
        masks.append(pc.greater_equal(table["finished_at"], moment))
    if not masks:
        return table
    mask = masks[0]
    for more in masks[1:]:
        mask = pc.and_(mask, more)
    return table.filter(pc.fill_null(mask, False))


FILTERS = [
    click.option("--run", help="Only this run id: lists and reads only its partitions (calls/run=RUN/, ...)."),
    click.option("--task", help="Only this task id."),
    click.option("--since", help="Only episodes whose last call finished since (ISO time, or an age: 30m, 2h, 7d)."),
]


def filter_options(function: Callable) -> Callable:
    for option in reversed(FILTERS):
        function = option(function)
    return function


EPISODE_COLUMNS = [
    "episode_id", "task_id", "run_id", "status", "reward", "n_calls", "n_segments", "n_merged", "n_forked",
    "n_retries", "n_tokens", "n_trainable", "n_unknown_logprobs", "policy_version_min", "policy_version_max",
    "finished_at", "status_detail",
]  # fmt: skip


@click.command("episodes", short_help="List the store's episodes.")
@store_options
@filter_options
@click.option("--status", "statuses", multiple=True, type=click.Choice(EPISODE_STATUSES), help="Only these statuses.")
@click.option("--idle-seconds", type=float, default=DEFAULT_IDLE_SECONDS, show_default=True,
              help="An episode without a reward is unfinished until its last call is this old.")  # fmt: skip
@click.option("--rebuild", is_flag=True, help="Ignore the collector's state and read every file again.")
@FORMAT
def episodes_command(
    store: str, s3_endpoint: str | None, state: Path | None, run: str | None, task: str | None, since: str | None,
    statuses: tuple[str, ...], idle_seconds: float, rebuild: bool, fmt: str,
) -> None:  # fmt: skip
    """List the store's episodes with their status, reward, segments and merge counts.

    Reads new files first (incrementally: only files not read before). Example: forge episodes --status error
    """
    collection = collect(store, s3_endpoint, state, idle_seconds, rebuild, run=run)
    table = episode_filter(collection.episodes, run, task, statuses, since).select(EPISODE_COLUMNS)
    print_result(table.column_names, [tuple(r.values()) for r in table.to_pylist()], fmt)


@click.command("collect", short_help="Write training segments as Parquet.")
@store_options
@filter_options
@click.option("--out", required=True, help="Where the batch goes: a .parquet file, a folder or an s3:// prefix.")
@click.option("--status", "statuses", multiple=True, type=click.Choice(EPISODE_STATUSES), default=("complete",),
              show_default=True, help="Episode statuses to include (repeatable).")  # fmt: skip
@click.option("--idle-seconds", type=float, default=DEFAULT_IDLE_SECONDS, show_default=True,
              help="An episode without a reward is unfinished until its last call is this old.")  # fmt: skip
@click.option("--rebuild", is_flag=True, help="Ignore the collector's state and read every file again.")
def collect_command(
    store: str, s3_endpoint: str | None, state: Path | None, run: str | None, task: str | None, since: str | None,
    out: str, statuses: tuple[str, ...], idle_seconds: float, rebuild: bool,
) -> None:  # fmt: skip
    """Write training segments (collector.episode.SEGMENT_SCHEMA) as Parquet for the trainer.

    One row per segment: input_ids, loss_mask, behaviour_logprobs, reward, group_id, policy versions. Only
    complete episodes unless --status says otherwise. Example: forge collect --out ./batches/round-3.parquet
    """
    collection = collect(store, s3_endpoint, state, idle_seconds, rebuild, run=run)
    # Shard by shard: what is held is the batch, not every segment of the store.
    segments = pa.concat_tables(
        [SEGMENT_SCHEMA.empty_table()]
        + [episode_filter(trainable(shard, statuses), run, task, (), since) for shard in collection.segment_shards()]
    )
    relative = "segments.parquet"
    target = out
    if out.endswith(".parquet"):
        target, _, relative = out.rstrip("/").rpartition("/")
        target = target or "."
    try:
        written = open_store(target, s3_endpoint).write_parquet(relative, segments)
    except (StoreError, OSError) as error:
        raise ForgeError(f"cannot write {out}: {str(error).splitlines()[0]}") from error
    n_episodes = len(pc.unique(segments["episode_id"])) if segments.num_rows else 0
    tokens = pc.sum(pc.list_value_length(segments["input_ids"])).as_py() or 0
    trained = pc.sum(segments["n_trainable"]).as_py() or 0
    click.echo(f"{segments.num_rows} segments of {n_episodes} episodes, {tokens} tokens ({trained} trainable) "
               f"→ {written}")  # fmt: skip


@click.command("report", short_help="Token fidelity per harness and per run.")
@store_options
@click.option("--png", "png", type=click.Path(dir_okay=False, path_type=Path), help="Also plot the figures here.")
@FORMAT
def report_command(store: str, s3_endpoint: str | None, state: Path | None, png: Path | None, fmt: str) -> None:
    """Token fidelity per harness and per run: merge and fork rates, forks by cause (re-tokenization, retry,
    rewrite, unrelated), calls served tokens-in, trainable share, calls without ids, truncated.

    Example: forge report --png fidelity.png
    """
    from collector.report import fidelity, plot

    con = connect(store, s3_endpoint, episodes=True, state_dir=state)
    columns, rows = fidelity(con)
    print_result(columns, rows, fmt)
    if png:
        plot(columns, rows, png)
        click.echo(f"plot → {png}", err=True)


@click.command("view", short_help="Write one episode as an HTML page.")
@click.argument("episode_id")
@store_options
@click.option("--html", "html_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Write the page here.")  # fmt: skip
@click.option("--ids", "show_ids", is_flag=True, help="Show token ids, not the tokenizer's text.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False, path_type=Path),
              help="The served model's tokenizer folder (default: the embedded model's, when prepared).")  # fmt: skip
def view_command(
    episode_id: str,
    store: str,
    s3_endpoint: str | None,
    state: Path | None,
    html_path: Path,
    show_ids: bool,
    tokenizer_dir: Path | None,
) -> None:
    """Write one episode as a self-contained HTML page: calls, segments, tokens coloured by mask, rewards.

    Example: forge view ep-1 --html ep-1.html
    """
    from collector.view import render_episode, tokenizer_decoder

    con = connect(store, s3_endpoint, episodes=True, state_dir=state)
    decode = None if show_ids else tokenizer_decoder(tokenizer_dir)
    page = render_episode(con, episode_id, decode)
    try:
        html_path.write_text(page, encoding="utf-8")
    except OSError as error:
        raise ForgeError(f"cannot write {html_path}: {error}") from error
    click.echo(
        f"episode {episode_id} → {html_path}" + ("" if decode or show_ids else " (no tokenizer here: ids shown)")
    )


commands: list[click.Command] = [sql_command, episodes_command, collect_command, report_command, view_command]
