"""Episode identity (flag, proxy user, header, environment), rewards (admin endpoint, CLI), and secrets."""

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.sidecar.conftest import FORGE, read_calls, wait_for

pytestmark = pytest.mark.integration
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
PLANTED = "sk-planted-9f8e7d6c5b4a3210"


def test_each_proxy_user_is_its_own_episode(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url, mode="regular", episode_id=None)
    for user in ("rollout-a", "rollout-b", "rollout-a"):
        with httpx.Client(proxy=f"http://{user}:{PLANTED}@127.0.0.1:{sidecar.port}", timeout=30) as http:
            assert http.post(f"{fake_upstream.url}{CHAT}", json=BODY).status_code == 200
    calls = wait_for(lambda: len(read_calls(sidecar.store)) == 3 and read_calls(sidecar.store), what="3 records")
    assert [(c["episode_id"], c["seq"]) for c in calls] == [("rollout-a", 0), ("rollout-a", 1), ("rollout-b", 0)]
    anonymous = httpx.Client(proxy=sidecar.url, timeout=30).post(f"{fake_upstream.url}{CHAT}", json=BODY)
    assert anonymous.status_code == 407  # regular mode without --episode-id: the proxy user names the episode
    sidecar.stop()
    for path in [*Path(sidecar.store).rglob("*"), *sidecar.wal_dir.rglob("*"), sidecar.log_path]:
        assert not path.is_file() or PLANTED.encode() not in path.read_bytes(), path  # the proxy password


def test_episode_from_header_or_environment(start_sidecar, fake_upstream):
    sidecar = start_sidecar(
        fake_upstream.url, episode_id=None, env={"FORGE_EPISODE_ID": "from-env", "FORGE_RUN_ID": "r7"}
    )
    httpx.post(f"{sidecar.url}{CHAT}", json=BODY, timeout=30)
    httpx.post(f"{sidecar.url}{CHAT}", json=BODY, headers={"x-forge-episode-id": "from-header"}, timeout=30)
    calls = wait_for(lambda: len(read_calls(sidecar.store)) == 2 and read_calls(sidecar.store), what="2 records")
    assert sorted(c["episode_id"] for c in calls) == ["from-env", "from-header"]
    assert {c["run_id"] for c in calls} == {"r7"} and {c["run"] for c in calls} == {"r7"}
    assert "x-forge-episode-id" not in {k.lower() for k in fake_upstream.requests[-1]["headers"]}


def test_rewards_from_the_admin_endpoint_and_the_cli(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url)
    status, _ = sidecar.post_admin("/reward", {"episode_id": "episode-1", "reward": 1.5, "components": {"tests": 1}})
    assert status == 200
    for bad, message in (({"reward": 1}, "episode_id"), ({"episode_id": "e", "reward": "high"}, "reward"),
                         ({"episode_id": "e", "reward": 1, "components": {"a": "b"}}, "components")):  # fmt: skip
        status, answer = sidecar.post_admin("/reward", bad)
        assert status == 400 and message in answer["error"]
    cli = subprocess.run([FORGE, "reward", "--store", sidecar.store, "--episode-id", "episode-2", "--value", "-1",
                          "--component", "lint=0.5"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    bad_cli = subprocess.run([FORGE, "reward", "--store", sidecar.store, "--episode-id", "e", "--value", "1",
                              "--component", "oops"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad_cli.returncode == 2 and "NAME=NUMBER" in bad_cli.stderr
    rows = wait_for(lambda: _rewards(sidecar.store) if len(_rewards(sidecar.store)) == 2 else None, what="2 rewards")
    assert rows == [("episode-1", 1.5, "admin", {"tests": 1.0}), ("episode-2", -1.0, "cli", {"lint": 0.5})]


def _rewards(store: str) -> list[tuple]:
    out = subprocess.run(
        [FORGE, "sql", "--store", store, "--format", "json",
         "SELECT episode_id, reward, source, components FROM rewards ORDER BY episode_id"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip

    return [(r["episode_id"], r["reward"], r["source"], r["components"]) for r in json.loads(out)]


def test_a_planted_key_reaches_no_byte_of_any_file(start_sidecar, fake_upstream, tmp_path):
    sidecar = start_sidecar(fake_upstream.url, env={"FORGE_SECRETS": "configured-secret-value"})
    headers = {"authorization": f"Bearer {PLANTED}", "x-api-key": PLANTED, "cookie": f"session={PLANTED}"}
    body = {**BODY, "api_key": PLANTED, "messages": [{"role": "user", "content": "my key is configured-secret-value"}]}
    for stream in (False, True):
        assert (
            httpx.post(f"{sidecar.url}{CHAT}", json={**body, "stream": stream}, headers=headers, timeout=30).status_code
            == 200
        )
    wait_for(lambda: len(read_calls(sidecar.store)) >= 2, what="the records")
    assert "authorization" not in {k.lower() for k in fake_upstream.requests[-1]["headers"]}
    sidecar.stop()
    for path in [*Path(sidecar.store).rglob("*"), *sidecar.wal_dir.rglob("*"), sidecar.log_path]:
        if path.is_file():
            data = path.read_bytes()
            assert PLANTED.encode() not in data and b"configured-secret-value" not in data, path
