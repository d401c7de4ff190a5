"""Failing the requests of a lost decoder: its lease expired, its running requests will never end on their own.

Every decoder runs ``LostDecoderReaper`` every ``min(lease_ttl_s / 4, 0.5)`` seconds (``REAP_INTERVAL_S``: a
killed decoder's requests are failed within ``lease_ttl_s + 1`` s of the kill; two cheap Redis calls each): for
each decoder id the registry still lists whose lease key is gone
(``ReplicaRegistry.dead_members``; a clean shutdown deregisters and is never
listed), one Lua script (``RequestStateStore.fail_lost_owner``) fails every
non-terminal request in that decoder's owner set with ``decoder <id> lost (its
lease expired)``, deletes the set and drops the id from the registry. One
script: when two replicas try at once, one fails the requests and the other
finds nothing; a decoder whose lease is back by then (it renewed late) is left
alone.

False positives after a Redis outage: every lease may have expired while Redis
was away (or a restart with persistence brought back keys past their TTL), and
a replica that reconnects first would fail the requests of replicas that are
alive and about to renew. So a replica reaps only once it has seen Redis answer
continuously for ``2 x lease_ttl_s`` (``RedisUptime``, fed by the reaper's own
calls and the health probe's PING): every live decoder has renewed by then.
A decoder that was reaped anyway (it stalled for longer than its lease)
registers again and keeps serving; its sessions end the requests whose records
were failed (``decoder_svc.session.request_session.RecordEndedElsewhereError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from decoder_svc.replicas.request_state import RequestStateStore
from shared.errors import UnavailableError
from shared.registry import ReplicaRegistry

log = logging.getLogger(__name__)

GUARD_LEASES = 2.0  # reap only after Redis answered continuously for this many lease TTLs
REAP_INTERVAL_S = 0.5  # the longest time between two looks at the registry


def lost_error(replica_id: str) -> str:
    """The ``error`` a lost decoder's requests are failed with."""
    return f"decoder {replica_id} lost (its lease expired)"


class RedisUptime:
    """How long Redis has answered this replica without a failure in between.

    Args:
        clock: monotonic seconds (``time.monotonic``; tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None  # first success after the last failure; None: the last call failed

    def observe(self, reachable: bool) -> None:
        """Records one call's outcome: a failure restarts the count, a success starts it if it is stopped."""
        if not reachable:
            self._since = None
        elif self._since is None:
            self._since = self._clock()

    def up_for(self) -> float:
        """Seconds Redis has answered continuously (0 while the last call failed)."""
        return 0.0 if self._since is None else self._clock() - self._since


class LostDecoderReaper:
    """Fails the non-terminal requests of decoders whose lease expired (see the module docstring).

    Args:
        store: the request-state store (its owner sets and the reaping script).
        registry: the replica registry (which decoder leases are gone).
        replica_id: this decoder's id (never reaped here).
        lease_ttl_s: the deployment's lease TTL (seconds): the reaping period is a quarter of it (at most
            ``REAP_INTERVAL_S``), the guard twice it.
        uptime: Redis's continuous uptime as this replica saw it (the health probe feeds it too); a new one if None.
    """

    def __init__(
        self,
        store: RequestStateStore,
        registry: ReplicaRegistry,
        replica_id: str,
        lease_ttl_s: float,
        uptime: RedisUptime | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.replica_id = replica_id
        self.interval_s = min(lease_ttl_s / 4, REAP_INTERVAL_S)
        self.guard_s = GUARD_LEASES * lease_ttl_s
        self.uptime = uptime or RedisUptime()
        self._task: asyncio.Task | None = None

    def reap_once(self) -> int:
        """Blocking: one round. Does nothing until Redis has answered for ``guard_s``; Redis failing counts as an
        outage (and ends the round).

        Returns:
            How many requests it failed (over every lost decoder).
        """
        try:
            dead = [d for d in self.registry.dead_members("decoder") if d != self.replica_id]
        except UnavailableError:
            self.uptime.observe(False)
            return 0
        self.uptime.observe(True)
        if not dead or self.uptime.up_for() < self.guard_s:
            return 0
        total = 0
        for replica_id in dead:
            try:
                failed = self.store.fail_lost_owner(
                    replica_id,
                    lost_error(replica_id),
                    self.registry.key(replica_id),
                    self.registry.set_key("decoder"),
                )
            except UnavailableError:
                self.uptime.observe(False)
                break
            if failed > 0:
                log.warning("decoder %s lost (lease expired): failed its %d running requests", replica_id, failed)
                total += failed
            elif failed == 0:
                log.info("decoder %s lost (lease expired); it owned no running request", replica_id)
        return total

    async def run(self) -> None:
        """Reaps every ``interval_s`` seconds until cancelled (``stop``)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await asyncio.to_thread(self.reap_once)
            except Exception:  # noqa: BLE001 - a round's bug must not end the reaping
                log.exception("reaping lost decoders failed")

    def start(self) -> None:
        """Starts ``run`` on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self.run(), name="lost-decoder-reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
