"""`forge inject serve` over real HTTPS: certificates from `forge inject certs`, verified as the API server would
(the webhook CA, the Service's DNS name), real AdmissionReview requests from the golden files."""

import base64
import http.client
import json
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonpatch
import pytest
from cryptography import x509

from k8s.certs import SERVICE, service_names, write_cluster_secrets
from k8s.settings import InjectorSettings
from k8s.webhook import WebhookServer
from trainer.serve import free_port

GOLDEN = Path(__file__).parent / "golden"
FORGE = str(Path(sys.executable).parent / "forge")
SERVICE_DNS = f"{SERVICE}.openforge-system.svc"


class ServiceConnection(http.client.HTTPSConnection):
    """Connects to loopback but checks the certificate for the Service's name, as the API server does."""

    def connect(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.sock = self._context.wrap_socket(sock, server_hostname=SERVICE_DNS)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_cluster_secrets(tmp_path_factory.mktemp("certs")).dir


@pytest.fixture(scope="module")
def webhook(secrets_dir: Path) -> Iterator[WebhookServer]:
    lines: list[str] = []
    server = WebhookServer(
        "127.0.0.1",
        0,
        secrets_dir / "webhook/tls.crt",
        secrets_dir / "webhook/tls.key",
        InjectorSettings(),
        lines.append,
    ).start()
    server.log_lines = lines  # type: ignore[attr-defined]
    yield server
    server.stop()


def post(webhook: WebhookServer, secrets_dir: Path, path: str, body: bytes) -> tuple[int, dict]:
    context = ssl.create_default_context(cafile=str(secrets_dir / "webhook/ca.crt"))
    connection = ServiceConnection("127.0.0.1", webhook.port, context=context, timeout=10)
    try:
        connection.request("POST", path, body=body, headers={"content-type": "application/json"})
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_a_real_review_over_https_gets_the_uid_back_and_a_base64_patch_that_applies(webhook, secrets_dir):
    request = (GOLDEN / "namespace-enabled.request.json").read_bytes()
    status, review = post(webhook, secrets_dir, "/inject/namespace-enabled", request)
    sent = json.loads(request)["request"]
    assert status == 200 and review["apiVersion"] == "admission.k8s.io/v1" and review["kind"] == "AdmissionReview"
    response = review["response"]
    assert response["uid"] == sent["uid"] and response["allowed"] is True and response["patchType"] == "JSONPatch"
    pod = jsonpatch.apply_patch(sent["object"], json.loads(base64.b64decode(response["patch"])))
    assert pod["spec"]["initContainers"][2]["name"] == "openforge-sidecar"


def test_the_path_says_whether_the_namespace_opted_in(webhook, secrets_dir):
    request = (GOLDEN / "namespace-enabled.request.json").read_bytes()
    _, review = post(webhook, secrets_dir, "/inject", request)  # same pod, its namespace not labelled
    patch = json.loads(base64.b64decode(review["response"]["patch"]))
    assert len(patch) == 1 and "not enabled" in json.dumps(patch)


def test_malformed_and_refused_requests_are_answered_and_the_server_lives_on(webhook, secrets_dir):
    status, review = post(webhook, secrets_dir, "/inject", b"\x00garbage")
    assert status == 200 and review["response"]["allowed"] is False and review["response"]["status"]["code"] == 400
    refused = (GOLDEN / "refused-share-process-namespace.request.json").read_bytes()
    _, review = post(webhook, secrets_dir, "/inject/namespace-enabled", refused)
    assert review["response"]["allowed"] is False and "shareProcessNamespace" in review["response"]["status"]["message"]
    status, _ = post(webhook, secrets_dir, "/mutate", b"{}")
    assert status == 404
    assert any("denied: openforge: shareProcessNamespace" in line for line in webhook.log_lines)
    assert not any("python:3.12" in line for line in webhook.log_lines)


def test_a_client_that_does_not_trust_the_webhook_ca_is_refused_the_handshake(webhook, secrets_dir, tmp_path):
    other = write_cluster_secrets(tmp_path / "other").dir
    context = ssl.create_default_context(cafile=str(other / "webhook/ca.crt"))
    with pytest.raises(ssl.SSLCertVerificationError):
        ServiceConnection("127.0.0.1", webhook.port, context=context, timeout=10).connect()


def test_certs_cover_the_service_names_and_are_kept_unless_forced(tmp_path):
    out = tmp_path / "certs"
    done = subprocess.run([FORGE, "inject", "certs", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ca_bundle = base64.b64decode(done.stdout.strip())
    assert ca_bundle == (out / "webhook/ca.crt").read_bytes()
    cert = x509.load_pem_x509_certificate((out / "webhook/tls.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == service_names(SERVICE, "openforge-system")
    assert (out / "webhook/tls.key").stat().st_mode & 0o777 == 0o600
    assert not (out / "reward-token").exists()  # rewards go on the sidecar's socket: no credential to hand out
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    subprocess.run([FORGE, "inject", "certs", "--out", str(out)], capture_output=True, check=True, timeout=60)
    assert before == {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    subprocess.run(
        [FORGE, "inject", "certs", "--out", str(out), "--force"], capture_output=True, check=True, timeout=60
    )
    assert before[out / "webhook/tls.crt"] != (out / "webhook/tls.crt").read_bytes()


def test_serve_with_a_missing_certificate_fails_in_one_line(tmp_path):
    missing = ["--cert", str(tmp_path / "no.crt"), "--key", str(tmp_path / "no.key")]
    done = subprocess.run(
        [FORGE, "inject", "serve", *missing, "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert (
        done.returncode == 2 and done.stderr.count("\n") == 1 and "cannot load the serving certificate" in done.stderr
    )


def test_forge_inject_serve_answers_on_https_and_stops_on_sigterm(secrets_dir):
    import time

    port = free_port()
    server = subprocess.Popen(
        [FORGE, "inject", "serve", "--host", "127.0.0.1", "--port", str(port), "--cert",
         str(secrets_dir / "webhook/tls.crt"), "--key", str(secrets_dir / "webhook/tls.key")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        context = ssl.create_default_context(cafile=str(secrets_dir / "webhook/ca.crt"))
        deadline = time.monotonic() + 30
        while True:
            try:
                connection = ServiceConnection("127.0.0.1", port, context=context, timeout=5)
                connection.request("GET", "/healthz")
                assert json.loads(connection.getresponse().read()) == {"ok": True}
                break
            except ConnectionRefusedError:
                assert server.poll() is None and time.monotonic() < deadline, (
                    server.stderr.read() if server.stderr else ""
                )
                time.sleep(0.2)
    finally:
        server.terminate()
        assert server.wait(timeout=10) == 0
