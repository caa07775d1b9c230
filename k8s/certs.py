"""`forge inject certs`: the files the kustomize base turns into Secrets and ConfigMaps (k8s/certs/, not committed).

- `webhook/`: a CA (`ca.crt`) and the webhook's serving certificate (`tls.crt`, `tls.key`) for the Service's DNS
  names. The API server verifies the webhook with the CA: kustomize copies the Secret's `ca.crt` into the
  MutatingWebhookConfiguration's `caBundle` (a `replacements` entry in k8s/kustomization.yaml). A cluster with
  cert-manager can use its CA injector instead (docs/kubernetes.md).
- `sidecar-ca/`: the CA the sidecars sign model hosts with (`tls.crt`, `tls.key`) and what the apps trust
  (`ca-bundle.pem`, `mitmproxy-ca-cert.pem`), made by `forge ca init` (sidecar/ca.py).
No reward credential: a pod's verifier posts rewards on the sidecar's reward socket (k8s/inject.py).
Existing files are kept (running pods already trust the CAs) unless `force`.
"""

import datetime
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from forge.errors import ForgeError
from sidecar import ca

SERVICE = "openforge-injector"
NAMESPACE = "openforge-system"


def service_names(service: str, namespace: str) -> list[str]:
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def serving_certificate(names: list[str], days: int = 825) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, serving certificate, serving key) PEMs: a fresh CA that signs one certificate for `names`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "OpenForge injector CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(ca.CA_KEY_USAGE, critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    return ca_cert.public_bytes(pem), cert.public_bytes(pem), _pem_key(key)


@dataclass(frozen=True)
class ClusterSecrets:
    dir: Path

    @property
    def webhook(self) -> Path:
        return self.dir / "webhook"

    @property
    def sidecar_ca(self) -> Path:
        return self.dir / "sidecar-ca"


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


def write_cluster_secrets(
    out: Path, service: str = SERVICE, namespace: str = NAMESPACE, force: bool = False
) -> ClusterSecrets:
    files = ClusterSecrets(out)
    try:
        if force or not (files.webhook / "tls.crt").exists():
            ca_pem, cert_pem, key_pem = serving_certificate(service_names(service, namespace))
            _write(files.webhook / "ca.crt", ca_pem, 0o644)
            _write(files.webhook / "tls.crt", cert_pem, 0o644)
            _write(files.webhook / "tls.key", key_pem, 0o600)
        if force or not (files.sidecar_ca / "tls.crt").exists():
            with tempfile.TemporaryDirectory() as scratch:
                made = ca.init_ca(Path(scratch))
                pem = made.ca.read_bytes()  # key + certificate, in mitmproxy's one file
                cert = made.cert.read_bytes()
                _write(files.sidecar_ca / "tls.key", pem.replace(cert, b""), 0o600)
                _write(files.sidecar_ca / "tls.crt", cert, 0o644)
                _write(files.sidecar_ca / ca.CERT_FILE, cert, 0o644)
                _write(files.sidecar_ca / ca.BUNDLE_FILE, made.bundle.read_bytes(), 0o644)
    except OSError as error:
        raise ForgeError(f"cannot write the cluster secrets in {out}: {error}") from error
    return files
