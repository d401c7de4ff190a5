"""TLS certificates of a public gRPC port, re-read when their files change (no restart for a rotation).

cert-manager, a Kubernetes Secret volume or an operator's ``cp`` replaces ``--tls-cert`` / ``--tls-key`` (and
``--tls-client-ca``) in place. ``ReloadingServerCredentials.credentials()`` is gRPC's
``dynamic_ssl_server_credentials``: gRPC calls ``fetch`` before every new connection's handshake, and ``fetch``
stats the files at most once per ``min_interval_s`` (1 s); when one changed (mtime, size, inode: a Secret volume
swaps a symlink, which changes the inode) it reads them again, checks them as ``shared.tls.server_credentials``
does, and hands gRPC the new configuration; new handshakes use it, open connections keep theirs.

A half-written rotation (the key replaced before its certificate, a truncated file) fails that check: the port
keeps serving the previous certificate, logs a warning once per change, and looks again at the next check, so
the pair is picked up once both files are in place. Whether clients must present a certificate
(``--tls-client-ca`` set or not) is fixed at start; only the CA bundle itself is reloaded.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import grpc

from shared.tls import check_server_files

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 1.0  # at most one stat of the files per second, however many handshakes


class ReloadingServerCredentials:
    """Server TLS credentials whose certificate, key and client CA are re-read when their files change.

    Args:
        tls_cert / tls_key: PEM certificate chain and private key paths.
        tls_client_ca: PEM CA bundle clients' certificates must chain to (mutual TLS); empty: no client
            certificate asked for.
        min_interval_s: the least time between two looks at the files (seconds).
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: at construction, a file cannot be read, is not PEM, or the key does not match the certificate
            (``shared.tls.check_server_files``).
    """

    def __init__(
        self,
        tls_cert: str,
        tls_key: str,
        tls_client_ca: str = "",
        min_interval_s: float = MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.paths = tuple(p for p in (tls_cert, tls_key, tls_client_ca) if p)
        self.tls_cert, self.tls_key, self.tls_client_ca = tls_cert, tls_key, tls_client_ca
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._loaded = self._stamp()
        self._initial = self._configuration()
        self._checked = clock()
        self._warned: tuple | None = ()  # the stamp last warned about (one warning per change; None: a file missing)
        self.reloads = 0

    def _stamp(self) -> tuple:
        """(mtime_ns, size, inode) of each file, following symlinks. Raises OSError."""
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in map(os.stat, self.paths))

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = check_server_files(self.tls_cert, self.tls_key, self.tls_client_ca)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake callback: the new configuration when the files changed since the last load, else
        None (keep the current one). Never raises: a failure is logged and the current certificate stays."""
        with self._lock:
            now = self._clock()
            if now - self._checked < self.min_interval_s:
                return None
            self._checked = now
            try:
                stamp = self._stamp()
            except OSError as exc:  # a file missing mid-rotation
                self._warn_once(None, exc)
                return None
            if stamp == self._loaded:
                return None
            try:
                configuration = self._configuration()
            except ValueError as exc:  # half-written: a key of another certificate, a truncated file
                self._warn_once(stamp, exc)
                return None
            self._loaded, self._warned = stamp, ()
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", ", ".join(self.paths))
            return configuration

    def _warn_once(self, stamp: tuple | None, exc: Exception) -> None:
        if stamp != self._warned:
            self._warned = stamp
            log.warning("TLS files changed but cannot be used yet; still serving the previous certificate: %s", exc)

    def credentials(self) -> grpc.ServerCredentials:
        """``grpc.dynamic_ssl_server_credentials`` that start with the files' present contents and call ``fetch``."""
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=bool(self.tls_client_ca)
        )
