"""The encoders a decoder sends Encode to: one static address, or live replicas from the Redis registry.

Static (``--encoder-address host:port``): one channel, the behaviour of a single encoder (wait-for-ready, see
``decoder_svc.session.encode_client``).

Registry (``--encoder-address registry``): a background task reads ``ReplicaRegistry.replicas("encoder")`` every
``REFRESH_INTERVAL_S`` (off the event loop) and keeps the candidates: replicas whose ``served_names`` contain this
decoder's model, whose ``kv_transports`` contain its transport, and that can reach its KV pool (shm: the same
``/dev/shm``, ``shm_id``; cuda_ipc: the same node, ``host_id``; torch_dist: any). ``pick`` takes the least loaded
(the load it registered plus this decoder's own Encodes in flight to it), ties at random. An encoder marked failed
(a call to it failed) is not picked again until it registers again under a new replica id or its health answers
SERVING (the refresh task probes the failed ones). One channel per encoder address, closed once the address has
left the registry and no call on it is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.config import DecoderServiceConfig
from shared.errors import UnavailableError
from shared.grpc_server import GRPC_OPTIONS
from shared.proto import encoder_pb2_grpc
from shared.redis_url import redact_url, resolve_redis_url
from shared.registry import RegistryUnavailableError, ReplicaInfo, ReplicaRegistry, host_id, shm_namespace_id
from shared.tls import ClientSecurity

log = logging.getLogger(__name__)

REGISTRY = "registry"  # the encoder_address that selects registry mode
ENCODER_SERVICE = "encdec.v1.EncoderService"  # the name an encoder's health reports SERVING
PROBE_TIMEOUT_S = 1.0  # one health Check
REFRESH_INTERVAL_S = 1.0
PICK_RETRY_S = 0.2  # a pick that finds no usable encoder reads the registry again this often (up to a lease TTL)
# gRPC's default reconnect backoff grows to 120 s (1 s initial, x1.6, jittered): after an encoder restart the
# channel could stay in TRANSIENT_FAILURE for seconds after the encoder is back. A local peer is cheap to retry.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclasses.dataclass(frozen=True)
class EncoderTarget:
    """One encoder to call: its registry id (``""`` for a static address), address and stubs on its channel."""

    replica_id: str
    address: str
    channel: grpc.aio.Channel
    stub: encoder_pb2_grpc.EncoderServiceStub
    health: health_pb2_grpc.HealthStub

    @property
    def name(self) -> str:
        """``encoder <id> at <address>`` (``encoder at <address>`` when static), for messages."""
        return f"encoder {self.replica_id} at {self.address}" if self.replica_id else f"encoder at {self.address}"


async def health_reason(target: EncoderTarget) -> str | None:
    """Asks ``target``'s gRPC health for ``ENCODER_SERVICE`` within ``PROBE_TIMEOUT_S``: None when SERVING, else
    why this decoder cannot use it (unreachable, not serving, or not an encoder), naming it."""
    try:
        response = await target.health.Check(
            health_pb2.HealthCheckRequest(service=ENCODER_SERVICE), timeout=PROBE_TIMEOUT_S
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return f"the service at {target.address} is not an encoder (its health does not know {ENCODER_SERVICE})"
        return f"{target.name} is unreachable ({exc.code().name}: {exc.details()})"
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target.name} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
    return None


class EncoderPool:
    """Where Encode goes: ``static_target`` (a host:port), or ``pick()`` among registry candidates.

    Args:
        config: ``encoder_address`` (``host:port`` or ``registry``), ``model``, ``kv_transport``; registry mode:
            ``redis_url``, ``redis_password_file``, ``lease_ttl_s``.
        shm_dir: the ``/dev/shm`` this decoder's shm pool lives in (its ``shm_namespace_id``).
    """

    def __init__(self, config: DecoderServiceConfig, shm_dir: str = "/dev/shm") -> None:
        self.config = config
        self.static = config.encoder_address != REGISTRY
        # TLS to the encoders (--encoder-tls-ca ...); Encode's token travels as metadata of its own (internal_auth).
        self.security = ClientSecurity(
            tls_ca=config.encoder_tls_ca,
            tls_cert=config.encoder_tls_cert,
            tls_key=config.encoder_tls_key,
            tls_server_name=config.encoder_tls_server_name,
        )
        self.static_target = self._target("", config.encoder_address) if self.static else None
        self.registry: ReplicaRegistry | None = None
        if not self.static:
            url = resolve_redis_url(config.redis_url, config.redis_password_file)
            self.registry = ReplicaRegistry(url, ttl_s=config.lease_ttl_s)
        self.host_id = host_id()
        self.shm_id = shm_namespace_id(shm_dir) if config.kv_transport == "shm" else ""
        self._candidates: dict[str, ReplicaInfo] = {}  # replica id -> live, fitting replica (last refresh)
        self._targets: dict[str, EncoderTarget] = {}  # address -> channel (and the id last seen there)
        self._in_flight: dict[str, int] = {}  # address -> this decoder's Encodes in flight there
        self._failed: dict[str, str] = {}  # replica id -> why it was marked failed
        self._until_registered_again: set[str] = set()  # failed ids no health answer brings back
        self._registry_error: str | None = None  # the last refresh's failure, None when it read the registry
        self._refreshed = asyncio.Event()
        self._refresh_lock = asyncio.Lock()  # the refresh task and a waiting pick never refresh at once
        self._task: asyncio.Task | None = None

    def _target(self, replica_id: str, address: str) -> EncoderTarget:
        channel = self.security.channel(address, options=GRPC_OPTIONS + RECONNECT_OPTIONS)
        return EncoderTarget(
            replica_id,
            address,
            channel,
            encoder_pb2_grpc.EncoderServiceStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )

    def fits(self, info: ReplicaInfo) -> bool:
        """True when ``info`` serves this decoder's model over its transport and can reach its KV pool."""
        transport = self.config.kv_transport
        if self.config.model not in info.served_names or transport not in info.kv_transports:
            return False
        if transport == "shm":
            return bool(self.shm_id) and info.shm_id == self.shm_id
        if transport == "cuda_ipc":
            return info.host_id == self.host_id
        return True  # torch_dist reaches across hosts

    async def _started(self) -> None:
        """Starts the refresh task on first use and waits for its first read of the registry."""
        if self._task is None:
            self._task = asyncio.create_task(self._refresh_loop(), name="encoder-pool-refresh")
        await self._refreshed.wait()

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the next refresh tries again
                log.warning("encoder pool refresh failed", exc_info=True)
            self._refreshed.set()
            await asyncio.sleep(REFRESH_INTERVAL_S)

    async def refresh(self) -> None:
        """Reads the registry, updates candidates and channels, and probes the encoders marked failed."""
        async with self._refresh_lock:
            await self._refresh()

    async def _refresh(self) -> None:
        try:
            live = await asyncio.to_thread(self.registry.replicas, "encoder")
        except RegistryUnavailableError as exc:  # keep the last known encoders: they may well still serve
            if self._registry_error is None:
                log.warning(
                    "cannot read the encoder registry (keeping the last %d encoders): %s", len(self._candidates), exc
                )
            self._registry_error = str(exc)
            return
        self._registry_error = None
        candidates = {info.replica_id: info for info in live if self.fits(info)}
        for replica_id in candidates.keys() - self._candidates.keys():
            log.info("encoder %s at %s joined", replica_id, candidates[replica_id].address)
        for replica_id in self._candidates.keys() - candidates.keys():
            log.info("encoder %s at %s left the registry", replica_id, self._candidates[replica_id].address)
        self._candidates = candidates
        self._failed = {rid: why for rid, why in self._failed.items() if rid in candidates}
        self._until_registered_again &= self._failed.keys()
        for info in candidates.values():
            known = self._targets.get(info.address)
            if known is None:
                self._targets[info.address] = self._target(info.replica_id, info.address)
            elif known.replica_id != info.replica_id:  # restarted at the same address: same channel, new id
                self._targets[info.address] = dataclasses.replace(known, replica_id=info.replica_id)
        addresses = {info.address for info in candidates.values()}
        for address in [a for a in self._targets if a not in addresses and not self._in_flight.get(a)]:
            await self._targets.pop(address).channel.close()
        probed = [rid for rid in self._failed if rid not in self._until_registered_again]
        await asyncio.gather(*(self._probe_failed(rid) for rid in probed))

    async def _probe_failed(self, replica_id: str) -> None:
        target = self._targets.get(self._candidates[replica_id].address)
        if target is not None and await health_reason(target) is None:
            log.info("%s answers SERVING again: picked again", target.name)
            self._failed.pop(replica_id, None)

    def _usable(self, exclude: set[str]) -> list[ReplicaInfo]:
        return [info for rid, info in self._candidates.items() if rid not in self._failed and rid not in exclude]

    def no_encoder_reason(self) -> str:
        """Why no encoder can be picked (the UNAVAILABLE message), naming the registry (no password)."""
        registry = redact_url(self.registry.redis_url)
        reason = (
            f"no live encoder replica serves {self.config.model} over {self.config.kv_transport} reachable from this "
            f"decoder (registry at {registry}): start one or check --kv-transport"
        )
        if self._failed:
            reason += f"; failed: {', '.join(f'{rid} ({why})' for rid, why in sorted(self._failed.items()))}"
        if self._registry_error is not None:
            reason += f"; the registry is unreachable: {self._registry_error}"
        return reason

    async def pick(self, exclude: set[str] = frozenset()) -> EncoderTarget:
        """The least loaded usable encoder (registered load + this decoder's in flight to it), ties at random;
        ``exclude``: replica ids this call already tried. With none usable, the registry is read again every
        ``PICK_RETRY_S`` for up to one lease TTL (an encoder (re)registers within a third of it: after its
        restart, or after Redis came back empty) before the call gives up; the caller's deadline bounds the wait.

        Raises:
            UnavailableError: no candidate is left (``no_encoder_reason``).
        """
        await self._started()
        usable = self._usable(exclude)
        give_up = asyncio.get_running_loop().time() + self.config.lease_ttl_s
        while not usable and asyncio.get_running_loop().time() < give_up:
            await asyncio.sleep(PICK_RETRY_S)
            await self.refresh()
            usable = self._usable(exclude)
        if not usable:
            raise UnavailableError(self.no_encoder_reason())
        loads = {info.replica_id: max(info.load, 0) + self._in_flight.get(info.address, 0) for info in usable}
        least = min(loads.values())
        info = random.choice([info for info in usable if loads[info.replica_id] == least])
        target = self._targets[info.address]
        return (
            target if target.replica_id == info.replica_id else dataclasses.replace(target, replica_id=info.replica_id)
        )

    @contextlib.contextmanager
    def calling(self, target: EncoderTarget):
        """Counts a call to ``target`` in flight while the block runs (its load for ``pick``; its channel stays)."""
        self._in_flight[target.address] = self._in_flight.get(target.address, 0) + 1
        try:
            yield
        finally:
            self._in_flight[target.address] -= 1

    def mark_failed(self, target: EncoderTarget, why: str, until_registered_again: bool = False) -> None:
        """Stops picking ``target``'s replica until it registers again (a new replica id) or, unless
        ``until_registered_again`` (it answered as no encoder of this deployment would), answers SERVING."""
        if not target.replica_id:
            return
        if until_registered_again:
            self._until_registered_again.add(target.replica_id)
        if target.replica_id not in self._failed:
            until = "it registers again" if until_registered_again else "it answers again"
            log.warning("%s failed (not picked until %s): %s", target.name, until, why)
            self._failed[target.replica_id] = why

    async def probe(self) -> str | None:
        """Registry mode's readiness: None when some candidate is not marked failed, else ``no_encoder_reason``."""
        await self._started()
        return None if self._usable(set()) else self.no_encoder_reason()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        targets = [self.static_target] if self.static else list(self._targets.values())
        for target in targets:
            await target.channel.close()
        if self.registry is not None:
            await asyncio.to_thread(self.registry.close)
