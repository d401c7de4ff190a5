"""``encdec serve-http``: serves ``gateway_svc.app.create_app(config)`` on uvicorn (HTTP, or HTTPS with
``tls_cert`` / ``tls_key``) until SIGINT / SIGTERM."""

from __future__ import annotations

import errno
import logging
import socket

import uvicorn

from gateway_svc.app import create_app
from gateway_svc.backends import backend_security
from gateway_svc.config import GatewayConfig
from shared.errors import BindError
from shared.tls import server_credentials

log = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound before the app starts so that a taken port fails the start.

    Raises:
        BindError: the port is taken or the host is not an address of this machine (``encdec`` exits with
            ``BIND_ERROR_EXIT``, as the gRPC services do).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that name it, and accepted connections inherit
    # the listening socket's protocol. Without it every response (headers and body written apart) waits for the
    # client's delayed ACK (Nagle), tens of milliseconds per request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "the port is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise BindError(f"cannot listen on {host}:{port}: {why}") from exc
    sock.listen(2048)
    return sock


MAX_HEAD_BYTES = 64 * 1024  # request line and headers; 4x uvicorn's h11 default (an API key, cookies, a proxy's)


def run(config: GatewayConfig, log_level: str = "info") -> None:
    """Serves the gateway on ``config.host:config.port`` (blocks until SIGINT / SIGTERM).

    With ``tls_cert`` / ``tls_key`` it serves HTTPS (uvicorn's ``ssl_certfile`` / ``ssl_keyfile``); its backends
    are reached as ``backend_security`` says (bearer token, TLS).

    Raises:
        BindError: the port cannot be bound.
        ValueError: a TLS or token file cannot be read or used (the message names the setting).
    """
    config = config.with_api_key_read()  # before binding: a wrong path fails the start
    security = backend_security(config)
    if config.tls_cert:
        server_credentials(config.tls_cert, config.tls_key)  # checks the pair as the gRPC services do
    sock = bind(config.host, config.port)
    log.info(
        "HTTP gateway on %s:%d (%s): decoders %s, embed %s, API key %s; backends over %s, %s",
        config.host,
        sock.getsockname()[1],
        "HTTPS" if config.tls_cert else "HTTP",
        ",".join(config.decoder_targets) or "-",
        ",".join(config.embed_targets) or "-",
        "required" if config.api_key else "off",
        "mutual TLS" if security.tls_cert else "TLS" if security.tls else "plaintext",
        "with a bearer token" if security.token else "no bearer token",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            log_level=log_level.lower(),
            access_log=False,  # /metrics counts every request; a line per embedding call would flood the log
            timeout_graceful_shutdown=10,
            # h11, whose request head is bounded (MAX_HEAD_BYTES; a larger one is a 400 before it is parsed whole):
            # uvicorn's httptools parser takes a head of any size, and 100 MB of one header held the gateway 11 s at
            # 280 MB before its 401 (issue 34 break test).
            http="h11",
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
            # X-Forwarded-For only from the proxies named (none by default), never uvicorn's 127.0.0.1 default.
            proxy_headers=bool(config.forwarded_allow_ips),
            forwarded_allow_ips=config.forwarded_allow_ips or None,
            ssl_certfile=config.tls_cert or None,
            ssl_keyfile=config.tls_key or None,
        )
    )
    server.run(sockets=[sock])
