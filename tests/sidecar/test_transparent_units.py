"""Transparent mode's pieces without a network: TLS decisions, API-format errors, `forge ca init`."""

import json
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from forge.errors import ForgeError
from sidecar import ca, transparent
from sidecar.apis.errors import error_body, error_headers
from tests.support.netns import issue, make_ca

FORGE = str(Path(sys.executable).parent / "forge")
HOSTS = transparent.model_host_names("api.openai.com, API.Anthropic.com ,gateway.internal:8443")


@pytest.mark.parametrize(
    ("sni", "port", "decision"),
    [
        ("api.openai.com", 443, transparent.INTERCEPT),
        ("API.OPENAI.COM.", 443, transparent.INTERCEPT),  # names compare without case or the root dot
        ("api.anthropic.com", 443, transparent.INTERCEPT),
        ("gateway.internal", 8443, transparent.INTERCEPT),
        ("gateway.internal", 443, transparent.PASSTHROUGH),  # host:port entries match that port only
        ("files.pythonhosted.org", 443, transparent.PASSTHROUGH),
        ("api.openai.com.evil.example", 443, transparent.PASSTHROUGH),
        (None, 443, transparent.PASSTHROUGH),  # no SNI: cannot be a model host by name, never decrypted
        ("", 443, transparent.PASSTHROUGH),
    ],
)
def test_only_model_hosts_named_in_the_sni_are_opened(sni, port, decision):
    assert transparent.tls_decision(sni, port, HOSTS) == decision


def test_an_opened_connection_answers_h2_when_offered():
    assert transparent.preferred_alpn([b"http/1.1", b"h2"], http2=True) == b"h2"
    assert transparent.preferred_alpn([b"http/1.1"], http2=True) is None
    assert transparent.preferred_alpn([b"http/1.1", b"h2"], http2=False) is None


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
def test_openai_apis_get_openai_errors(api):
    body = json.loads(error_body(api, 502, "The policy server is unavailable.", "policy_unavailable"))
    assert body == {"error": {"message": "The policy server is unavailable.", "type": "server_error", "param": None,
                              "code": "policy_unavailable"}}  # fmt: skip
    assert error_headers(api) == {"content-type": "application/json"}


def test_anthropic_messages_get_anthropic_errors():
    body = json.loads(error_body("messages", 503, "Overloaded."))
    assert body == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded."}}
    assert json.loads(error_body("messages", 502, "x"))["error"]["type"] == "api_error"
    assert error_headers("messages")["x-should-retry"] == "true"


def test_the_openai_sdk_reads_our_error_as_a_typed_error():
    import httpx2  # the SDKs' own httpx
    import openai

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(502, content=error_body("chat", 502, "The policy server is unavailable."),
                               headers=error_headers("chat"))  # fmt: skip

    sdk = openai.OpenAI(api_key="k", max_retries=0, http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))
    with pytest.raises(openai.InternalServerError) as raised:
        sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 502 and raised.value.message.endswith("The policy server is unavailable.")


def test_anthropic_sdk_reads_our_error_as_a_typed_error():
    import anthropic
    import httpx2

    def answer(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(503, content=error_body("messages", 503, "Overloaded."),
                               headers=error_headers("messages"))  # fmt: skip

    sdk = anthropic.Anthropic(api_key="k", max_retries=0,
                              http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))  # fmt: skip
    with pytest.raises(anthropic.APIStatusError) as raised:
        sdk.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    body = raised.value.body
    assert raised.value.status_code == 503 and isinstance(body, dict) and body["error"]["type"] == "overloaded_error"


