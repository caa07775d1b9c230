"""`forge ca init`: the CA the sidecar signs intercepted model hosts with, and the bundle the harness trusts.

The CA lives where mitmproxy looks for it, ``<dir>/mitmproxy-ca.pem`` (key and certificate, mode 0600), so the
folder is the sidecar's ``confdir``. A given CA (a Kubernetes Secret's ``tls.crt``/``tls.key``) is copied in
instead of a new one. ``<dir>/ca-bundle.pem`` is the system CAs plus ours: point the harness's runtimes at it
(``TRUST_ENV`` below); Node adds ``NODE_EXTRA_CA_CERTS`` to its own roots, so that one gets our certificate only.
"""

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from forge.errors import ForgeError

SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
CA_FILE = "mitmproxy-ca.pem"  # mitmproxy's name: key + certificate
CERT_FILE = "mitmproxy-ca-cert.pem"
BUNDLE_FILE = "ca-bundle.pem"
CA_NAME = "OpenForge sidecar CA"
CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False, key_encipherment=False,
    data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False,
)  # fmt: skip


@dataclass(frozen=True)
class CaFiles:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / CA_FILE

    @property
    def cert(self) -> Path:
        return self.dir / CERT_FILE

    @property
    def bundle(self) -> Path:
        return self.dir / BUNDLE_FILE

    def trust_env(self) -> dict[str, str]:
        """The environment that makes each runtime of the harness trust the sidecar's certificates."""
        bundle = str(self.bundle)
        return {
            "SSL_CERT_FILE": bundle,  # OpenSSL-based: curl, httpx, Python's ssl, Codex
            "REQUESTS_CA_BUNDLE": bundle,  # Python requests (certifi otherwise)
            "CURL_CA_BUNDLE": bundle,
            "NODE_EXTRA_CA_CERTS": str(self.cert),  # Node: added to its built-in roots
            "CODEX_CA_CERTIFICATE": bundle,
        }


def new_ca(common_name: str = CA_NAME, days: int = 3650) -> tuple[bytes, bytes]:
    """A fresh self-signed CA: (key PEM, certificate PEM)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)  # what mitmproxy itself makes
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "OpenForge")])  # fmt: skip
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def checked_pair(key_pem: bytes, cert_pem: bytes) -> None:
    """A given CA must be a CA certificate whose public key is the given key's."""
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as error:
        raise ForgeError(f"the given CA key or certificate is not PEM ({error})") from None
    if not isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
        raise ForgeError("the given CA key must be RSA or EC")
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, public) != cert.public_key().public_bytes(
        serialization.Encoding.PEM, public
    ):
        raise ForgeError("the given CA certificate does not belong to the given key")
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise ForgeError("the given certificate is not a CA (basicConstraints CA:TRUE is missing)")


def init_ca(
    directory: Path, cert: Path | None = None, key: Path | None = None, system_bundle: Path = SYSTEM_BUNDLE,
    force: bool = False, owner: int | None = None,
) -> CaFiles:  # fmt: skip
    """Make (or take) the CA in ``directory`` and write the bundle; an existing CA is kept unless ``force``."""
    files = CaFiles(directory)
    if (cert is None) != (key is None):
        raise ForgeError("give both --cert and --key (a Kubernetes TLS Secret's tls.crt and tls.key), or neither")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if cert is not None and key is not None:
            key_pem, cert_pem = key.read_bytes(), cert.read_bytes()
            checked_pair(key_pem, cert_pem)
        elif files.ca.exists() and not force:
            key_pem = cert_pem = b""
        else:
            key_pem, cert_pem = new_ca()
        if key_pem:
            _write(files.ca, key_pem + cert_pem, 0o600)
            _write(files.cert, cert_pem, 0o644)
        elif not files.cert.exists():
            raise ForgeError(f"{files.ca} exists but {files.cert} does not: run with --force to make a new CA")
        system = system_bundle.read_bytes() if system_bundle.exists() else b""
        ours = files.cert.read_bytes()
        _write(files.bundle, system.rstrip(b"\n") + b"\n" + ours if system else ours, 0o644)
        if owner is not None:
            for path in (directory, files.ca, files.cert, files.bundle):
                os.chown(path, owner, -1)
    except OSError as error:
        raise ForgeError(f"cannot write the CA in {directory}: {error}") from error
    return files


def _write(path: Path, data: bytes, mode: int) -> None:
    """Written under a temporary name and renamed: a sidecar starting now never reads half a key."""
    partial = path.with_name(f".{path.name}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(partial, mode)
    os.replace(partial, path)
