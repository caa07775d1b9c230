"""Nothing delivered is lost: `kill -9` under load, the S3 server down during load, files never partial."""

import concurrent.futures
import json
import threading
import time
from pathlib import Path

import httpx
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from sidecar.store import open_store
from sidecar.writer import pending_records
from tests.support.sidecar import read_calls, wait_for

pytestmark = pytest.mark.integration


def call(base_url: str, n: int, stream: bool, model: str = "policy") -> str | None:
    """One chat call; the response id if the answer arrived whole, else None."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Count to {n}."}], "max_tokens": 6,
            "temperature": 0, "stream": stream}  # fmt: skip
    try:
        with httpx.Client(timeout=60) as http:
            if not stream:
                answer = http.post(f"{base_url}/v1/chat/completions", json=body)
                return answer.json()["id"] if answer.status_code == 200 else None
            response_id, done = None, False
            with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as answer:
                for line in answer.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        response_id = response_id or json.loads(line[6:])["id"]
            return response_id if done else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def wal_empty(wal_dir: Path) -> bool:
    return pending_records(wal_dir) == 0


def all_files_readable(store: str) -> int:
    target = open_store(store)
    paths = target.list_parquet("calls")
    for path in paths:
        pq.read_table(path, filesystem=target.filesystem)  # raises on a partial file
    return len(paths)


def test_kill_9_under_load_loses_no_delivered_call(start_sidecar, policy_server, tmp_path):
    wal = tmp_path / "wal"
    sidecar = start_sidecar(policy_server.base_url, wal_dir=wal, extra=("--flush-seconds", "1.5"))
    delivered: list[str] = []
    lock = threading.Lock()

    def one(n: int) -> None:
        if response_id := call(sidecar.url, n, stream=n % 2 == 0):
            with lock:
                delivered.append(response_id)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, n) for n in range(48)]
        wait_for(lambda: len(delivered) >= 16, timeout=180, what="16 delivered calls")
        sidecar.kill9()
        concurrent.futures.wait(futures, timeout=120)
    with lock:
        survivors = list(delivered)
    assert len(survivors) >= 16
    assert not wal_empty(wal), "nothing was left in the WAL: the test did not kill mid-load"

    restarted = start_sidecar(policy_server.base_url, wal_dir=wal)
    wait_for(lambda: wal_empty(wal), timeout=30, what="the WAL to be replayed")
    assert restarted.metrics()["wal_records_replayed"] >= 1
    recorded = [c["response_id"] for c in read_calls(sidecar.store)]
    missing = set(survivors) - set(recorded)
    assert not missing, f"{len(missing)} delivered calls are not in the store"
    assert all(recorded.count(r) == 1 for r in survivors), "a delivered call was stored twice"
    assert all_files_readable(sidecar.store) >= 1
    visible = [p for p in Path(sidecar.store).rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert all(p.suffix == ".parquet" for p in visible)


def test_the_s3_server_down_during_load_loses_nothing(start_sidecar, fake_upstream, s3_server, tmp_path):
    store = f"s3://{s3_server.bucket}/forge"
    wal = tmp_path / "wal"
    sidecar = start_sidecar(fake_upstream.url, store=store, wal_dir=wal, extra=("--s3-endpoint", s3_server.endpoint))
    delivered = [call(sidecar.url, n, stream=n % 2 == 1) for n in range(10)]
    wait_for(lambda: wal_empty(wal), what="the first records in S3")
    s3_server.stop()
    started = time.monotonic()
    delivered += [call(sidecar.url, n, stream=n % 2 == 1) for n in range(10, 40)]
    assert time.monotonic() - started < 10, "the harness's calls slowed down while the store was down"
    assert all(delivered), "a call failed while the store was down"
    wait_for(lambda: sidecar.metrics().get("store_write_errors_total", 0) >= 1, what="a failed store write")
    assert sidecar.metrics()["store_up"] == 0 and not wal_empty(wal)
    s3_server.start()
    wait_for(lambda: wal_empty(wal), timeout=60, what="the WAL to drain into S3")
    recorded = [c["response_id"] for c in read_calls(store, s3_endpoint=s3_server.endpoint)]
    assert sorted(map(str, recorded)) == sorted(map(str, delivered))
    fs = pafs.S3FileSystem(endpoint_override=s3_server.endpoint.removeprefix("http://"), scheme="http")
    infos = fs.get_file_info(pafs.FileSelector(f"{s3_server.bucket}/forge", recursive=True))
    assert all(i.base_name.endswith(".parquet") for i in infos if i.type == pafs.FileType.File)


def test_sigterm_flushes_everything(start_sidecar, fake_upstream, tmp_path):
    wal = tmp_path / "wal"
    sidecar = start_sidecar(fake_upstream.url, wal_dir=wal, extra=("--flush-seconds", "60"))
    delivered = [call(sidecar.url, n, stream=False) for n in range(5)]
    assert all(delivered), "a call failed: the test would show nothing about flushing"
    assert not wal_empty(wal)
    assert sidecar.stop() == 0
    assert wal_empty(wal)
    assert sorted(str(c["response_id"]) for c in read_calls(sidecar.store)) == sorted(map(str, delivered))
