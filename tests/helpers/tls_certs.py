"""A throw-away certificate authority for the TLS tests, made with the ``openssl`` command line at test time.

``make_pki(dir)`` writes a CA, a server certificate for ``localhost`` / ``127.0.0.1`` and a client certificate
signed by it, and a second, unrelated CA with a client certificate of its own (one a mutual-TLS server must
refuse). EC P-256 keys: made in milliseconds.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files ``make_pki`` wrote."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_client_cert: str
    other_client_key: str


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def _run(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _key(path: Path) -> None:
    _run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))


def _ca(root: Path, name: str) -> tuple[Path, Path]:
    key, cert = root / f"{name}.key", root / f"{name}.pem"
    _key(key)
    _run(
        "req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return key, cert


def _leaf(root: Path, name: str, ca_key: Path, ca_cert: Path, usage: str, san: str) -> tuple[Path, Path]:
    key, csr, cert, ext = root / f"{name}.key", root / f"{name}.csr", root / f"{name}.pem", root / f"{name}.ext"
    _key(key)
    _run("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    ext.write_text(
        f"basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
        f"subjectAltName={san}\n"
    )
    _run(
        "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "2", "-extfile", str(ext),
    )  # fmt: skip
    return cert, key


def make_pki(root: Path) -> Pki:
    """Writes the certificates into ``root`` (created) and returns their paths.

    Raises:
        subprocess.CalledProcessError: ``openssl`` failed.
    """
    root.mkdir(parents=True, exist_ok=True)
    ca_key, ca = _ca(root, "encdec-test-ca")
    server_cert, server_key = _leaf(root, "server", ca_key, ca, "serverAuth", "DNS:localhost,IP:127.0.0.1")
    client_cert, client_key = _leaf(root, "client", ca_key, ca, "clientAuth", "DNS:encdec-test-client")
    other_key, other = _ca(root, "other-ca")
    other_cert, other_client_key = _leaf(root, "other-client", other_key, other, "clientAuth", "DNS:intruder")
    return Pki(
        str(ca),
        str(server_cert),
        str(server_key),
        str(client_cert),
        str(client_key),
        str(other),
        str(other_cert),
        str(other_client_key),
    )
