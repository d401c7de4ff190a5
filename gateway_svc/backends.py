"""The gateway's gRPC backends: which model each target serves, one balanced channel per model, health.

A target is a gRPC address (``host:port``, ``dns:///name:port``...). At start-up, and again when a request names a
model no known backend serves, each target is asked what it serves: a decoder its ``GetStats`` (``model``,
``served_model_names``, ``input_kind``), an embed service its ``Tokenize`` with no inputs (``model``). Targets
serving the same model share one channel with gRPC's ``round_robin`` load-balancing policy (several ``ip:port``
targets become one ``ipv4:`` target; host names are resolved when the channel is made); a ``dns:///`` target of a
headless service is balanced over all its addresses by the same policy.

Every channel carries the backends' bearer token and TLS settings (``backend_security``: ``backend_token`` /
``backend_token_file``, ``backend_tls_ca``, ``backend_tls_cert`` / ``backend_tls_key``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_svc.config import GatewayConfig
from gateway_svc.errors import GatewayError, request_id
from shared.grpc_server import GRPC_OPTIONS
from shared.proto import decoder_pb2, decoder_pb2_grpc, embed_pb2, embed_pb2_grpc
from shared.public_auth import read_token_file
from shared.tls import ClientSecurity

log = logging.getLogger(__name__)

ROUND_ROBIN = [("grpc.lb_policy_name", "round_robin")]
PROBE_TIMEOUT_S = 2.0  # one discovery or health call
REDISCOVER_INTERVAL_S = 2.0  # an unknown model re-asks the targets at most this often


@dataclass
class Backend:
    """One served model and the channel its requests take.

    Attributes:
        model: the model as the backend names it (``--model`` of the service).
        served_names: every name a request's ``model`` may use for it.
        kind: ``audio`` (a speech decoder), ``text`` (a text decoder) or ``embed`` (an encoder-only model).
        targets: the gRPC targets serving it.
        created: unix seconds the gateway first saw it (``/v1/models``'s ``created``).
    """

    model: str
    served_names: frozenset[str]
    kind: str
    targets: list[str]
    created: int = field(default_factory=lambda: int(time.time()))
    channel: grpc.aio.Channel | None = None

    @property
    def decoder(self) -> decoder_pb2_grpc.DecoderServiceStub:
        return decoder_pb2_grpc.DecoderServiceStub(self.channel)

    @property
    def embed(self) -> embed_pb2_grpc.EmbedServiceStub:
        return embed_pb2_grpc.EmbedServiceStub(self.channel)


def balanced_target(targets: list[str]) -> str:
    """One gRPC target for ``targets`` (``host:port`` each, or a single target of any scheme).

    Raises:
        ValueError: several targets, one of them with a scheme (``dns:///...``) or without a port.
    """
    if len(targets) == 1:
        return targets[0]
    addresses = []
    for target in targets:
        host, sep, port = target.rpartition(":")
        if not sep or "/" in target or not port.isdigit():
            raise ValueError(
                f"{target!r}: several targets of one model must each be host:port (or give one dns:/// target)"
            )
        host = host.strip("[]")
        try:
            ipaddress.ip_address(host)
            resolved = [host]
        except ValueError:
            resolved = sorted({info[4][0] for info in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)})
        addresses += [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in resolved]
    scheme = "ipv6" if all(a.startswith("[") for a in addresses) else "ipv4"
    return f"{scheme}:{','.join(addresses)}"


def backend_security(config: GatewayConfig) -> ClientSecurity:
    """How the gateway reaches its backends: their bearer token (``backend_token`` or the text of
    ``backend_token_file``) and TLS (``backend_tls_*``).

    Raises:
        ValueError: ``backend_token_file`` cannot be read or is empty, or a TLS file cannot be read or is not PEM.
    """
    token = config.backend_token.strip()
    if config.backend_token_file:
        token = read_token_file(config.backend_token_file, "backend_token_file")
        if not token:
            raise ValueError(f"backend_token_file {config.backend_token_file!r} is empty")
    security = ClientSecurity(
        token=token,
        tls_ca=config.backend_tls_ca,
        tls_cert=config.backend_tls_cert,
        tls_key=config.backend_tls_key,
        tls_server_name=config.backend_tls_server_name,
    )
    security.credentials()  # reads the PEM files now: a wrong path fails the start
    return security


class Backends:
    """The decoder and embed backends of one gateway (``GatewayConfig.decoder_address`` / ``embed_address``).

    Used on the gateway's event loop only: ``start`` and ``close`` from its lifespan.
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.models: dict[str, Backend] = {}  # by Backend.model
        self._probes: dict[str, grpc.aio.Channel] = {}  # one channel per configured target
        self._last_discovery = 0.0
        self.unanswered: set[str] = set()  # targets that did not answer the last discovery
        # targets that refused the gateway's credentials at the last discovery -> why (their health answers anyway)
        self.refused: dict[str, str] = {}
        self._failing: dict[str, str] = {}  # the failing targets of the last health check, as logged
        self.aliases = config.aliases
        self.security = backend_security(config)
        self._lock = asyncio.Lock()

    def _probe(self, target: str) -> grpc.aio.Channel:
        if target not in self._probes:
            self._probes[target] = self.security.channel(target, GRPC_OPTIONS + ROUND_ROBIN)
        return self._probes[target]

    async def start(self) -> None:
        """Discovers what every target serves; a target that does not answer yet is logged and asked again later."""
        await self.discover()

    async def discover(self) -> None:
        """Asks every target what it serves and (re)builds one channel per model."""
        async with self._lock:
            self._last_discovery = time.monotonic()
            found: dict[str, Backend] = {}
            probes = [(t, "decoder") for t in self.config.decoder_targets]
            probes += [(t, "embed") for t in self.config.embed_targets]
            answers = await asyncio.gather(*(self._ask(t, role) for t, role in probes))
            self.unanswered = {target for (target, _), answer in zip(probes, answers) if answer is None}
            for (target, _), answer in zip(probes, answers):
                if answer is None:
                    continue
                model, names, kind = answer
                backend = found.setdefault(model, Backend(model, frozenset(names), kind, []))
                backend.served_names |= frozenset(names)
                backend.targets.append(target)
            for model, backend in found.items():
                old = self.models.get(model)
                if old is not None and old.targets == backend.targets and old.channel is not None:
                    backend.channel, backend.created = old.channel, old.created
                else:
                    try:
                        target = balanced_target(backend.targets)
                    except (ValueError, OSError) as exc:
                        log.error("model %s: %s", model, exc)
                        continue
                    backend.channel = self.security.channel(target, GRPC_OPTIONS + ROUND_ROBIN)
            self.models.update(found)

    async def rediscover(self) -> bool:
        """``discover`` again unless it ran in the last ``REDISCOVER_INTERVAL_S`` seconds (or runs now: concurrent
        callers wait for that one instead of queueing their own); True if the catalog may have changed."""
        if self._lock.locked():
            async with self._lock:  # another caller's discovery: its answer is ours
                return True
        if time.monotonic() - self._last_discovery <= REDISCOVER_INTERVAL_S:
            return False
        await self.discover()
        return True

    async def _ask(self, target: str, role: str) -> tuple[str, list[str], str] | None:
        """``(model, served names, kind)`` of the service at ``target``; None (logged) if it does not answer or
        refuses the gateway's credentials (then kept in ``refused``: its health, open to all, still says SERVING)."""
        channel = self._probe(target)
        try:
            if role == "decoder":
                stats = await decoder_pb2_grpc.DecoderServiceStub(channel).GetStats(
                    decoder_pb2.GetStatsRequest(), timeout=PROBE_TIMEOUT_S
                )
                answer = stats.model, [stats.model, *stats.served_model_names], stats.input_kind or "audio"
            else:
                info = await embed_pb2_grpc.EmbedServiceStub(channel).Tokenize(
                    embed_pb2.TokenizeRequest(), timeout=PROBE_TIMEOUT_S
                )
                answer = info.model, [info.model], "embed"
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                self.refused[target] = (
                    f"{role} {target} refuses the gateway's credentials ({exc.code().name}: {exc.details()}): "
                    "check --backend-token-file / ENCDEC_BACKEND_TOKEN and the backend TLS settings"
                )
                log.error("%s", self.refused[target])
            else:
                log.warning(
                    "%s %s does not answer (%s: %s); asked again later", role, target, exc.code().name, exc.details()
                )
            return None
        self.refused.pop(target, None)
        return answer

    async def lookup(self, model: str, kinds: tuple[str, ...], endpoint: str) -> Backend:
        """The backend serving ``model`` (one of ``kinds``); asks the targets again if none is known to.

        With one backend of the right kind and a name none serves, that backend gets the request (it answers
        NOT_FOUND itself, naming what it serves, or knows the name as an alias).

        Raises:
            GatewayError: 404 (no such model), 400 (the model serves another endpoint), 503 (no backend of
                ``kinds`` answers).
        """
        backend = self.find(model)
        if backend is None and await self.rediscover():
            backend = self.find(model)
        if backend is not None and backend.kind not in kinds:
            raise GatewayError(
                400, f"model {model!r} is {_KIND_NAMES[backend.kind]}: it does not serve {endpoint}", "model"
            )
        if backend is None:
            fitting = [b for b in self.models.values() if b.kind in kinds]
            if len(fitting) == 1:  # it answers an unknown name itself (NOT_FOUND naming what it serves)
                return fitting[0]
            if not fitting:
                configured = self.config.decoder_targets if "embed" not in kinds else self.config.embed_targets
                # The targets and their errors go to the log only (issue 34 item 8); the client learns the kind.
                refusing = [self.refused[t] for t in configured if t in self.refused]
                if refusing:  # misconfigured credentials: say so, not "retry later"
                    rid = request_id()
                    log.error("request %s: model %r is not known: %s", rid, model, "; ".join(refusing))
                    raise GatewayError(
                        503,
                        f"model {model!r} is not known: this gateway's backends refuse its credentials "
                        "(UNAUTHENTICATED / PERMISSION_DENIED); its operator must check --backend-token-file / "
                        f"ENCDEC_BACKEND_TOKEN and the backend TLS settings (request id {rid})",
                    )
                silent = [t for t in configured if t in self.unanswered]
                if silent:  # the model may be behind a target that is down
                    rid = request_id()
                    log.warning("request %s: model %r is not known: %s did not answer", rid, model, ", ".join(silent))
                    raise GatewayError(
                        503,
                        f"model {model!r} is not known: a backend that may serve it does not answer; retry later "
                        f"(request id {rid})",
                    )
                served = ", ".join(sorted(b.model for b in self.models.values())) or "nothing"
                raise GatewayError(
                    404,
                    f"model {model!r} is not served here; no model for {endpoint} is (served: {served})",
                    "model",
                    "model_not_found",
                )
            served = ", ".join(sorted(b.model for b in fitting))
            raise GatewayError(
                404, f"model {model!r} is not served here; {endpoint} serves: {served}", "model", "model_not_found"
            )
        return backend

    def wire_name(self, model: str) -> str:
        """The name a backend knows ``model`` by: an alias's model (``GatewayConfig.model_aliases``), else itself."""
        return self.aliases.get(model, model)

    def find(self, model: str) -> Backend | None:
        """The known backend serving ``model`` (a served name or an alias of one), if any."""
        model = self.wire_name(model)
        return next((b for b in self.models.values() if model in b.served_names), None)

    async def health(self) -> dict[str, str | None]:
        """``{target: None if SERVING else why not}`` for every configured target (standard gRPC health).

        For the gateway and its log only: ``GET /health`` is open to every caller and answers counts (issue 34
        item 8). A change in the failing targets (or their reasons) is logged at WARNING, once.
        """
        targets = self.config.decoder_targets + self.config.embed_targets
        answers = await asyncio.gather(*(self._check(t) for t in targets))
        # A target that refused the gateway's token is not usable all the same.
        health = {t: answer or self.refused.get(t) for t, answer in zip(targets, answers)}
        failing = {t: why for t, why in health.items() if why is not None}
        if failing != self._failing:
            self._failing = failing
            if failing:
                log.warning("health: not serving: %s", "; ".join(f"{t}: {why}" for t, why in failing.items()))
            else:
                log.info("health: every backend is serving")
        return health

    async def _check(self, target: str) -> str | None:
        try:
            response = await health_pb2_grpc.HealthStub(self._probe(target)).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return None

    async def close(self) -> None:
        channels = list(self._probes.values()) + [b.channel for b in self.models.values() if b.channel is not None]
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)


_KIND_NAMES = {"audio": "a speech model", "text": "a text-generation model", "embed": "an embedding model"}
