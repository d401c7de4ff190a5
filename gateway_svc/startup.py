"""``encdec serve-http``: serves ``gateway_svc.app.create_app(config)`` on uvicorn until SIGINT / SIGTERM."""

from __future__ import annotations

import errno
import logging
import socket

import uvicorn

from gateway_svc.app import create_app
from gateway_svc.config import GatewayConfig
from shared.errors import BindError

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


def run(config: GatewayConfig, log_level: str = "info") -> None:
    """Serves the gateway on ``config.host:config.port`` (blocks until SIGINT / SIGTERM).

    Raises:
        BindError: the port cannot be bound.
    """
    sock = bind(config.host, config.port)
    log.info(
        "HTTP gateway on %s:%d: decoders %s, embed %s, API key %s",
        config.host,
        sock.getsockname()[1],
        ",".join(config.decoder_targets) or "-",
        ",".join(config.embed_targets) or "-",
        "required" if config.api_key else "off",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            log_level=log_level.lower(),
            access_log=False,  # /metrics counts every request; a line per embedding call would flood the log
            timeout_graceful_shutdown=10,
        )
    )
    server.run(sockets=[sock])
