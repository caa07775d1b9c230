"""The injected containers' commands, run as the sidecar image would run them: the sidecar environment's Python
with only the files k8s/images/sidecar.Dockerfile copies (no Docker here: the same layout in a folder)."""

import contextlib
import http.server
import json
import os
import re
import shutil
import socketserver
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from k8s import inject
from k8s.settings import InjectorSettings
from sidecar.ca import init_ca

ROOT = Path(__file__).resolve().parents[2]
SIDECAR_PYTHON = ROOT / ".venv-sidecar" / "bin" / "python"


@pytest.fixture(scope="module")
def image_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """/opt/openforge/src as the Dockerfile lays it out: every `COPY <repo paths> /opt/openforge/src/<dir>/`."""
    src = tmp_path_factory.mktemp("image") / "src"
    dockerfile = (ROOT / "k8s/images/sidecar.Dockerfile").read_text()
    for sources, target in re.findall(r"^COPY ((?:\S+ )+)/opt/openforge/src/(\S*)$", dockerfile, re.M):
        for source in sources.split():
            destination = src / target / (Path(source).name if target.endswith("/") else "")
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, destination, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, destination)
    assert (src / "k8s/pod.py").exists() and (src / "sidecar/addon.py").exists()
    return src


def pod_forge(image_src: Path, args: list[str], **kwargs) -> subprocess.CompletedProcess:
    if not SIDECAR_PYTHON.exists():
        pytest.fail("no sidecar environment: run `make env`")
    env = {
        "PYTHONPATH": str(image_src),
        "FORGE_SIDECAR_VENV": str(SIDECAR_PYTHON.parent.parent),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run([str(SIDECAR_PYTHON), "-m", "k8s.pod", *args], capture_output=True, text=True, timeout=60,
                          env=env, **kwargs)  # fmt: skip


def test_the_net_init_container_prints_the_transparent_mode_rules(image_src):
    container = inject.net_init_container(InjectorSettings(exclude_cidrs=("10.96.0.0/12",)))
    assert container["command"] == ["forge"]
    done = pod_forge(image_src, [*container["args"], "--dry-run"])
    assert done.returncode == 0, done.stderr
    assert "iptables -w -t nat -A FORGE_OUTPUT -m owner --uid-owner 1337 -j RETURN" in done.stdout
    assert "--dports 80,443 -j REDIRECT --to-ports 15001" in done.stdout
    assert "-d 10.96.0.0/12 -j RETURN" in done.stdout


def test_the_ca_init_container_copies_the_secrets_ca_where_the_sidecar_reads_it(image_src, tmp_path):
    from k8s.certs import write_cluster_secrets

    secret = write_cluster_secrets(tmp_path / "certs").sidecar_ca
    args = inject.ca_init_container(InjectorSettings())["args"]
    args = [a.replace(inject.CA_SECRET_DIR, str(secret)).replace(inject.CA_DIR, str(tmp_path / "ca")) for a in args]
    done = pod_forge(image_src, args)
    assert done.returncode == 0, done.stderr
    pem = (tmp_path / "ca/mitmproxy-ca.pem").read_bytes()
    assert (secret / "tls.crt").read_bytes() in pem and b"PRIVATE KEY" in pem


def test_the_sidecar_containers_arguments_are_the_sidecars_own_options(image_src, tmp_path):
    args = inject.sidecar_container(InjectorSettings(s3_endpoint="http://minio:9000"))["args"]
    mounts = {inject.WAL_DIR: tmp_path / "wal", inject.CA_DIR: tmp_path / "ca", inject.REWARD_DIR: tmp_path / "reward"}
    for path, local in mounts.items():
        args = [a.replace(path, str(local)) for a in args]
    init_ca(tmp_path / "ca")  # what the CA init container leaves in the shared emptyDir
    done = pod_forge(image_src, [*args, "--print-command"])
    assert done.returncode == 0, done.stderr
    mitmdump = json.loads(done.stdout)
    assert "--mode" in mitmdump and mitmdump[mitmdump.index("--mode") + 1] == "transparent"
    assert "forge_tls_passthrough=true" in mitmdump and "forge_s3_endpoint=http://minio:9000" in mitmdump
    assert f"forge_reward_socket={tmp_path / 'reward/sidecar.sock'}" in mitmdump


def test_the_probe_passes_only_while_the_admin_endpoint_answers(image_src):
    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = str(server.server_address[1])
    probe = inject.sidecar_container(InjectorSettings())["readinessProbe"]["exec"]["command"]
    assert probe[0] == "forge"
    try:
        assert pod_forge(image_src, [*probe[1:-1], port]).returncode == 0
    finally:
        server.shutdown()
        server.server_close()
    down = pod_forge(image_src, [*probe[1:-1], port])
    assert down.returncode == 2 and "does not answer" in down.stderr


@contextlib.contextmanager
def fake_admin() -> Iterator[tuple[str, list[tuple[str | None, dict]]]]:
    """Stands in for the sidecar's admin endpoint: its URL, and the (authorization, body) of each POST."""
    received: list[tuple[str | None, dict]] = []

    class Admin(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            received.append((self.headers.get("authorization"), body))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Admin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def run_verify(image_src: Path, tmp_path: Path, env: dict[str, str], script: str) -> subprocess.CompletedProcess:
    """`forge verify -- sh -c SCRIPT` (episode run.add.0, with ``env``) in a workspace any uid may enter (a pod's
    emptyDir) holding answer.txt."""
    workspace = Path(tempfile.mkdtemp(prefix="forge-workspace-"))
    workspace.chmod(0o755)
    (workspace / "answer.txt").write_text("5")
    env = {"FORGE_EPISODE_ID": "run.add.0", **env}
    try:
        return subprocess.run(
            [str(SIDECAR_PYTHON), "-m", "k8s.pod", "verify", "--termination-log", str(tmp_path / "termination-log"),
             "--", "sh", "-c", script],
            capture_output=True, text=True, timeout=60, cwd=workspace,
            env={"PYTHONPATH": str(image_src), "PATH": "/usr/bin:/bin", **env},
        )  # fmt: skip
    finally:
        shutil.rmtree(workspace)


def test_the_verifier_posts_its_reward_with_the_token_and_leaves_its_verdict(image_src, tmp_path):
    with fake_admin() as (url, received):
        script = (
            'test "$(cat answer.txt)" = 5 && echo \'{"reward": 1, "components": {"exact": 1}}\' > "$FORGE_VERDICT_FILE"'
        )
        done = verify_in_workspace(image_src, tmp_path, url, script)
    assert done.returncode == 0, done.stderr
    assert received == [("Bearer s3cret-token", {"episode_id": "run.add.0", "reward": 1.0,
                                                 "components": {"exact": 1.0}, "source": "verifier"})]  # fmt: skip
    assert json.loads((tmp_path / "termination-log").read_text())["reward"] == 1.0
    assert "s3cret-token" not in done.stdout + done.stderr


@contextlib.contextmanager
def fake_reward_socket() -> Iterator[tuple[Path, list[tuple[int, dict]]]]:
    """Stands in for the sidecar's reward socket (served by this process, root), in a folder every uid may write
    (an emptyDir): its path, and the (peer uid, body) of each POST."""
    from sidecar.admin import peer_uid

    received: list[tuple[int, dict]] = []

    class Admin(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            received.append((peer_uid(self.request), body))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args) -> None:
            pass

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

        def get_request(self):
            connection, _ = self.socket.accept()
            return connection, ("unix", 0)

    folder = Path(tempfile.mkdtemp(prefix="forge-reward-"))
    folder.chmod(0o777)
    path = folder / "sidecar.sock"
    server = Server(str(path), Admin)
    path.chmod(0o600)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield path, received
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(folder, ignore_errors=True)


def verify_in_workspace(image_src: Path, tmp_path: Path, admin_url: str, script: str) -> subprocess.CompletedProcess:
    """`forge verify` posting to ``admin_url`` with the token in tmp_path."""
    (tmp_path / "token").write_text("s3cret-token\n")
    (tmp_path / "token").chmod(0o600)
    env = {"FORGE_ADMIN_URL": admin_url, "FORGE_REWARD_TOKEN_FILE": str(tmp_path / "token")}
    return run_verify(image_src, tmp_path, env, script)


def verify_with_socket(image_src: Path, tmp_path: Path, sock: Path, script: str) -> subprocess.CompletedProcess:
    """`forge verify` as the injected verifier container runs it (root, the socket's variables)."""
    env = {"FORGE_REWARD_SOCKET": str(sock), "FORGE_SIDECAR_UID": "0"}
    return run_verify(image_src, tmp_path, env, script)


@pytest.mark.skipif(os.geteuid() != 0, reason="forge verify runs the verifier as another uid only as root")
def test_in_a_pod_the_reward_goes_on_the_socket_which_the_verifiers_code_cannot_use(image_src, tmp_path):
    """The verifier runs agent-written code as uid 65534: it cannot open the reward socket (mode 0600) nor find the
    socket's path in its environment; forge verify (root) posts the verdict there."""
    with fake_reward_socket() as (sock, received):
        forged = (f"curl -s --max-time 5 --unix-socket {sock} -d '{{\"episode_id\": \"run.add.0\", \"reward\": 9}}' "
                  "http://sidecar/reward")  # fmt: skip
        script = (f'{forged}; test -z "$FORGE_REWARD_SOCKET" && test "$(id -u)" = 65534 && '
                  'echo 0.5 > "$FORGE_VERDICT_FILE"')  # fmt: skip
        done = verify_with_socket(image_src, tmp_path, sock, script)
    assert done.returncode == 0, done.stderr
    assert received == [(0, {"episode_id": "run.add.0", "reward": 0.5, "components": {}, "source": "verifier"})]
    assert json.loads((tmp_path / "termination-log").read_text())["reward"] == 0.5


@pytest.mark.skipif(os.geteuid() != 0, reason="forge verify runs the verifier as another uid only as root")
def test_a_socket_the_verifiers_code_put_in_the_sidecars_place_gets_no_reward(image_src, tmp_path):
    """The socket's folder is an emptyDir any uid may write: agent-written code can remove the sidecar's socket and
    listen in its place (to read or answer the reward). forge verify checks who listens before it sends a byte."""
    with fake_reward_socket() as (sock, received):
        listen = (f"import socket, os, time; s = socket.socket(socket.AF_UNIX); s.bind('{sock}'); s.listen(); "
                  f"os.chmod('{sock}', 0o666); time.sleep(15)")  # fmt: skip
        script = (f'rm -f {sock} && ({SIDECAR_PYTHON.resolve()} -c "{listen}" >/dev/null 2>&1 &) && sleep 1 && '
                  'echo 1 > "$FORGE_VERDICT_FILE"')  # fmt: skip
        done = verify_with_socket(image_src, tmp_path, sock, script)
    assert done.returncode != 0 and "served by uid 65534, not the sidecar's (0)" in done.stderr, done.stderr
    assert received == []
