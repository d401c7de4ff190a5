"""A service's lease in the replica registry, built from its config, and the ``serve`` hooks that run it.

``service_lease`` builds the ``shared.registry.Lease`` of one process (a new replica id, the advertised address,
node / ``/dev/shm`` identities, the served model names) when ``config.redis_url`` is set. ``serve_hooks`` gives
``shared.grpc_server.serve`` the two hooks that start the lease once the server serves (``on_serving``: after the
model's warm-up and the bind) and stop it as the shutdown begins (before the drain), so a replica is listed only
while it can take calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from shared.models.registry import model_names
from shared.redis_url import resolve_redis_url
from shared.registry import (
    Lease,
    ReplicaInfo,
    ReplicaRegistry,
    advertise_address,
    host_id,
    new_replica_id,
    shm_namespace_id,
)

log = logging.getLogger(__name__)


def service_lease(
    config,
    role: str,
    kv_transports: Sequence[str] = (),
    gpu_ids: Sequence[str] = (),
    load_fn: Callable[[], int] = lambda: 0,
) -> Lease | None:
    """The (not yet started) lease of this process in the registry at ``config.redis_url``; None when it is empty.

    Args:
        config: a ``shared.config.ServiceConfig`` (``redis_url``, ``redis_password_file``, ``lease_ttl_s``,
            ``model``, ``host`` / ``port`` / ``advertise_address``).
        role: one of ``shared.registry.ROLES``.
        kv_transports / gpu_ids: as ``ReplicaInfo``'s.
        load_fn: in-flight work now; called on the lease's thread (thread-safe, cheap).

    Raises:
        ValueError: the password file cannot be read, or the address cannot be advertised (port 0).
    """
    if not config.redis_url:
        if config.advertise_address:
            log.warning(
                "advertise_address %s is set but redis_url is empty: this %s registers nowhere (set --redis-url)",
                config.advertise_address,
                role,
            )
        return None
    info = ReplicaInfo(
        replica_id=new_replica_id(role),
        role=role,
        model=config.model,
        served_names=tuple(sorted(model_names(config.model))),
        address=advertise_address(config),
        kv_transports=tuple(kv_transports),
        host_id=host_id(),
        shm_id=shm_namespace_id(),
        gpu_ids=tuple(gpu_ids),
    )
    registry = ReplicaRegistry(
        resolve_redis_url(config.redis_url, config.redis_password_file), ttl_s=config.lease_ttl_s
    )
    return Lease(registry, info, load_fn)


def serve_hooks(lease: Lease | None) -> dict:
    """``serve`` keyword arguments (``on_serving``, ``drain``) that register ``lease`` once the server takes calls
    and deregister it when the shutdown begins; ``{}`` for no lease."""
    if lease is None:
        return {}

    async def on_serving() -> None:
        await asyncio.to_thread(lease.start)  # never raises: a Redis away is retried on the lease's thread

    async def drain() -> None:
        await asyncio.to_thread(lease.stop)
        lease.registry.close()

    return {"on_serving": on_serving, "drain": drain}
