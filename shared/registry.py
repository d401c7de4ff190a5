"""The replica registry: every encoder, decoder and embed process announces itself in Redis under a lease.

A replica's record is the key ``{prefix}:replica:{replica_id}`` (the JSON of its ``ReplicaInfo``) with a TTL of
``ttl_s``, which its ``Lease`` renews every third of it with its current load; the set
``{prefix}:replicas:{role}`` lists the ids of a role. A replica whose key expired (the process died, or was
partitioned from Redis for ``ttl_s``) is gone: ``replicas`` lists only live ones. A dead encoder or embed id is
pruned from its set there; a dead decoder id stays until ``decoder_svc`` reaps the requests it owned (its
``dead_members``). A clean shutdown deregisters at once (``Lease.stop``).

Reachability of the cross-KV transports: ``host_id`` names the node (the kernel's boot id, the same in every
container of one machine: cuda_ipc needs one node), ``shm_namespace_id`` names the ``/dev/shm`` a process sees (the
same for the containers of one Pod sharing an in-memory ``emptyDir`` there: shm needs one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import redis

from shared.errors import UnavailableError
from shared.redis_url import REDIS_RETRIES, REDIS_SOCKET_TIMEOUT_S, bounded_client, redact_url

log = logging.getLogger(__name__)

ROLES = ("encoder", "decoder", "embed")
PRUNED_ROLES = ("encoder", "embed")  # dead decoders stay listed until their requests are reaped
SHM_ID_FILE = "encdec-shm-id"


class RegistryUnavailableError(UnavailableError):
    """Redis of the replica registry did not answer (refused, timed out, refused the password): UNAVAILABLE."""


@dataclasses.dataclass(frozen=True)
class ReplicaInfo:
    """One replica as registered (all fields JSON-serializable; tuples travel as lists).

    Attributes:
        replica_id: ``new_replica_id(role)``, new per process start.
        role: one of ``ROLES``.
        model: the service's ``config.model``.
        served_names: every name a request may use for that model (``shared.models.registry.model_names``).
        address: ``host:port`` other replicas reach it at (``advertise_address``).
        kv_transports: encoder: the transports it accepts; decoder: its ``kv_transport``; embed: ``()``.
        host_id: node identity (``host_id()``).
        shm_id: identity of the ``/dev/shm`` it sees (``shm_namespace_id()``).
        gpu_ids: CUDA device UUIDs the service uses; ``()`` on the CPU.
        load: in-flight work (encoder / embed: items queued + running; decoder: running + waiting sequences).
        started_at / renewed_at: unix seconds.
    """

    replica_id: str
    role: str
    model: str
    served_names: tuple[str, ...]
    address: str
    kv_transports: tuple[str, ...]
    host_id: str
    shm_id: str
    gpu_ids: tuple[str, ...]
    load: int = 0
    started_at: float = 0.0
    renewed_at: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of: {', '.join(ROLES)}; got {self.role!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ReplicaInfo:
        """Raises ``ValueError`` (``json.JSONDecodeError``, ``TypeError`` as ``ValueError``) for a bad record."""
        data = json.loads(text)
        try:
            for name in ("served_names", "kv_transports", "gpu_ids"):
                data[name] = tuple(data[name])
            return cls(**data)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a replica record: {exc}") from exc


def new_replica_id(role: str) -> str:
    """``{role}-{hostname}-{8 hex digits}``: readable in logs, new for every process start."""
    return f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def advertise_address(config) -> str:
    """``config.advertise_address``, else ``config.host:config.port`` with an unspecified host (``0.0.0.0``, ``::``)
    replaced by ``$POD_IP`` (Kubernetes' downward API) or this machine's address; IPv6 hosts in brackets.

    Raises:
        ValueError: no advertise_address and ``config.port`` is 0 (the port picked at bind time is not known here).
    """
    if config.advertise_address:
        return config.advertise_address
    if config.port == 0:
        raise ValueError("port 0 cannot be registered: set --port (or --advertise-address host:port)")
    host = config.host
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{config.port}"


def shm_namespace_id(shm_dir: str = "/dev/shm") -> str:
    """A uuid kept in ``{shm_dir}/encdec-shm-id``: two processes get the same one iff they share that directory.

    The first process writes it (a complete file linked into place: ``link`` fails with EEXIST like
    ``O_CREAT | O_EXCL``, and no reader sees a half-written id); the others read it. Empty when the directory
    cannot be used (then no shm peer matches).
    """
    path = os.path.join(shm_dir, SHM_ID_FILE)
    for _ in range(3):
        with contextlib.suppress(FileNotFoundError):
            with open(path) as f:
                found = f.read().strip()
            if found:
                return found
        new_id = uuid.uuid4().hex
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "x") as f:
                f.write(new_id)
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, path)
                return new_id
            except FileExistsError:
                continue  # another process won: read its id
            finally:
                os.unlink(tmp)
        except OSError as exc:
            log.warning("cannot keep a shm namespace id in %s (%s): no shm peer will match", shm_dir, exc)
            return ""
    return ""


def host_id() -> str:
    """The kernel's boot id (``/proc/sys/kernel/random/boot_id``: one per node, shared by its containers); the host
    name where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def cuda_gpu_ids(device) -> tuple[str, ...]:
    """UUIDs of the CUDA device ``device`` (a ``torch.device``) is; ``()`` for a CPU device."""
    if getattr(device, "type", "cpu") != "cuda":
        return ()
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return (str(torch.cuda.get_device_properties(index).uuid),)


# KEYS: the replica key, the role's set; ARGV: JSON, ttl ms, id. SET XX keeps a gone key gone; SADD repairs a pruned id.
_RENEW_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'XX') then
  redis.call('SADD', KEYS[2], ARGV[3]) return 1
