"""Group commit of WAL rows (issue 24): the records of calls that end together share one transaction, and each is
committed before the harness gets the last byte of its answer; a crash mid-group loses nothing acknowledged."""

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from forge.paths import repo_root
from sidecar.metrics import Metrics
from sidecar.record import pack_floats, pack_ids
from sidecar.store import open_store
from sidecar.writer import WAL_FILE, RecordWriter


def make_writer(tmp_path: Path) -> RecordWriter:
    return RecordWriter(tmp_path / "wal", open_store(str(tmp_path / "store")), Metrics())


def row(n: int) -> dict:
    return {"call_id": f"c{n}", "episode_id": "e", "seq": n, "started_at": 1_800_000_000_000_000 + n,
            "prompt_suffix_ids": pack_ids([n]), "completion_token_ids": pack_ids([n, n + 1]),
            "completion_logprobs": pack_floats([-0.5, -0.25]), "status": "ok"}  # fmt: skip


def wal_call_ids(wal_dir: Path) -> list[str]:
    db = sqlite3.connect(f"file:{wal_dir / WAL_FILE}?mode=ro", uri=True)
    try:
        return [r[0] for r in db.execute("SELECT json_extract(fields, '$.call_id') FROM records ORDER BY id")]
    finally:
        db.close()


def test_a_group_is_one_transaction_and_each_record_keeps_its_own_outcome(tmp_path):
    writer = make_writer(tmp_path)
    ids = writer.append_many([("calls", row(n), n == 1) for n in range(4)])
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == 4
    assert writer.metrics.get("wal_commits_total") == 1 and writer.pending() == 4
    assert list(writer.held) == [ids[1]]  # held as append(hold=True) holds
    assert wal_call_ids(tmp_path / "wal") == ["c0", "c1", "c2", "c3"]
    # A record SQLite cannot take fails the transaction: nothing of it stays, then each is tried alone.
    bad = {**row(9), "prompt_suffix_ids": [1, 2]}  # a list where a blob goes: sqlite3 refuses to bind it
    results = writer.append_many([("calls", row(4), False), ("calls", bad, True), ("calls", row(5), False)])
    assert isinstance(results[0], int) and isinstance(results[1], Exception) and isinstance(results[2], int)
    assert wal_call_ids(tmp_path / "wal") == ["c0", "c1", "c2", "c3", "c4", "c5"]
    assert list(writer.held) == [ids[1]]  # the rolled-back held row left no hold behind


def test_one_version_answer_completes_every_row_it_followed_in_one_statement(tmp_path):
    writer = make_writer(tmp_path)
    ids = [writer.append("calls", row(n), hold=True) for n in range(3)]
    assert all(i is not None for i in ids)
    writer.complete_many([i for i in ids if i is not None], {"policy_version_end": "7"})
    assert writer.held == {}
    db = sqlite3.connect(f"file:{tmp_path / 'wal' / WAL_FILE}?mode=ro", uri=True)
    ends = [r[0] for r in db.execute("SELECT json_extract(fields, '$.policy_version_end') FROM records")]
    kept = [r[0] for r in db.execute("SELECT json_extract(fields, '$.call_id') FROM records ORDER BY id")]
    db.close()
    assert ends == ["7", "7", "7"] and kept == ["c0", "c1", "c2"]


CRASH = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from test_group_commit import make_writer, row
writer = make_writer(Path({tmp!r}))
acknowledged = writer.append_many([("calls", row(n), False) for n in range(3)])
print(",".join(str(i) for i in acknowledged), flush=True)
real = writer._insert_locked
count = [0]
def dying(encoded, hold):
    count[0] += 1
    if count[0] == 3:
        os._exit(9)  # killed mid-transaction: two rows of the group inserted, not committed
    return real(encoded, hold)
writer._insert_locked = dying
writer.append_many([("calls", row(n), False) for n in range(3, 7)])
print("not reached", flush=True)
"""


def test_a_crash_mid_group_loses_nothing_acknowledged_and_keeps_nothing_half_written(tmp_path):
    script = CRASH.format(root=str(repo_root()), tests=str(Path(__file__).parent), tmp=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 9, done.stderr
    assert done.stdout.strip() == "1,2,3"
    # The acknowledged group is there whole; none of the group the crash cut (no call of it got an answer).
    assert wal_call_ids(tmp_path / "wal") == ["c0", "c1", "c2"]
    writer = make_writer(tmp_path)  # a restart replays exactly those
    assert writer.pending() == 3 and writer.close() and writer.pending() == 0


@pytest.mark.integration
def test_calls_that_end_together_commit_together_each_before_its_last_byte(start_sidecar, fake_upstream, tmp_path):
    """Many clients at once through the real sidecar: fewer WAL commits than records, and every client that got
    its whole answer finds its record already committed in the WAL at that moment."""
    sidecar = start_sidecar(fake_upstream.url, extra=("--flush-seconds", "600", "--flush-rows", "100000"))
    wal = sidecar.wal_dir / WAL_FILE
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":6}'
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{sidecar.port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    missing: list[str] = []

    async def client(rounds: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", sidecar.port)
        db = sqlite3.connect(f"file:{wal}?mode=ro", uri=True)
        try:
            for _ in range(rounds):
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                             .split(b":")[1])  # fmt: skip
                answer = await reader.readexactly(length)  # the last byte is in
                response_id = __import__("json").loads(answer)["id"]
                found = db.execute(
                    "SELECT COUNT(*) FROM records WHERE json_extract(fields, '$.response_id') = ?", (response_id,)
                ).fetchone()[0]
                if found != 1:
                    missing.append(response_id)
        finally:
            db.close()
            writer.close()

    async def load() -> None:
        await asyncio.gather(*(client(8) for _ in range(32)))

    asyncio.run(load())
    metrics = sidecar.metrics()
    logged = metrics['records_logged_total{table="calls"}']
    assert missing == [] and logged == 32 * 8
    assert metrics["wal_commits_total"] < logged, "no two calls that ended together shared a commit"
