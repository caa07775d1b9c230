"""Network namespaces for the transparent-mode tests: a pod, an "internet", TLS sites with their own CA, a relay.

Everything here is made by the test and removed at teardown (namespaces, veth pairs, /etc/netns/<pod>, temp
folders), even when a test fails. Traffic stays inside the test's namespaces and one veth pair to the root
namespace, over which a TCP relay reaches the vLLM server on the root namespace's loopback.
"""

import datetime
import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.support.sockets import relay

HERE = Path(__file__).resolve().parent
PROXY_UID = 1337
CLIENT_UID = 4242


def root_cause() -> str | None:
    """Why namespace tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables): CI runs as root"
    for tool in ("ip", "iptables", "ip6tables", "setpriv", "curl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (.ci/run installs iptables)"
    return None


def closed_to_others(path: Path) -> Path | None:
    """The first folder on the way to ``path`` that another uid cannot enter (None: all can)."""
    for folder in [*reversed(path.resolve().parents), path.resolve()]:
        if folder.is_dir() and not folder.stat().st_mode & 0o001:
            return folder
    return None


def sh(args: Sequence[str], check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def free_subnet() -> int:
    """A second octet for 10.N.x.x / fd55:N:: that no interface of the root namespace uses."""
    used = sh(["ip", "-o", "addr"]).stdout
    for _ in range(50):
        n = random.randint(100, 250)
        if f"10.{n}." not in used and f"fd55:{n:x}:" not in used:
            return n
    raise AssertionError("no free 10.N.0.0/16 subnet for the test's namespaces")


@dataclass
class Namespace:
    name: str

    def command(self, args: Sequence[str], uid: int | None = None) -> list[str]:
        prefix = ["ip", "netns", "exec", self.name]
        if uid is not None:
            prefix += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        return prefix + list(args)

    def run(self, args: Sequence[str], uid: int | None = None, check: bool = True, timeout: float = 60,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
        return sh(self.command(args, uid), check=check, timeout=timeout, env=env)

    def popen(self, args: Sequence[str], log: Path, uid: int | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen:  # fmt: skip
        with log.open("ab") as out:
            return subprocess.Popen(self.command(args, uid), stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip


def stop(process: subprocess.Popen, timeout: float = 20) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# -- certificates ---------------------------------------------------------------------------------------------
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return key, cert


def issue(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, host: str) -> tuple[bytes, bytes]:
    """A server certificate for ``host`` signed by the test's own "internet" CA: (key PEM, cert PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(_name(host)).issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


# -- a TCP relay from the test's veth address to the root namespace's loopback --------------------------------
class Relay:
    """Forwards ``listen`` to ``target`` byte for byte; ``close()`` makes the listen address refuse connections."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen, self.target = listen, target
        self.server: socket.socket | None = None
        self.answer: bytes | None = None  # set: answer every request with these bytes, as a gateway would

    def open(self) -> "Relay":
        server = socket.create_server(self.listen, reuse_port=False)
        server.settimeout(0.2)
        self.server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    def _accept(self, server: socket.socket) -> None:
        while self.server is server:
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.answer is not None:
                threading.Thread(target=self._answer, args=(client, self.answer), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            relay(client, upstream)

    @staticmethod
    def _answer(client: socket.socket, answer: bytes) -> None:
        client.settimeout(10)
        with client:
            data = b""
            while b"\r\n\r\n" not in data and (chunk := client.recv(65536)):
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)  # fmt: skip
            while len(body) < length and (chunk := client.recv(65536)):
                body += chunk
            client.sendall(answer)


# -- the topology ---------------------------------------------------------------------------------------------
@dataclass
class Site:
    host: str
    v4: str
    v6: str
    log: Path


@dataclass
class PodNetwork:
    """pod (client + sidecar) ─veth─ internet (TLS sites); pod ─veth─ root (relay to vLLM on 127.0.0.1)."""

    pod: Namespace
    internet: Namespace
    root_address: str  # the root namespace's end of the pod's second veth: the relay listens here
    work: Path  # readable by every uid; subfolders owned by whoever must write them
    internet_ca: Path
    sites: dict[str, Site]
    links: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def hosts_dir(self) -> Path:
        return Path("/etc/netns") / self.pod.name

    def teardown(self) -> None:
        for process in self.processes:
            stop(process)
        for ns in (self.pod, self.internet):
            sh(["ip", "netns", "del", ns.name], check=False)
        for link in self.links:
            sh(["ip", "link", "del", link], check=False)
        shutil.rmtree(self.hosts_dir(), ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)


def build_pod_network(site_hosts: Sequence[str]) -> PodNetwork:
    """Make the namespaces, addresses, routes, hosts file and the internet's TLS sites (started, answering)."""
    tag = f"{os.getpid() % 10000:04d}{random.randint(0, 0xFFF):03x}"
    n = free_subnet()
    work = Path(tempfile.mkdtemp(prefix="forge-transparent-"))
    work.chmod(0o755)
    net = PodNetwork(
        pod=Namespace(f"forge-pod-{tag}"), internet=Namespace(f"forge-net-{tag}"), root_address=f"10.{n}.2.1",
        work=work, internet_ca=work / "internet-ca.pem", sites={},
    )  # fmt: skip
    try:
        _wire(net, tag, n)
        ca_key, ca = make_ca("Test internet CA")
        net.internet_ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        hosts = ["127.0.0.1 localhost", "::1 localhost"]
        for i, host in enumerate(site_hosts):
            site = Site(host, f"10.{n}.1.{10 + i}", f"fd55:{n:x}:1::{10 + i:x}", work / f"site-{host}.log")
            net.internet.run(["ip", "addr", "add", f"{site.v4}/32", "dev", "lo"])
            net.internet.run(["ip", "-6", "addr", "add", f"{site.v6}/128", "dev", "lo", "nodad"])
            key_pem, cert_pem = issue(ca_key, ca, host)
            (work / f"{host}.key").write_bytes(key_pem)
            (work / f"{host}.pem").write_bytes(cert_pem)
            net.processes.append(net.internet.popen(
                [sys.executable, str(HERE / "tls_site.py"), host, str(work / f"{host}.pem"), str(work / f"{host}.key"),
                 str(site.log), site.v4, site.v6], work / f"site-{host}.out",
            ))  # fmt: skip
            hosts += [f"{site.v4} {host}", f"{site.v6} {host}"]
            net.sites[host] = site
        net.hosts_dir().mkdir(parents=True, exist_ok=True)
        (net.hosts_dir() / "hosts").write_text("\n".join(hosts) + "\n")
        for site in net.sites.values():
            wait_listening(net.internet, site.v4, 443)
        return net
    except BaseException:
        net.teardown()
        raise