end
return 0
"""
# KEYS[1]: the role's set, KEYS[2..]: replica keys; ARGV: their ids. Removes an id only if its key is still gone
# (a replica registering again between the read and the prune stays listed).
_PRUNE_LUA = """
local n = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then n = n + redis.call('SREM', KEYS[1], ARGV[i - 1]) end
end
return n
"""


class ReplicaRegistry:
    """Replica records in Redis: ``{prefix}:replica:{id}`` = JSON of ``ReplicaInfo`` (PX ``ttl_s``), and the set
    ``{prefix}:replicas:{role}`` of ids.

    Every call is bounded (``shared.redis_url.bounded_client``) and raises ``RegistryUnavailableError`` (naming the URL,
    never its password) when Redis fails.
    """

    def __init__(self, redis_url: str, key_prefix: str = "encdec", ttl_s: float = 5.0) -> None:
        if not 0 < ttl_s < float("inf"):
            raise ValueError(f"ttl_s must be > 0 and finite (seconds), got {ttl_s}")
        self.redis_url = redis_url
        self.key_prefix = key_prefix
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self._client = bounded_client(redis_url)
        self._renew = self._client.register_script(_RENEW_LUA)
        self._prune = self._client.register_script(_PRUNE_LUA)

    def key(self, replica_id: str) -> str:
        return f"{self.key_prefix}:replica:{replica_id}"

    def set_key(self, role: str) -> str:
        return f"{self.key_prefix}:replicas:{role}"

    @contextlib.contextmanager
    def _reachable(self):
        try:
            yield
        except redis.RedisError as exc:
            raise RegistryUnavailableError(
                f"replica registry at {redact_url(self.redis_url)} is unreachable ({exc}): start Redis or check "
                "--redis-url / --redis-password-file"
            ) from exc

    def register(self, info: ReplicaInfo) -> None:
        """Writes ``info`` with a fresh TTL and lists its id under its role (one MULTI)."""
        with self._reachable():
            pipe = self._client.pipeline(transaction=True)
            pipe.set(self.key(info.replica_id), info.to_json(), px=self.ttl_ms)
            pipe.sadd(self.set_key(info.role), info.replica_id)
            pipe.execute()

    def renew(self, info: ReplicaInfo) -> bool:
        """Rewrites ``info`` (its load, ``renewed_at``) with a fresh TTL. False if its key had expired: the caller
        registers again."""
        with self._reachable():
            return bool(
                self._renew(
                    keys=[self.key(info.replica_id), self.set_key(info.role)],
                    args=[info.to_json(), self.ttl_ms, info.replica_id],
                )
            )

    def deregister(self, replica_id: str, role: str) -> None:
        """Removes the replica's key and its id from the role's set."""
        with self._reachable():
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self.key(replica_id))
            pipe.srem(self.set_key(role), replica_id)
            pipe.execute()

    def _members(self, role: str) -> tuple[list[str], list[str | None]]:
        ids = sorted(self._client.smembers(self.set_key(role)))
        return ids, (self._client.mget([self.key(i) for i in ids]) if ids else [])

    def replicas(self, role: str) -> list[ReplicaInfo]:
        """The live replicas of ``role`` (key present), by id. Dead encoder / embed ids are pruned from the set."""
        with self._reachable():
            ids, records = self._members(role)
            live, dead = [], []
            for replica_id, record in zip(ids, records, strict=True):
                if record is None:
                    dead.append(replica_id)
                    continue
                try:
                    live.append(ReplicaInfo.from_json(record))
                except ValueError as exc:
                    log.warning("ignoring replica record %s: %s", self.key(replica_id), exc)
            if dead and role in PRUNED_ROLES:
                self._prune(keys=[self.set_key(role), *map(self.key, dead)], args=dead)
            return live

    def dead_members(self, role: str) -> list[str]:
        """Ids listed under ``role`` whose key is gone (lease expired, not deregistered)."""
        with self._reachable():
            ids, records = self._members(role)
            return [replica_id for replica_id, record in zip(ids, records, strict=True) if record is None]

    def is_alive(self, replica_id: str) -> bool:
        with self._reachable():
            return bool(self._client.exists(self.key(replica_id)))

    def close(self) -> None:
        self._client.close()


class Lease:
    """Registers ``info`` and renews it every ttl/3 on a daemon thread, with the load ``load_fn()`` gives.

    ``load_fn`` is called on that thread: it must be thread-safe and cheap. Renewal failures (Redis down) are
    logged once per outage and retried; a renewal that finds the key gone (expired during an outage or a pause)
    registers again, logged. ``stop`` deregisters at once (a clean shutdown).
    """

    def __init__(self, registry: ReplicaRegistry, info: ReplicaInfo, load_fn: Callable[[], int] = lambda: 0) -> None:
        self.registry = registry
        self.load_fn = load_fn
        self.interval_s = registry.ttl_ms / 3000.0
        self._info = info
        self._registered = False  # registered once: a beat renews (and registers again if the key is gone)
        self._outage = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def info(self) -> ReplicaInfo:
        """The latest ``ReplicaInfo`` written (or being written)."""
        return self._info

    def start(self) -> None:
        """Registers (synchronously; a Redis that is away is logged and retried on the thread, never raised),
        then starts renewing."""
        now = time.time()
        self._info = dataclasses.replace(self._info, started_at=self._info.started_at or now, renewed_at=now)
        self._beat()
        self._thread = threading.Thread(target=self._run, name=f"lease-{self._info.role}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops renewing and deregisters (a failure is logged: the key then expires within the TTL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(
                timeout=(1 + REDIS_RETRIES) * REDIS_SOCKET_TIMEOUT_S + 1
            )  # a renewal in flight ends by then
        try:
            self.registry.deregister(self._info.replica_id, self._info.role)
            log.info("%s %s deregistered", self._info.role, self._info.replica_id)
        except RegistryUnavailableError as exc:
            log.warning("could not deregister %s (its key expires on its own): %s", self._info.replica_id, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._beat()

    def _beat(self) -> None:
        info = self._info
        try:
            load = int(self.load_fn())
        except Exception:  # noqa: BLE001 - a broken load counter must not end the lease
            log.warning("load_fn of %s failed; keeping load %d", info.replica_id, info.load, exc_info=True)
            load = info.load
        self._info = info = dataclasses.replace(info, load=load, renewed_at=time.time())
        try:
            if not (self._registered and self.registry.renew(info)):
                if self._registered:
                    log.warning("lease of %s %s had expired: registered again", info.role, info.replica_id)
                self.registry.register(info)
                if not self._registered:
                    ttl_s = self.registry.ttl_ms / 1000
                    log.info("%s %s registered at %s (ttl %g s)", info.role, info.replica_id, info.address, ttl_s)
                self._registered = True
        except RegistryUnavailableError as exc:
            if not self._outage:
                log.warning(
                    "cannot renew the lease of %s (retrying every %.2g s): %s", info.replica_id, self.interval_s, exc
                )
            self._outage = True
            return
        if self._outage:
            log.info("replica registry reachable again: lease of %s renewed", info.replica_id)
        self._outage = False
