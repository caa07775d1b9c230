"""Transparent mode end to end, in network namespaces the test makes and removes (root; CI runs as root).

A pod namespace holds the clients (uid 4242, no proxy settings, only the CA trust env) and the sidecar
(`forge sidecar --mode transparent` as uid 1337) behind `forge net-init`; an "internet" namespace holds two TLS
sites with their own CA: ``api.openai.com`` (a model host) and ``files.example.org`` (not one), named through
the pod's private hosts file. Model calls are served by the real vLLM (through a relay on the test's own veth)
and recorded token-exact; the other site's traffic passes through with its own certificate, unrecorded.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.netns import (
    CLIENT_UID,
    HERE,
    PROXY_UID,
    PodNetwork,
    Relay,
    build_pod_network,
    closed_to_others,
    readable_code,
    root_cause,
    sh,
    stop,
)
from tests.support.sidecar import read_calls, wait_for
from trainer.serve import free_port

pytestmark = [pytest.mark.integration, pytest.mark.skipif(root_cause() is not None, reason=str(root_cause()))]

FORGE = str(Path(sys.executable).parent / "forge")
MODEL_HOST, OTHER_HOST = "api.openai.com", "files.example.org"
PROXY_PORT, ADMIN_PORT = 15001, 15002
# The clients run as another uid with Debian's python3 (root's pyenv is 0700) and the main env's packages.
MAIN_SITE_PACKAGES = str(Path(httpx.__file__).resolve().parent.parent)
API_KEY = "sk-transparent-test-key"


@dataclass
class TransparentPod:
    net: PodNetwork
    relay: Relay
    ca_dir: Path
    store: Path
    wal: Path
    client_home: Path
    upstream: str
    code: Path  # a folder every uid can read holding the `sidecar` package and the client script
    sidecar: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.net.work / "sidecar.log"

    def start_sidecar(self) -> None:
        if self.sidecar is not None and self.sidecar.poll() is None:
            return
        args = json.loads(sh([
            FORGE, "sidecar", "--mode", "transparent", "--listen-port", str(PROXY_PORT), "--upstream", self.upstream,
            "--store", str(self.store), "--wal-dir", str(self.wal), "--admin-port", str(ADMIN_PORT),
            "--flush-seconds", "0.3", "--episode-id", "transparent-1", "--model-hosts", MODEL_HOST,
            "--ca-dir", str(self.ca_dir), "--upstream-ca", str(self.net.internet_ca), "--print-command",
        ]).stdout)  # fmt: skip
        assert "ssl_insecure" not in " ".join(args)
        # uid 1337 runs the addon from a folder it can read, and mitmdump through no symlink inside the checkout.
        args[0] = str(Path(args[0]).resolve())
        args[args.index("-s") + 1] = str(self.code / "sidecar" / "addon.py")
        for path in (self.store, self.wal):
            shutil.chown(path, PROXY_UID, PROXY_UID)
            for child in path.rglob("*"):
                os.chown(child, PROXY_UID, PROXY_UID)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(self.wal)}
        self.sidecar = self.net.pod.popen(args, self.log, uid=PROXY_UID, env=env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.sidecar.poll() is None, f"the sidecar exited:\n{self.log.read_text()}"
            probe = self.net.pod.run(["curl", "-sf", f"http://127.0.0.1:{ADMIN_PORT}/metrics"], check=False)
            if probe.returncode == 0:
                return
            time.sleep(0.2)
        raise AssertionError(f"the sidecar did not start:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        done = self.net.pod.run(["curl", "-sf", f"http://127.0.0.1:{ADMIN_PORT}/metrics"])
        return {name.removeprefix("forge_sidecar_"): float(value)
                for name, value in (line.rsplit(" ", 1) for line in done.stdout.splitlines())}  # fmt: skip

    def stop_sidecar(self) -> None:
        if self.sidecar is not None:
            stop(self.sidecar)

    def client_env(self) -> dict[str, str]:
        """No proxy variables: only where the CAs are (the bundle of `forge ca init` + the internet's CA)."""
        bundle = self.net.work / "client-bundle.pem"
        return {
            "PATH": "/usr/bin:/bin", "HOME": str(self.client_home), "PYTHONPATH": MAIN_SITE_PACKAGES,
            "SSL_CERT_FILE": str(bundle), "REQUESTS_CA_BUNDLE": str(bundle),
            "NODE_EXTRA_CA_CERTS": str(self.net.work / "node-extra.pem"),
        }  # fmt: skip

    def client(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return self.net.pod.run(args, uid=CLIENT_UID, env=self.client_env(), check=check, timeout=120)

    def site_log(self, host: str) -> list[str]:
        path = self.net.sites[host].log
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def pod(policy_server) -> Iterator[TransparentPod]:
    for needed in ((HERE.parent.parent / ".venv-sidecar" / "bin").resolve(), Path(MAIN_SITE_PACKAGES)):
        if blocked := closed_to_others(needed):
            pytest.fail(f"{blocked} is closed to other uids: the sidecar runs as uid {PROXY_UID}, clients as "
                        f"{CLIENT_UID}; check out (and build the envs) where every uid can read")  # fmt: skip
    # vLLM's first chat call with logprobs can take a minute on a loaded CPU: pay it here, not in a client's timeout.
    warm = {**model_body("Warm up."), "model": policy_server.name, "return_token_ids": True, "logprobs": True}
    httpx.post(f"{policy_server.base_url}/v1/chat/completions", json=warm, timeout=300).raise_for_status()
    net = build_pod_network([MODEL_HOST, OTHER_HOST])
    relay = Relay((net.root_address, free_port()), ("127.0.0.1", policy_server.port))
    try:
        relay.open()
        ca_dir, store, wal, home = (net.work / name for name in ("ca", "store", "wal", "client-home"))
        for path in (store, wal, home):
            path.mkdir()
        shutil.chown(home, CLIENT_UID, CLIENT_UID)
        done = sh([FORGE, "ca", "init", "--dir", str(ca_dir), "--owner", str(PROXY_UID)])
        assert f"NODE_EXTRA_CA_CERTS={ca_dir}/mitmproxy-ca-cert.pem" in done.stdout
        internet_ca = net.internet_ca.read_bytes()
        (net.work / "client-bundle.pem").write_bytes((ca_dir / "ca-bundle.pem").read_bytes() + internet_ca)
        (net.work / "node-extra.pem").write_bytes((ca_dir / "mitmproxy-ca-cert.pem").read_bytes() + internet_ca)
        net.pod.run([FORGE, "net-init", "--proxy-uid", str(PROXY_UID), "--proxy-port", str(PROXY_PORT)])
        transparent = TransparentPod(
            net,
            relay,
            ca_dir,
            store,
            wal,
            home,
            f"http://{relay.listen[0]}:{relay.listen[1]}",
            readable_code(HERE.parent.parent, net.work, [CLIENTS_SCRIPT]),
        )
        transparent.start_sidecar()
        yield transparent
        transparent.stop_sidecar()
    finally:
        relay.close()
        net.teardown()


CLIENTS_SCRIPT = Path("tests/sidecar/transparent_clients.py")  # relative to the checkout, and to its copy


def model_body(content: str) -> dict:
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0}


def curl_model_call(pod: TransparentPod, content: str, family: str) -> dict:
    done = pod.client([
        "curl", "-sS", "--fail-with-body", family, f"https://{MODEL_HOST}/v1/chat/completions",
        "-H", "content-type: application/json", "-H", f"authorization: Bearer {API_KEY}",
        "-d", json.dumps(model_body(content)),
    ])  # fmt: skip
    return {"text": json.loads(done.stdout)["choices"][0]["message"]["content"]}


def curl_other(pod: TransparentPod, path: str, family: str) -> dict:
    return json.loads(pod.client(["curl", "-sS", "--fail-with-body", family, f"https://{OTHER_HOST}{path}"]).stdout)


NODE_CLIENT = """
const [content, other] = process.argv.slice(1);
const body = {model: "gpt-4o", messages: [{role: "user", content}], max_tokens: 8, temperature: 0};
const reply = await fetch("https://api.openai.com/v1/chat/completions", {method: "POST", body: JSON.stringify(body),
  headers: {"content-type": "application/json", authorization: "Bearer sk-transparent-test-key"}});
if (!reply.ok) throw new Error(`status ${reply.status}: ${await reply.text()}`);
const text = (await reply.json()).choices[0].message.content;
console.log(JSON.stringify({text, other: await (await fetch(other)).json()}));
"""


def run_client(pod: TransparentPod, client: str, content: str, other_path: str) -> dict:
    if client in ("curl-ipv4", "curl-ipv6"):
        family = "-4" if client == "curl-ipv4" else "-6"
        return {**curl_model_call(pod, content, family), "other": curl_other(pod, other_path, family)}
    if client == "node-fetch":
        done = pod.client(["/usr/bin/node", "--input-type=module", "-e", NODE_CLIENT, content,
                           f"https://{OTHER_HOST}{other_path}"])  # fmt: skip
        return json.loads(done.stdout)
    script = str(pod.code / CLIENTS_SCRIPT)
    done = pod.client(["/usr/bin/python3", script, client, content, f"https://{OTHER_HOST}{other_path}"])
    return json.loads(done.stdout)


CLIENTS = ["curl-ipv4", "curl-ipv6", "requests", "httpx-h2", "node-fetch", "openai-sdk"]


@pytest.mark.parametrize("client", CLIENTS)
def test_an_unmodified_clients_model_call_is_recorded_token_exact_and_other_traffic_passes(pod, vllm, policy_server,
                                                                                             client):  # fmt: skip
    content = f"In two words, what is a {client.replace('-', ' ')}?"
    other_path = f"/downloads/{client}"
    got = run_client(pod, client, content, other_path)

    expected = vllm.post("/v1/chat/completions", json={**model_body(content), "model": policy_server.name,
                                                      "return_token_ids": True}).json()  # fmt: skip
    assert got["text"] == expected["choices"][0]["message"]["content"]  # served by the policy, not the site
    if client == "httpx-h2":
        assert got["http_version"] == "HTTP/2"
    calls = wait_for(lambda: [c for c in read_calls(str(pod.store)) if content in (c["request_json"] or "")],
                     what=f"the record of {client}'s call")  # fmt: skip
    (call,) = calls
    assert call["status"] == "ok" and call["api"] == "chat" and call["model_requested"] == "gpt-4o"
    assert call["host"] == MODEL_HOST  # the host the client called, not the policy server it was routed to
    assert call["prompt_token_ids"] == expected["prompt_token_ids"]
    assert call["completion_token_ids"] == expected["choices"][0]["token_ids"]
    assert len(call["completion_logprobs"]) == len(call["completion_token_ids"])
    assert API_KEY not in json.dumps(call, default=str)

    # The non-model site answered itself (its own certificate, through the passthrough), and nothing recorded it.
    assert got["other"] == {"site": OTHER_HOST, "method": "GET", "path": other_path}
    assert f"GET {other_path}" in pod.site_log(OTHER_HOST)
    assert not [c for c in read_calls(str(pod.store)) if c["host"] == OTHER_HOST]
    # The model host's real address was never asked for a model call (a pod without internet is served too).
    assert not [line for line in pod.site_log(MODEL_HOST) if "/chat/completions" in line]


@pytest.mark.parametrize("family", ["-4", "-6"])
def test_passthrough_keeps_the_sites_own_certificate_and_model_hosts_get_ours(pod, family):
    internet_ca, forge_ca = str(pod.net.internet_ca), str(pod.ca_dir / "mitmproxy-ca-cert.pem")
    url = f"https://{OTHER_HOST}/cert-check"
    ok = pod.client(["curl", "-sS", family, "--cacert", internet_ca, url], check=False)
    assert ok.returncode == 0, ok.stderr  # only the site's own CA is trusted: the real certificate came through
    refused = pod.client(["curl", "-sS", family, "--cacert", forge_ca, url], check=False)
    assert refused.returncode == 60, refused.stderr  # never re-signed by the sidecar
    models = pod.client(["curl", "-sS", family, "--cacert", forge_ca, f"https://{MODEL_HOST}/v1/models"], check=False)
    assert models.returncode == 0, models.stderr  # the model host is opened, with a certificate from our CA


def test_the_sidecars_own_connections_are_not_looped_back(pod):
    # The sidecar's uid reaches port 443 directly: the site answers, with its own certificate.
    done = pod.net.pod.run(["curl", "-sS", "--cacert", str(pod.net.internet_ca), f"https://{OTHER_HOST}/as-proxy"],
                           uid=PROXY_UID, env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert json.loads(done.stdout)["site"] == OTHER_HOST
    # A non-model path on a model host is opened, then sent on by the sidecar (uid 1337) to the real site,
    # whose certificate it verifies with --upstream-ca; that connection was not redirected back to itself.
    # (/v1/models is not such a path: the policy serves the model list.)
    got = json.loads(pod.client(["curl", "-sS", "--fail-with-body", f"https://{MODEL_HOST}/v1/files"]).stdout)
    assert got == {"site": MODEL_HOST, "method": "GET", "path": "/v1/files"}
    counters = pod.net.pod.run(["iptables", "-t", "nat", "-L", "FORGE_OUTPUT", "-v", "-x", "-n"]).stdout
    owner_rule = next(line for line in counters.splitlines() if f"owner UID match {PROXY_UID}" in line)
    assert int(owner_rule.split()[0]) > 0, counters


def test_a_down_policy_server_gets_an_openai_format_error_and_a_record(pod):
    pod.relay.close()  # the policy server's address now refuses connections
    try:
        # Known down (the sidecar polls every 2 s) the guard tries the connection first and answers itself.
        wait_for(lambda: pod.metrics().get("upstream_up") == 0, what="the sidecar to see the policy server down")
        content = "The policy is down now."
        done = pod.client([
            "curl", "-sS", "-w", "\n%{http_code}", f"https://{MODEL_HOST}/v1/chat/completions",
            "-H", "content-type: application/json", "-d", json.dumps(model_body(content)),
        ])  # fmt: skip
        body, status = done.stdout.rsplit("\n", 1)
        assert status == "502"
        error = json.loads(body)["error"]
        assert set(error) >= {"message", "type", "code"} and error["type"] == "server_error"
        assert pod.relay.listen[0] not in body and "mitmproxy" not in body.lower()
        (call,) = wait_for(lambda: [c for c in read_calls(str(pod.store)) if content in (c["request_json"] or "")],
                           what="the failed call's record")  # fmt: skip
        assert (call["status"], call["http_status"]) == ("upstream_error", 502)
        assert "unreachable" in call["error"]
    finally:
        pod.relay.open()
    wait_for(lambda: pod.metrics().get("upstream_up") == 1, what="the policy server back")
    assert curl_model_call(pod, "Back again?", "-4")["text"] is not None  # served again once it is back


def test_a_gateways_html_error_in_front_of_the_policy_reaches_the_harness_as_an_openai_error(pod):
    page = f"<html><body>upstream connect error to {pod.relay.listen[0]}</body></html>".encode()
    pod.relay.answer = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/html\r\nconnection: close\r\n"
                        b"content-length: %d\r\n\r\n" % len(page)) + page  # fmt: skip
    try:
        content = "Behind a gateway that is failing."
        done = pod.client(["curl", "-sS", "-w", "\n%{http_code}", f"https://{MODEL_HOST}/v1/chat/completions",
                           "-H", "content-type: application/json", "-d", json.dumps(model_body(content))])  # fmt: skip
    finally:
        pod.relay.answer = None
    body, status = done.stdout.rsplit("\n", 1)
    assert status == "503" and json.loads(body)["error"]["type"] == "server_error"
    assert pod.relay.listen[0] not in body and "<html>" not in body
    (call,) = wait_for(lambda: [c for c in read_calls(str(pod.store)) if content in (c["request_json"] or "")],
                       what="the failed call's record")  # fmt: skip
    assert (call["status"], call["http_status"]) == ("upstream_error", 503)


def test_with_the_sidecar_down_model_calls_fail_closed(pod):
    pod.stop_sidecar()
    try:
        before = len(pod.site_log(MODEL_HOST))
        for family in ("-4", "-6"):
            refused = pod.client(["curl", "-sS", family, "--connect-timeout", "5", "-d", "{}",
                                  f"https://{MODEL_HOST}/v1/chat/completions"], check=False)  # fmt: skip
            assert refused.returncode == 7, refused.stderr  # connection refused: nothing listens on the redirect
        assert len(pod.site_log(MODEL_HOST)) == before  # no bypass to the real host
    finally:
        pod.start_sidecar()
