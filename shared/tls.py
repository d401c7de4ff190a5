"""TLS of the public gRPC ports: the server's credentials, and the client side (``ClientSecurity``).

A service with ``--tls-cert`` / ``--tls-key`` (PEM) serves TLS on its public port; with ``--tls-client-ca`` too,
mutual TLS: a client must present a certificate that CA signed, else the handshake fails. Both files are checked
with the standard library's ``ssl`` at start-up, so a wrong path, a key that does not match the certificate or a
file that is not PEM fails the start with a message naming the setting (gRPC itself would only fail to bind).
The gRPC ports re-read the files when they change (``shared.tls_reload``): a rotated certificate needs no restart.

Clients (``encdec transcribe``, the HTTP gateway's backend channels) describe how they reach a service with
``ClientSecurity``: a CA to trust (``--tls-ca``), an optional client certificate for mutual TLS
(``--tls-cert`` / ``--tls-key``), a name to check instead of the address's host (``--tls-server-name``), and the
bearer token (``--token``, ``shared.public_auth``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from shared.public_auth import bearer_token_interceptors


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of the PEM file ``path`` (``setting`` names the option in messages).

    Raises:
        ValueError: the file cannot be read or holds no PEM block.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"{setting} {path!r} cannot be read: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise ValueError(f"{setting} {path!r} is not a PEM file (no '-----BEGIN' line)")
    return data


def check_server_files(tls_cert: str, tls_key: str, tls_client_ca: str = "") -> tuple[bytes, bytes, bytes | None]:
    """The PEM bytes of a TLS port's certificate chain, private key and client CA bundle (None without
    ``tls_client_ca``), checked with the standard library's ``ssl``.

    Raises:
        ValueError: a file cannot be read, is not PEM, or the key does not match the certificate.
    """
    cert = read_pem(tls_cert, "tls_cert")
    key = read_pem(tls_key, "tls_key")
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(tls_cert, tls_key)
    except ssl.SSLError as exc:
        raise ValueError(
            f"tls_cert {tls_cert!r} / tls_key {tls_key!r}: not a certificate chain and its matching private key "
            f"({exc.reason or exc})"
        ) from exc
    ca = None
    if tls_client_ca:
        ca = read_pem(tls_client_ca, "tls_client_ca")
        try:
            check.load_verify_locations(cafile=tls_client_ca)
        except ssl.SSLError as exc:
            raise ValueError(
                f"tls_client_ca {tls_client_ca!r} holds no usable CA certificate ({exc.reason or exc})"
            ) from exc
    return cert, key, ca


def server_credentials(tls_cert: str, tls_key: str, tls_client_ca: str = "") -> grpc.ServerCredentials:
    """Credentials of a TLS port: certificate chain ``tls_cert`` and key ``tls_key`` (PEM paths); with
    ``tls_client_ca``, clients must present a certificate signed by a CA of that bundle (mutual TLS). The files are
    read once; ``shared.tls_reload`` gives credentials that follow a rotation (the gRPC ports use those).

    Raises:
        ValueError: a file cannot be read, is not PEM, or the key does not match the certificate.
    """
    cert, key, ca = check_server_files(tls_cert, tls_key, tls_client_ca)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a public port: TLS (and mutual TLS) and the bearer token. All empty: plaintext, no token.

    Attributes:
        token: the bearer token sent with every call (``authorization: Bearer <token>``); empty: none.
        tls_ca: PEM bundle of the CA(s) that signed the server's certificate; setting it (or ``tls_cert``)
            turns TLS on.
        tls_cert / tls_key: PEM client certificate and its key, for a server that requires mutual TLS (both or
            neither); with no ``tls_ca`` the system's CAs check the server.
        tls_server_name: the name the server's certificate must carry when it is not the address's host
            (``grpc.ssl_target_name_override``); empty: the address's host.

    Raises:
        ValueError: ``tls_cert`` without ``tls_key`` (or the reverse), or ``tls_server_name`` without TLS.
    """

    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together (a client certificate and its key): set both")
        if self.tls_server_name and not self.tls:
            raise ValueError("--tls-server-name is for TLS: set --tls-ca (the server's CA) too")

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The channel's TLS credentials, or None (plaintext).

        Raises:
            ValueError: a file cannot be read or is not PEM.
        """
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.tls_ca, "--tls-ca") if self.tls_ca else None,
            private_key=read_pem(self.tls_key, "--tls-key") if self.tls_key else None,
            certificate_chain=read_pem(self.tls_cert, "--tls-cert") if self.tls_cert else None,
        )

    def channel(self, target: str, options: list[tuple] | None = None) -> grpc.aio.Channel:
        """A ``grpc.aio`` channel to ``target`` with these credentials and the token on every call.

        Raises:
            ValueError: see ``credentials``.
        """
        options = list(options or [])
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        interceptors = bearer_token_interceptors(self.token) if self.token else None
        credentials = self.credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)
