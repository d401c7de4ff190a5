"""``GatewayConfig``: the settings of ``encdec serve-http`` (CLI flags and ``ENCDEC_*`` variables, as the services')."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shared.public_auth import read_token_file

# OpenAI's documented upload limit for /v1/audio/* (25 MB).
DEFAULT_MAX_UPLOAD_MB = 25.0
# JSON bodies: OpenAI's embedding limits (2048 inputs, 300k tokens in all) fit in about 2 MB (TEI's --payload-limit);
# parsing costs tens of times the body's size in Python objects, so the bound is also the gateway's memory bound.
DEFAULT_MAX_REQUEST_MB = 8.0
# OpenAI's documented limit of inputs in one /v1/embeddings request.
DEFAULT_MAX_EMBEDDING_INPUTS = 2048
# Calls in flight per client (several clients share a backend through the gateway's one address) and in all (TEI's
# --max-concurrent-requests default; the backends' per-address --max-requests-per-client is as large, so the
# gateway's own cap refuses first).
DEFAULT_MAX_REQUESTS_PER_CLIENT = 64
DEFAULT_MAX_CONCURRENT_REQUESTS = 512
# Audio bytes the gateway holds at once (uploads spool to /tmp for their call): half the 1 GiB /tmp that compose
# and the Kubernetes manifests give it, so uploads cannot fill it (40 of 25 MB would).
DEFAULT_MAX_UPLOADS_IN_FLIGHT_MB = 512.0


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """Settings of the HTTP gateway.

    Attributes:
        host: address to listen on.
        port: HTTP port (OpenAI-compatible API, ``/health``, ``/metrics``).
        decoder_address: the decoder services, comma-separated gRPC targets (``host:port``, or
            ``dns:///name:port`` of a headless service whose addresses are all replicas). Targets serving the
            same model are balanced with gRPC's ``round_robin`` policy; each model is routed to its own.
        embed_address: the embed services (encoder services of encoder-only models), as ``decoder_address``.
        api_key: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (401
            otherwise). Prefer ``ENCDEC_API_KEY`` or ``api_key_file`` to the flag (a flag shows in ``ps``).
        api_key_file: a file holding ``api_key`` (read at start-up, ``with_api_key_read``; whitespace stripped):
            compose's generated key.
        max_upload_mb: largest request body of ``/v1/audio/*`` in MB (10^6 bytes); larger is 413, refused
            before the body is read whole.
        max_uploads_in_flight_mb: most audio upload bytes the gateway holds at once, in MB (each call's declared
            ``Content-Length``, or ``max_upload_mb`` without one, from its start to its end: an upload spools to
            /tmp for its call); past it 503 (retry later). 0 = no limit.
        max_request_mb: largest JSON request body in MB (10^6 bytes); larger is 413, refused before it is read
            whole (TEI's ``--payload-limit``).
        max_embedding_inputs: most ``input`` items of one ``/v1/embeddings`` request (400 beyond).
        max_requests_per_client: most calls in flight per client: its API key when ``api_key`` is set (and sent),
            else its address; more get 429 (``gateway_svc.limits``). 0 = no limit.
        max_concurrent_requests: most calls in flight in the gateway, every client together; more get 503.
            ``/health`` and ``/metrics`` are outside both limits. 0 = no limit.
        forwarded_allow_ips: the proxies (comma-separated IPs or networks, uvicorn's ``forwarded_allow_ips``)
            whose ``X-Forwarded-For`` names the client; empty: none, every client is its peer address. Any other
            default lets a caller pick its own address and step around ``max_requests_per_client`` (uvicorn trusts
            127.0.0.1 by default, so a local caller could: issue 34 break test).
        request_timeout_s: the gRPC deadline of each backend call (seconds).
        model_aliases: more names for served models, ``alias=model`` comma-separated
            (``whisper-1=whisper-tiny.en,text-embedding-3-small=all-MiniLM-L6-v2``), so that code written for
            OpenAI's model names runs unchanged (vLLM's ``--served-model-name``). Listed by ``/v1/models``.
        tls_cert / tls_key: PEM certificate chain and private key: the gateway serves HTTPS (both or neither).
        backend_token: the bearer token the backends require (their ``--auth-token-file``), sent with every gRPC
            call; prefer ``ENCDEC_BACKEND_TOKEN`` or ``backend_token_file`` (a flag shows in ``ps``).
        backend_token_file: a file holding ``backend_token`` (read at start-up, whitespace stripped).
        backend_tls_ca: PEM CA bundle that signed the backends' certificates: the gateway reaches them over TLS.
        backend_tls_cert / backend_tls_key: PEM client certificate and key for backends with mutual TLS.
        backend_tls_server_name: the name the backends' certificates carry when it is not the target's host
            (several ``host:port`` targets are dialled by IP).

    Raises:
        ValueError: no backend address, a limit out of range, a lone half of a certificate / key pair, or both
            ``backend_token`` and ``backend_token_file`` (or ``api_key`` and ``api_key_file``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    decoder_address: str = ""
    embed_address: str = ""
    api_key: str = ""
    api_key_file: str = ""
    max_upload_mb: float = DEFAULT_MAX_UPLOAD_MB
    max_uploads_in_flight_mb: float = DEFAULT_MAX_UPLOADS_IN_FLIGHT_MB
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB
    max_embedding_inputs: int = DEFAULT_MAX_EMBEDDING_INPUTS
    max_requests_per_client: int = DEFAULT_MAX_REQUESTS_PER_CLIENT
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    forwarded_allow_ips: str = ""
    request_timeout_s: float = 600.0
    model_aliases: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    backend_token: str = ""
    backend_token_file: str = ""
    backend_tls_ca: str = ""
    backend_tls_cert: str = ""
    backend_tls_key: str = ""
    backend_tls_server_name: str = ""

    def __post_init__(self) -> None:
        if not self.decoder_targets and not self.embed_targets:
            raise ValueError(
                "the gateway needs at least one backend: --decoder-address and/or --embed-address "
                "(ENCDEC_DECODER_ADDRESS / ENCDEC_EMBED_ADDRESS)"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_upload_mb <= 0:
            raise ValueError(f"max_upload_mb must be > 0, got {self.max_upload_mb:g}")
        if not self.max_uploads_in_flight_mb >= 0:  # also refuses NaN
            raise ValueError(
                f"max_uploads_in_flight_mb must be >= 0 (0 = no limit), got {self.max_uploads_in_flight_mb}"
            )
        if self.max_request_mb <= 0:
            raise ValueError(f"max_request_mb must be > 0, got {self.max_request_mb:g}")
        if self.max_embedding_inputs < 1:
            raise ValueError(f"max_embedding_inputs must be >= 1, got {self.max_embedding_inputs}")
        if self.max_requests_per_client < 0:
            raise ValueError(f"max_requests_per_client must be >= 0 (0 = no limit), got {self.max_requests_per_client}")
        if self.max_concurrent_requests < 0:
            raise ValueError(f"max_concurrent_requests must be >= 0 (0 = no limit), got {self.max_concurrent_requests}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s:g}")
        self.aliases  # noqa: B018 - parses model_aliases: a malformed entry fails the start
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both (PEM files) or neither")
        if bool(self.backend_tls_cert) != bool(self.backend_tls_key):
            raise ValueError("backend_tls_cert and backend_tls_key go together: set both (PEM files) or neither")
        if self.backend_token and self.backend_token_file:
            raise ValueError("backend_token and backend_token_file are both set: keep one")
        if self.api_key and self.api_key_file:
            raise ValueError("api_key and api_key_file are both set: keep one")
        if self.backend_tls_server_name and not (self.backend_tls_ca or self.backend_tls_cert):
            raise ValueError("backend_tls_server_name is for TLS backends: set backend_tls_ca too")

    def with_api_key_read(self) -> GatewayConfig:
        """This config with ``api_key_file``'s key as ``api_key`` (itself when there is no file).

        Raises:
            ValueError: the file cannot be read or is empty.
        """
        if not self.api_key_file:
            return self
        key = read_token_file(self.api_key_file, "api_key_file")
        if not key:
            raise ValueError(f"api_key_file {self.api_key_file!r} is empty; write the key in it")
        return dataclasses.replace(self, api_key=key, api_key_file="")

    @property
    def aliases(self) -> dict[str, str]:
        """``{alias: served model name}`` from ``model_aliases``.

        Raises:
            ValueError: an entry is not ``alias=model``.
        """
        out = {}
        for entry in _targets(self.model_aliases):
            alias, sep, model = (part.strip() for part in entry.partition("="))
            if not sep or not alias or not model:
                raise ValueError(f"model_aliases: {entry!r} is not alias=model")
            out[alias] = model
        return out

    @property
    def decoder_targets(self) -> list[str]:
        return _targets(self.decoder_address)

    @property
    def embed_targets(self) -> list[str]:
        return _targets(self.embed_address)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1_000_000)

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 1_000_000)


def _targets(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]
