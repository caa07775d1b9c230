"""`forge sql`: ad-hoc SQL over the store's calls and rewards."""

import csv
import json
import sys
from typing import Any

import click
import duckdb

from collector.sql import connect
from forge.errors import ForgeError

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


@click.command("sql")
@click.argument("query")
@click.option("--store", default="./forge-data", show_default=True, help="Folder or s3://bucket/prefix.")
@click.option("--s3-endpoint", help="S3-compatible endpoint URL (credentials from AWS_* variables).")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "csv"]), default="table", show_default=True)
def sql_command(query: str, store: str, s3_endpoint: str | None, fmt: str) -> None:
    """Run SQL over the store: views `calls` (whole prompt_token_ids) and `rewards`, raw rows in `calls_raw`.

    Example: forge sql "SELECT episode_id, count(*) FROM calls GROUP BY 1"
    """
    con = connect(store, s3_endpoint)
    try:
        result = con.execute(query)
    except duckdb.Error as error:
        raise ForgeError(f"SQL error: {str(error).splitlines()[0]}") from error
    columns = [d[0] for d in result.description or []]
    rows = result.fetchall()
    if fmt == "json":
        click.echo(json.dumps([dict(zip(columns, row, strict=True)) for row in rows], default=str, indent=1))
    elif fmt == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        print_table(columns, rows)


commands: list[click.Command] = [sql_command]
