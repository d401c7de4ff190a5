"""What a public gRPC port enforces, from a service's config: bearer token, TLS, per-client limit.

``shared.grpc_server.serve`` calls ``public_port_security`` for a public port (an internal one, the encoder's
Encode, gets none of it) and logs ``security_summary`` in its start-up line.
"""

from __future__ import annotations

import grpc

from shared.client_limits import ClientLimitInterceptor
from shared.config.base import ServiceConfig
from shared.public_auth import BearerTokenInterceptor, load_bearer_token
from shared.tls_reload import ReloadingServerCredentials


def public_port_security(
    config: ServiceConfig | None,
) -> tuple[list[grpc.aio.ServerInterceptor], grpc.ServerCredentials | None]:
    """The interceptors (bearer token, then per-client limit) and TLS credentials ``config`` asks for on a public
    port; ``([], None)`` for None.

    Raises:
        ValueError: the token or a TLS file cannot be read or used (``shared.public_auth``, ``shared.tls``).
    """
    if config is None:
        return [], None
    interceptors: list[grpc.aio.ServerInterceptor] = []
    token = load_bearer_token(config.auth_token_file, config.auth_token)
    if token is not None:
        interceptors.append(BearerTokenInterceptor(token))
    if config.max_requests_per_client > 0:
        interceptors.append(ClientLimitInterceptor(config.max_requests_per_client))
    return interceptors, port_credentials(config)


def port_credentials(config: ServiceConfig | None) -> grpc.ServerCredentials | None:
    """TLS of a port, public or internal (the encoder's Encode), when ``config`` names a certificate
    (``tls_cert`` / ``tls_key``, mutual TLS with ``tls_client_ca``), re-read when the files change (a cert-manager
    rotation: ``shared.tls_reload``); None: plaintext.

    Raises:
        ValueError: a TLS file cannot be read or used.
    """
    if config is None or not config.tls_cert:
        return None
    return ReloadingServerCredentials(config.tls_cert, config.tls_key, config.tls_client_ca).credentials()


def security_summary(config: ServiceConfig | None, public: bool, tls: bool, interceptors: list) -> str:
    """`` (TLS, bearer token, ...)`` for the start-up log line; never the token."""
    if config is None:
        return ""
    if not public:
        return " (internal port" + (", mutual TLS" if config.tls_client_ca else ", TLS" if tls else "") + ")"
    parts = ["mutual TLS" if config.tls_client_ca else "TLS" if tls else "plaintext"]
    has_token = any(isinstance(i, BearerTokenInterceptor) for i in interceptors)
    parts.append("bearer token required" if has_token else "no bearer token")
    if config.max_requests_per_client > 0:
        parts.append(f"at most {config.max_requests_per_client} calls in flight per client")
    return f" ({', '.join(parts)})"