def test_ca_init_makes_a_ca_mitmproxy_can_load_and_a_bundle_with_the_system_cas(tmp_path):
    done = subprocess.run([FORGE, "ca", "init", "--dir", str(tmp_path / "ca")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    files = ca.CaFiles(tmp_path / "ca")
    for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "NODE_EXTRA_CA_CERTS", "CODEX_CA_CERTIFICATE"):
        assert f"{name}=" in done.stdout
    assert files.ca.stat().st_mode & 0o777 == 0o600  # the key is not readable by the harness
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    bundle = files.bundle.read_bytes()
    assert bundle.endswith(files.cert.read_bytes())
    system = ca.SYSTEM_BUNDLE.read_bytes()
    assert system.strip() in bundle and bundle.count(b"BEGIN CERTIFICATE") == system.count(b"BEGIN CERTIFICATE") + 1
    context = ssl.create_default_context(cafile=str(files.bundle))  # one valid bundle for OpenSSL clients
    assert len(context.get_ca_certs()) >= 2
    # mitmproxy (the sidecar's env) loads it as its own CA from the folder
    load = (f"from mitmproxy.certs import CertStore; s = CertStore.from_store({str(files.dir)!r}, 'mitmproxy', 2048);"
            "print(s.default_ca.cn)")  # fmt: skip
    venv = Path(__file__).resolve().parents[2] / ".venv-sidecar" / "bin" / "python"
    loaded = subprocess.run([str(venv), "-c", load], capture_output=True, text=True)
    assert loaded.stdout.strip() == ca.CA_NAME, loaded.stderr
    # A second run keeps the CA (pods already trust it); --force makes a new one.
    before = files.ca.read_bytes()
    ca.init_ca(files.dir)
    assert files.ca.read_bytes() == before
    ca.init_ca(files.dir, force=True)
    assert files.ca.read_bytes() != before


def test_ca_init_takes_a_given_ca_as_a_kubernetes_secret_holds_it(tmp_path):
    from cryptography.hazmat.primitives import serialization

    key, cert = make_ca("Cluster CA")
    (tmp_path / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))  # fmt: skip
    (tmp_path / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files = ca.init_ca(tmp_path / "ca", cert=tmp_path / "tls.crt", key=tmp_path / "tls.key")
    assert files.cert.read_bytes() == (tmp_path / "tls.crt").read_bytes()
    assert files.ca.read_bytes().startswith((tmp_path / "tls.key").read_bytes())


def test_a_given_ca_that_is_not_a_ca_or_not_its_keys_is_refused(tmp_path):
    from cryptography.hazmat.primitives import serialization

    ca_key, ca_cert = make_ca("Cluster CA")
    leaf_key, leaf_cert = issue(ca_key, ca_cert, "example.org")
    (tmp_path / "leaf.key").write_bytes(leaf_key)
    (tmp_path / "leaf.crt").write_bytes(leaf_cert)
    (tmp_path / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    with pytest.raises(ForgeError, match="not a CA"):
        ca.init_ca(tmp_path / "a", cert=tmp_path / "leaf.crt", key=tmp_path / "leaf.key")
    with pytest.raises(ForgeError, match="does not belong to the given key"):
        ca.init_ca(tmp_path / "b", cert=tmp_path / "ca.crt", key=tmp_path / "leaf.key")
    with pytest.raises(ForgeError, match="give both"):
        ca.init_ca(tmp_path / "c", cert=tmp_path / "ca.crt")


def test_the_sidecar_refuses_a_ca_dir_without_a_ca(tmp_path):
    args = ["--ca-dir", str(tmp_path / "none"), "--store", str(tmp_path / "s"), "--print-command"]
    done = subprocess.run([FORGE, "sidecar", "--mode", "transparent", *args], capture_output=True, text=True)
    assert done.returncode == 2 and "forge ca init" in done.stderr


def test_transparent_mode_listens_on_both_families_and_verifies_upstreams(tmp_path):
    ca.init_ca(tmp_path / "ca")
    extra = tmp_path / "extra.pem"
    _, cert = make_ca("Upstream CA")
    from cryptography.hazmat.primitives import serialization

    extra.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    options = ["--ca-dir", str(tmp_path / "ca"), "--store", str(tmp_path / "s"), "--wal-dir", str(tmp_path / "w"),
               "--upstream-ca", str(extra), "--print-command"]  # fmt: skip
    done = subprocess.run([FORGE, "sidecar", "--mode", "transparent", *options], capture_output=True, text=True)
    args = json.loads(done.stdout)
    assert args[args.index("--listen-host") + 1] == ""  # REDIRECT targets 127.0.0.1 and ::1
    assert f"confdir={tmp_path / 'ca'}" in args and "forge_tls_passthrough=true" in args
    assert not any(a.startswith("ssl_insecure") for a in args)
    (trusted,) = [a.split("=", 1)[1] for a in args if a.startswith("ssl_verify_upstream_trusted_ca=")]
    bundle = Path(trusted).read_bytes()
    assert bundle.startswith(ca.SYSTEM_BUNDLE.read_bytes().rstrip(b"\n")) and extra.read_bytes() in bundle
    regular = json.loads(subprocess.run([FORGE, "sidecar", "--store", str(tmp_path / "s"), "--wal-dir",
                                         str(tmp_path / "w2"), "--print-command"],
                                        capture_output=True, text=True).stdout)  # fmt: skip
    assert regular[regular.index("--listen-host") + 1] == "127.0.0.1" and "forge_tls_passthrough=true" not in regular