def _wire(net: PodNetwork, tag: str, n: int) -> None:
    pod, internet = net.pod, net.internet
    for ns in (pod, internet):
        sh(["ip", "netns", "add", ns.name])
        ns.run(["ip", "link", "set", "lo", "up"])
    # pod <-> internet: the pod's default routes (a pod needs a route covering the model host's address)
    sh(["ip", "link", "add", f"fp{tag}", "netns", pod.name, "type", "veth", "peer", "name", f"fi{tag}",
        "netns", internet.name])  # fmt: skip
    for ns, dev, host in ((pod, f"fp{tag}", 2), (internet, f"fi{tag}", 1)):
        ns.run(["ip", "addr", "add", f"10.{n}.0.{host}/24", "dev", dev])
        ns.run(["ip", "-6", "addr", "add", f"fd55:{n:x}::{host}/64", "dev", dev, "nodad"])
        ns.run(["ip", "link", "set", dev, "up"])
    pod.run(["ip", "route", "add", "default", "via", f"10.{n}.0.1"])
    pod.run(["ip", "-6", "route", "add", "default", "via", f"fd55:{n:x}::1"])
    # pod <-> root: only the relay to vLLM lives at the root end
    sh(["ip", "link", "add", f"fr{tag}", "type", "veth", "peer", "name", f"fq{tag}", "netns", pod.name])
    net.links.append(f"fr{tag}")
    sh(["ip", "addr", "add", f"{net.root_address}/24", "dev", f"fr{tag}"])
    sh(["ip", "link", "set", f"fr{tag}", "up"])
    pod.run(["ip", "addr", "add", f"10.{n}.2.2/24", "dev", f"fq{tag}"])
    pod.run(["ip", "link", "set", f"fq{tag}", "up"])


def wait_listening(ns: Namespace, host: str, port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    while time.monotonic() < deadline:
        if ns.run(["/usr/bin/python3", "-c", probe], check=False).returncode == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {host}:{port} in {ns.name} after {timeout} s")


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


# What of the `forge` package the sidecar image holds beside `sidecar/` (k8s/images/sidecar.Dockerfile).
IMAGE_FORGE_FILES = ("__init__.py", "errors.py", "paths.py")


def readable_code(root: Path, work: Path, extra: Sequence[Path] = ()) -> Path:
    """The checkout itself when every uid can enter it; else, in ``work``/code, a copy of what the other uids run:
    the sidecar image's code (``sidecar/`` and the `forge` modules it imports) and ``extra`` files (relative to the
    checkout). CI may clone into a folder only root can enter."""
    if closed_to_others(root / "sidecar") is None:
        return root
    code = work / "code"
    shutil.copytree(root / "sidecar", code / "sidecar", ignore=shutil.ignore_patterns("__pycache__"))
    (code / "forge").mkdir(parents=True, exist_ok=True)
    for name in IMAGE_FORGE_FILES:
        shutil.copy(root / "forge" / name, code / "forge" / name)
    for relative in extra:
        (code / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / relative, code / relative)
    for path in [code, *code.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return code
