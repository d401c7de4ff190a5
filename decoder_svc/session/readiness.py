"""The decoder's readiness: what its gRPC health reports (``shared.grpc_server.serve``'s ``readiness`` probe).

A decoder can serve Generate only while both of its peers answer: Redis (every
request's state is recorded there) and an encoder (every request's cross KV
comes from it). ``DecoderReadiness`` probes both at once, each within about a
second (``RequestStateStore.probe``: one PING; ``EncodeClient.probe``: the
encoder's standard health for ``encdec.v1.EncoderService``); health is
NOT_SERVING, with the reason logged, while either fails, and SERVING again once
both answer. A load balancer or orchestrator watching health then sends no new
requests to a decoder that could only fail or stall them.

When Redis answers again, the final states this replica could not record while
it was down (``Sessions.flush_unrecorded``) are written. Each probe's outcome
also feeds ``decoder_svc.replicas.lost_replicas.RedisUptime``: lost decoders are reaped
only after Redis answered continuously for a while.
"""

from __future__ import annotations

import asyncio
import logging

from decoder_svc.replicas.lost_replicas import RedisUptime
from decoder_svc.replicas.request_state import RequestStateStore
from decoder_svc.session.encode_client import EncodeClient

log = logging.getLogger(__name__)


class DecoderReadiness:
    """The decoder's readiness probe: Redis reachable and an encoder SERVING.

    Args:
        store: the Redis request-state store (its ``probe``).
        encoder: the Encode client (its ``probe``, over the channel Encode uses, so probing also keeps that
            channel connecting while the encoder is away).
        on_redis_up: awaited after a probe in which Redis answered (the late final states are written then).
        uptime: told whether Redis answered each probe (the lost-decoder reaper's outage guard); None: no one.
    """

    def __init__(
        self, store: RequestStateStore, encoder: EncodeClient, on_redis_up=None, uptime: RedisUptime | None = None
    ) -> None:
        self.store = store
        self.encoder = encoder
        self.on_redis_up = on_redis_up
        self.uptime = uptime
        self.redis_reason: str | None = None  # why Redis failed the last probe; None while it answers

    async def __call__(self) -> str | None:
        """None when both peers answer, else the reasons (``"; "``-joined), each naming its peer's address."""
        redis_reason, encoder_reason = await asyncio.gather(asyncio.to_thread(self.store.probe), self.encoder.probe())
        self.redis_reason = redis_reason
        if self.uptime is not None:
            self.uptime.observe(redis_reason is None)
        if redis_reason is None and self.on_redis_up is not None:
            try:
                await self.on_redis_up()
            except Exception:  # noqa: BLE001 - retried at the next probe
                log.warning("could not write the final states recorded late", exc_info=True)
        reasons = [r for r in (redis_reason, encoder_reason) if r is not None]
        return "; ".join(reasons) if reasons else None
