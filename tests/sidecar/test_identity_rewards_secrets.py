"""Episode identity (flag, proxy user, header, environment), rewards (admin endpoint, CLI), and secrets."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

from forge.paths import repo_root
from sidecar.redact import REDACTED
from tests.support.sidecar import FORGE, assert_no_secret_anywhere, read_calls, wait_for

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
    assert_no_secret_anywhere(sidecar, [PLANTED])  # the proxy password


def test_episode_from_the_header_outside_a_pod(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url, episode_id=None, env={"FORGE_RUN_ID": "r7"})
    httpx.post(f"{sidecar.url}{CHAT}", json=BODY, timeout=30)
    httpx.post(f"{sidecar.url}{CHAT}", json=BODY, headers={"x-forge-episode-id": "from-header",
                                                           "x-forge-task-id": "task-h"}, timeout=30)  # fmt: skip
    calls = wait_for(lambda: len(read_calls(sidecar.store)) == 2 and read_calls(sidecar.store), what="2 records")
    assert sorted((c["episode_id"], c["task_id"]) for c in calls) == [
        ("from-header", "task-h"),
        (f"{calls[0]['sidecar_id']}-default", None),
    ]
    assert {c["run_id"] for c in calls} == {"r7"} and {c["run"] for c in calls} == {"r7"}
    assert "x-forge-episode-id" not in {k.lower() for k in fake_upstream.requests[-1]["headers"]}
    assert sidecar.metrics().get("episode_relabel_refused_total", 0) == 0


@pytest.mark.parametrize("pod_env", [{"FORGE_EPISODE_ID": "pod-episode", "FORGE_TASK_ID": "pod-task"},
                                     {"POD_UID": "pod-episode", "FORGE_TASK_ID": "pod-task"}],
                         ids=["FORGE_EPISODE_ID", "POD_UID"])  # fmt: skip
def test_in_a_pod_the_pods_identity_wins_over_a_relabel_header(start_sidecar, fake_upstream, pod_env):
    """The agent runs shell commands in the pod: a header naming another episode (or task) is ignored, counted,
    and still never reaches the upstream."""
    sidecar = start_sidecar(fake_upstream.url, episode_id=None, env=pod_env)
    relabel = {"x-forge-episode-id": "someone-elses-episode", "x-forge-task-id": "an-easier-task"}
    assert httpx.post(f"{sidecar.url}{CHAT}", json=BODY, headers=relabel, timeout=30).status_code == 200
    assert {k.lower() for k in fake_upstream.requests[-1]["headers"]}.isdisjoint(relabel)
    httpx.post(f"{sidecar.url}{CHAT}", json=BODY, timeout=30)
    calls = wait_for(lambda: len(read_calls(sidecar.store)) == 2 and read_calls(sidecar.store), what="2 records")
    assert [(c["episode_id"], c["task_id"], c["seq"]) for c in calls] == [
        ("pod-episode", "pod-task", 0),
        ("pod-episode", "pod-task", 1),
    ]
    assert sidecar.metrics()["episode_relabel_refused_total"] == 1  # the call with the header, not the other
    assert "ignored" in sidecar.log()


def test_in_a_pod_trust_episode_header_lets_the_header_choose(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url, episode_id=None, env={"POD_UID": "pod-episode"},
                            extra=("--trust-episode-header",))  # fmt: skip
    httpx.post(f"{sidecar.url}{CHAT}", json=BODY, headers={"x-forge-episode-id": "from-header"}, timeout=30)
    httpx.post(f"{sidecar.url}{CHAT}", json=BODY, timeout=30)
    calls = wait_for(lambda: len(read_calls(sidecar.store)) == 2 and read_calls(sidecar.store), what="2 records")
    assert sorted(c["episode_id"] for c in calls) == ["from-header", "pod-episode"]
    assert sidecar.metrics().get("episode_relabel_refused_total", 0) == 0


def test_a_reward_needs_the_verifiers_token_and_its_source_is_the_servers(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url)
    token_file = sidecar.wal_dir / "reward-token"
    token = sidecar.reward_token()
    assert token_file.stat().st_mode & 0o777 == 0o600 and len(token) >= 32
    assert sidecar.wal_dir.stat().st_mode & 0o777 == 0o700  # and in a folder only the sidecar's uid enters
    assert str(token_file) in sidecar.log() and token not in sidecar.log()  # its path is logged, never its value
    forged = {"episode_id": "episode-1", "reward": 100.0, "source": "verifier"}
    assert sidecar.post_admin("/reward", forged, token=None)[0] == 401
    assert sidecar.post_admin("/reward", forged, token="x" * len(token))[0] == 403
    assert sidecar.post_admin("/reward", forged, token=token[:-1])[0] == 403
    with httpx.Client(timeout=5) as http:  # other spellings of a missing credential are refused the same way
        url = f"http://127.0.0.1:{sidecar.admin_port}/reward"
        assert http.post(url, json=forged, headers={"authorization": f"Basic {token}"}).status_code == 401
        assert http.post(url, json=forged, headers={"x-api-key": token}).status_code == 401
        assert http.get(f"http://127.0.0.1:{sidecar.admin_port}/healthz").status_code == 200  # read-only: open
    metrics = sidecar.metrics()
    assert metrics['reward_refused_total{reason="no_token"}'] == 3
    assert metrics['reward_refused_total{reason="wrong_token"}'] == 2
    # The verifier's two rewards are both kept, with the server's source whatever the body says.
    for value in (0.0, 1.5):
        payload = {"episode_id": "episode-1", "reward": value, "components": {"tests": 1}, "source": "self-graded"}
        status, answer = sidecar.post_admin("/reward", payload)
        assert status == 200 and answer["source"] == "admin:verifier"
    for bad, message in (({"reward": 1}, "episode_id"), ({"episode_id": "e", "reward": "high"}, "reward"),
                         ({"episode_id": "e", "reward": 1, "components": {"a": "b"}}, "components")):  # fmt: skip
        status, answer = sidecar.post_admin("/reward", bad)
        assert status == 400 and message in answer["error"]
    rows = wait_for(lambda: len(rewards := _rewards(sidecar.store)) == 2 and rewards, what="2 rewards")
    sidecar.stop()
    assert (
        _rewards(sidecar.store)
        == rows
        == [("episode-1", 0.0, "admin:verifier", {"tests": 1.0}), ("episode-1", 1.5, "admin:verifier", {"tests": 1.0})]
    )  # nothing from the refused posts, before or after the flush at exit


def test_in_a_pod_a_reward_for_another_episode_is_refused_and_counted(start_sidecar, fake_upstream):
    """One reward Secret serves every pod: with it, an agent could zero its group siblings' rewards. The pod's
    sidecar takes rewards for its own episode only."""
    sidecar = start_sidecar(fake_upstream.url, episode_id=None, env={"POD_UID": "pod-episode"})
    status, answer = sidecar.post_admin("/reward", {"episode_id": "sibling-episode", "reward": 0.0})
    assert status == 403 and "pod-episode" in answer["error"]
    assert sidecar.post_admin("/reward", {"episode_id": "pod-episode", "reward": 1.0})[0] == 200
    assert sidecar.metrics()['reward_refused_total{reason="other_episode"}'] == 1
    wait_for(lambda: _rewards(sidecar.store), what="the pod's reward")
    sidecar.stop()
    assert [row[:2] for row in _rewards(sidecar.store)] == [("pod-episode", 1.0)]


SOCKET_CLIENT = """
import http.client, json, socket, sys
class C(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(sys.argv[1])
try:
    c = C("localhost", timeout=10)
    c.request("POST", "/reward", json.dumps({"episode_id": sys.argv[2], "reward": float(sys.argv[3])}),
              {"content-type": "application/json"})
    print(c.getresponse().status)
except OSError as error:
    print(type(error).__name__)
"""


def post_on_socket(path: Path, episode: str, reward: float, uid: int | None = None) -> str:
    """POST /reward on a Unix socket from a process of ``uid``: the status, or the error that stopped the connect."""
    python = (repo_root() / ".venv-sidecar" / "bin" / "python").resolve()  # Debian's: every uid may run it
    done = subprocess.run([str(python), "-c", SOCKET_CLIENT, str(path), episode, str(reward)], user=uid,
                          capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    return done.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="the peer check is shown with another uid's process: needs root")
def test_in_a_pod_rewards_come_on_the_socket_from_root_only_and_tcp_takes_none(start_sidecar, fake_upstream, request):
    """A pod holds no reward credential: the verifier container's root posts on a socket only it and the sidecar
    mount; agent-written code (another uid) can neither open the socket nor pass the kernel's peer check, and
    loopback TCP, which every container shares, takes no reward."""
    folder = Path(tempfile.mkdtemp(prefix="forge-reward-"))  # pytest's tmp_path is closed to other uids
    folder.chmod(0o777)  # an emptyDir: every uid may enter it
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    sock = folder / "sidecar.sock"
    sidecar = start_sidecar(fake_upstream.url, episode_id=None, env={"POD_UID": "pod-episode"},
                            extra=("--reward-socket", str(sock)))  # fmt: skip
    wait_for(sock.exists, what="the reward socket")
    assert sock.stat().st_mode & 0o777 == 0o600
    assert not (sidecar.wal_dir / "reward-token").exists()  # no credential exists to be found
    assert sidecar.post_admin("/reward", {"episode_id": "pod-episode", "reward": 9.0}, token=None)[0] == 403
    assert post_on_socket(sock, "pod-episode", 7.0, uid=65534) == "PermissionError"  # mode 0600
    sock.chmod(0o666)  # were the mode ever wrong, the kernel's peer uid still refuses it
    assert post_on_socket(sock, "pod-episode", 8.0, uid=65534) == "403"
    assert post_on_socket(sock, "sibling-episode", 0.0) == "403"  # root, but not this pod's episode
    assert post_on_socket(sock, "pod-episode", 0.5) == "200"
    metrics = sidecar.metrics()
    assert metrics['reward_refused_total{reason="tcp_closed"}'] == 1
    assert metrics['reward_refused_total{reason="peer_uid"}'] == 1
    assert metrics['reward_refused_total{reason="other_episode"}'] == 1
    wait_for(lambda: _rewards(sidecar.store), what="the verifier's reward")
    sidecar.stop()
    assert [row[:3] for row in _rewards(sidecar.store)] == [("pod-episode", 0.5, "admin:verifier")]
    assert not sock.exists()  # removed at exit


def test_rewards_from_a_given_token_file_through_the_cli_and_into_the_store(start_sidecar, fake_upstream, tmp_path):
    token_file = tmp_path / "verifier-token"
    token_file.write_text("a-token-the-verifier-holds-0123456789\n")
    token_file.chmod(0o600)
    sidecar = start_sidecar(fake_upstream.url, extra=("--reward-token-file", str(token_file)))
    assert not (sidecar.wal_dir / "reward-token").exists()
    given = "a-token-the-verifier-holds-0123456789"
    assert sidecar.post_admin("/reward", {"episode_id": "e", "reward": 1}, token=given)[0] == 200
    via_sidecar = subprocess.run(
        [FORGE, "reward", "--sidecar", f"http://127.0.0.1:{sidecar.admin_port}", "--token-file", str(token_file),
         "--episode-id", "episode-1", "--value", "0.5", "--component", "tests=1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert via_sidecar.returncode == 0 and '"admin:verifier"' in via_sidecar.stdout, via_sidecar.stderr
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token-at-all-0123456789\n")
    refused = subprocess.run(
        [FORGE, "reward", "--sidecar", f"http://127.0.0.1:{sidecar.admin_port}", "--token-file", str(wrong),
         "--episode-id", "episode-1", "--value", "9"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode != 0 and "refused the reward (403)" in refused.stderr
    cli = subprocess.run([FORGE, "reward", "--store", sidecar.store, "--episode-id", "episode-2", "--value", "-1",
                          "--component", "lint=0.5"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    bad_cli = subprocess.run([FORGE, "reward", "--store", sidecar.store, "--episode-id", "e", "--value", "1",
                              "--component", "oops"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad_cli.returncode == 2 and "NAME=NUMBER" in bad_cli.stderr
    rows = wait_for(lambda: len(rewards := _rewards(sidecar.store)) == 3 and rewards, what="3 rewards")
    assert rows == [("e", 1.0, "admin:verifier", None), ("episode-1", 0.5, "admin:verifier", {"tests": 1.0}),
                    ("episode-2", -1.0, "cli", {"lint": 0.5})]  # fmt: skip


def test_an_unusable_token_file_stops_the_sidecar_with_one_line(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    for path, message in ((tmp_path / "missing", "No such file"), (short, "at least 16 characters")):
        run = subprocess.run([FORGE, "sidecar", "--reward-token-file", str(path), "--wal-dir", str(tmp_path / "w"),
                              "--store", str(tmp_path / "s"), "--print-command"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def _rewards(store: str) -> list[tuple]:
    if not Path(store).exists():  # nothing flushed yet
        return []
    run = subprocess.run(
        [FORGE, "sql", "--store", store, "--format", "json",
         "SELECT episode_id, reward, source, components FROM rewards ORDER BY episode_id, \"at\""],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return [(r["episode_id"], r["reward"], r["source"], r["components"]) for r in json.loads(run.stdout)]


CONFIGURED = "configured-secret-value"
INSTALLATION = "0a1b2c3d-4e5f-4a6b-8c7d-9e8f7a6b5c4d"


def plant_secrets_in_realistic_calls(sidecar, fake_upstream) -> None:
    """Calls as a harness makes them, with secrets wherever harnesses put them: the proxy password, API-key
    headers and cookies, Codex's installation id (body metadata and turn-metadata header), an api_key field, an
    operator-configured secret in the prompt (once JSON-escaped), in the user agent, streamed and not."""
    headers = {
        "authorization": f"Bearer {PLANTED}", "x-api-key": PLANTED, "cookie": f"session={PLANTED}; theme=dark",
        "x-codex-turn-metadata": json.dumps({"installation_id": INSTALLATION, "turn": 3}),
        "user-agent": f"codex_exec/0.41.0 (key {PLANTED})",
    }  # fmt: skip
    escaped = "".join(f"\\u{ord(c):04x}" for c in CONFIGURED)  # the same secret, as JSON escapes
    with httpx.Client(proxy=f"http://rollout-a:{PLANTED}@127.0.0.1:{sidecar.port}", timeout=30) as http:
        for stream in (False, True):
            body = {**BODY, "stream": stream, "api_key": PLANTED, "client_metadata": {"installation_id": INSTALLATION},
                    "messages": [{"role": "user", "content": f"my key is {CONFIGURED}, and {PLANTED}"}]}  # fmt: skip
            assert http.post(f"{fake_upstream.url}{CHAT}", json=body, headers=headers).status_code == 200
        raw = ('{"model": "m", "messages": [{"role": "user", "content": "spelled: ' + escaped + '"}]}').encode()
        answer = http.post(f"{fake_upstream.url}{CHAT}", content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 200
    wait_for(lambda: len(read_calls(sidecar.store)) == 3, what="the 3 records")
    assert {k.lower() for k in fake_upstream.requests[-2]["headers"]}.isdisjoint({"authorization", "x-api-key"})
    sidecar.stop()


def test_planted_secrets_reach_no_decoded_record_no_log_and_no_wal(start_sidecar, fake_upstream):
    sidecar = start_sidecar(fake_upstream.url, mode="regular", episode_id=None, env={"FORGE_SECRETS": CONFIGURED})
    plant_secrets_in_realistic_calls(sidecar, fake_upstream)
    (request,) = [json.loads(c["request_json"]) for c in read_calls(sidecar.store) if c["stream"]]
    assert request["api_key"] == REDACTED and REDACTED in request["messages"][0]["content"]  # redacted, not dropped
    assert_no_secret_anywhere(sidecar, [PLANTED, CONFIGURED, INSTALLATION])


def test_the_secret_check_fails_when_redaction_is_disabled(start_sidecar, fake_upstream, tmp_path):
    """The check above can fail: the same calls through a sidecar whose redaction is switched off (its
    sidecar.redact functions replaced by identities, via a sitecustomize in the sidecar's PYTHONPATH) leave the
    secrets in the decoded records, and the check says where."""
    patch = tmp_path / "no-redaction"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(
        "import json\nimport sidecar.redact as r\n"
        "r.scrub_text = lambda text, secrets: text\nr.redacted_text = lambda text, secrets: text\n"
        "r.redacted_json = lambda value, secrets: json.dumps(value)\nr.secrets_in_headers = lambda headers: []\n"
    )
    sidecar = start_sidecar(fake_upstream.url, mode="regular", episode_id=None,
                            env={"FORGE_SECRETS": CONFIGURED, "PYTHONPATH": f"{patch}:{repo_root()}"})  # fmt: skip
    plant_secrets_in_realistic_calls(sidecar, fake_upstream)
    with pytest.raises(AssertionError) as failed:
        assert_no_secret_anywhere(sidecar, [PLANTED, CONFIGURED, INSTALLATION])
    assert "request_json" in str(failed.value) and "user_agent" in str(failed.value)
