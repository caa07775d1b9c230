"""The same records on a local folder and on moto's S3 server (real S3 API over HTTP): the same query results."""

import json

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from forge.cli import cli
from sidecar.store import open_store
from tests.collector.conftest import build_episodes, write_store

pytestmark = pytest.mark.integration

QUERIES = [
    "SELECT episode_id, status, status_detail, reward, group_id, n_calls, n_segments, n_merged, n_forked, n_tokens,"
    " n_trainable FROM episodes ORDER BY episode_id",
    "SELECT episode_id, segment, fork_reason, input_ids, loss_mask, behaviour_logprobs, call_ids FROM segments"
    " ORDER BY episode_id, segment",
    "SELECT call_id, episode_id, seq, status, prompt_token_ids, completion_token_ids FROM calls ORDER BY call_id",
    "SELECT episode_id, reward FROM rewards ORDER BY episode_id",
]


def query(store: list[str], sql: str) -> list[dict]:
    result = CliRunner().invoke(cli, ["sql", *store, "--format", "json", sql], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_queries_give_the_same_results_on_a_folder_and_on_s3(s3_server, tmp_path, monkeypatch):
    episodes = build_episodes()
    write_store(tmp_path / "local", episodes)
    s3_uri = f"s3://{s3_server.bucket}/forge"
    with monkeypatch.context() as env:  # the sidecar's store class writes the objects; the endpoint only for that
        env.setenv("FORGE_S3_ENDPOINT", s3_server.endpoint)
        write_store(tmp_path, episodes, store=s3_uri)
    local = ["--store", str(tmp_path / "local")]
    remote = ["--store", s3_uri, "--s3-endpoint", s3_server.endpoint, "--state", str(tmp_path / "s3-state")]
    for sql in QUERIES:
        expected = query(local, sql)
        assert expected, sql
        assert query(remote, sql) == expected, sql
    # One run's partition listed on S3 as in a folder (the state kept for the other run).
    run_b = "SELECT episode_id, n_calls, status FROM episodes ORDER BY 1"
    assert query([*remote, "--run", "run-b"], run_b) == query([*local, "--run", "run-b"], run_b)
    assert [r["episode_id"] for r in query([*remote, "--run", "run-b"], run_b)] == ["broken", "pending"]

    out = f"s3://{s3_server.bucket}/batches/round-0.parquet"
    written = CliRunner().invoke(cli, ["collect", *remote, "--out", out], catch_exceptions=False)
    assert written.exit_code == 0, written.output
    local_out = tmp_path / "round-0.parquet"
    assert CliRunner().invoke(cli, ["collect", *local, "--out", str(local_out)]).exit_code == 0
    fs = open_store(f"s3://{s3_server.bucket}", s3_server.endpoint).filesystem
    remote_batch = pq.read_table(f"{s3_server.bucket}/batches/round-0.parquet", filesystem=fs)
    assert remote_batch.num_rows == 3 and remote_batch.equals(pq.read_table(local_out))
