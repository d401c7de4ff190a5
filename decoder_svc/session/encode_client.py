"""The decoder's client of the encoder's internal Encode RPC, and the wait for the cross KV to arrive.

``EncodeClient.encode`` asks the encoder service to fill a request's reserved
cross blocks in this decoder's pool (``shared.kv_transport``) and returns
once no write for that transfer can still land: with an in-place transport
(shm, cuda_ipc) the encoder has written the blocks when Encode answers; with
one that delivers on its own connection (torch_dist) the transfer is
announced first (``pool.expect``) and awaited after Encode answers.

Encoder faults: Encode waits for the channel to be ready (gRPC wait-for-ready)
within the request's remaining time, so a request sent while the encoder
restarts, or while the channel sits in its reconnect backoff, waits for the
connection instead of failing fast; a call that still fails to connect is
retried (bounded, jittered). The channel's reconnect backoff is kept short
(``decoder_svc.replicas.encoder_pool.RECONNECT_OPTIONS``). ``probe`` asks the encoder's standard gRPC health
(the decoder's readiness, ``decoder_svc.session.readiness``).

With ``--encoder-address registry`` each Encode goes to an encoder replica
``decoder_svc.replicas.encoder_pool.EncoderPool`` picks from the Redis registry, without
wait-for-ready: a call that fails to connect (nothing was sent) marks that
encoder failed and goes to the next candidate at once; one that fails mid-way
(UNAVAILABLE: the encoder died) fails the request, naming the encoder. ``probe``
then says whether some candidate is left.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time

import grpc

from decoder_svc.replicas.encoder_pool import EncoderPool, EncoderTarget, health_reason
from decoder_svc.session.inputs import RequestInput
from shared.config import DecoderServiceConfig
from shared.errors import UnavailableError
from shared.internal_auth import MAX_SIGNED_LIFETIME_S, InternalAuth, input_digest_off_loop
from shared.metrics import DecoderMetrics
from shared.proto import encoder_pb2

log = logging.getLogger(__name__)

CONNECT_RETRIES = 4  # Encode calls retried after a connect failure (with wait-for-ready this is rare)
RETRY_BASE_S = 0.1  # first retry after 0.05-0.1 s, doubling, jittered


class EncodeClient:
    """Encode calls to ``config.encoder_address`` (or the registry's encoders); names each request's cross-KV transfer.

    Args:
        config: ``encoder_address``, ``model``, ``encode_timeout_s``, ``kv_transfer_timeout_s``; registry mode:
            ``redis_url``, ``redis_password_file``, ``lease_ttl_s``, ``kv_transport`` (``EncoderPool``).
        pool: this decoder's cross-KV pool (``shared.kv_transport.create_pool``): its ``spec`` is the
            transfer target, ``expect`` / ``cancel`` announce and retire a transfer.
        metrics: Encode round trip and transfer size / time are observed here.
    """

    def __init__(self, config: DecoderServiceConfig, pool, metrics: DecoderMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.transfer_ids = itertools.count(1)  # names each request's cross-KV transfer (torch_dist)
        self.encoders = EncoderPool(config)  # the static address, or the registry's replicas (started lazily)
        # The deployment's internal token: sent with every Encode, and signs each reserved KV target (never logged).
        self.auth = InternalAuth.from_file(config.internal_token_file, "decoder")

    async def probe(self) -> str | None:
        """Static: asks the encoder's gRPC health for ``encdec.v1.EncoderService`` within a second. Registry: whether
        some encoder replica can be picked (``EncoderPool.probe``).

        Returns:
            None when an encoder can serve, else why not (unreachable, not serving, not an encoder, none
            registered), naming its address.
        """
        if self.encoders.static:
            return await health_reason(self.encoders.static_target)
        return await self.encoders.probe()

    async def encode(
        self,
        request_id: str,
        inp: RequestInput,
        block_ids: list[int],
        deadline: float | None = None,
        priority: int = 0,
        arrival_s: float = 0.0,
    ) -> None:
        """Has the encoder fill ``block_ids`` (in order) with the cross-attention KV of ``inp``.

        ``deadline``: the request's own (``time.monotonic()`` seconds, from its gRPC deadline), if any; the
        call waits for the encoder's channel until the earlier of it and ``encode_timeout_s``.
        ``priority`` / ``arrival_s``: the request's scheduling priority and arrival (seconds since the epoch), the
        order the encoder takes pending Encodes in (``encoder_svc.server.encode_order``).

        Once this returns or raises, no write for the request can still land in
        the pool, so its blocks may be freed. After a timeout that rests on the
        encoder: it starts no in-place (shm / cuda_ipc) write later than
        ``encoder_svc.batcher.WRITE_MARGIN_S`` before the call's deadline.

        Raises:
            UnavailableError: the encoder failed, stayed unreachable or gave no answer within ``encode_timeout_s``
                seconds (or before ``deadline``), or the cross KV did not arrive within ``kv_transfer_timeout_s``
                seconds after its answer.
        """
        spec = self.pool.spec
        target = encoder_pb2.KVTarget(
            transport=spec.transport,
            segment=spec.segment,
            shape=spec.shape,
            dtype=spec.dtype,
            instance_id=spec.instance_id,
        )
        transfer_id = next(self.transfer_ids)
        source = inp.encoder_source()
        signed = await self._signature(request_id, transfer_id, block_ids, target, source, deadline)
        arrival = self.pool.expect(transfer_id, block_ids)
        try:
            encode_start = time.monotonic()
            response = await self._call_encode(
                encoder_pb2.EncodeRequest(
                    request_id=request_id,
                    model=self.config.model,
                    block_ids=block_ids,
                    target=target,
                    transfer_id=transfer_id,
                    priority=priority,
                    arrival_s=arrival_s,
                    **signed,
                    **source,
                ),
                deadline,
                metadata=self.auth.metadata,
            )
            nbytes, ms = response.transfer_bytes, response.transfer_ms
            if arrival is not None:
                timeout_s = self.config.kv_transfer_timeout_s
                try:
                    stats = await asyncio.wait_for(asyncio.wrap_future(arrival), timeout_s)
                except TimeoutError as exc:
                    raise UnavailableError(
                        f"cross KV did not arrive within kv_transfer_timeout_s={timeout_s:g} s"
                    ) from exc
                nbytes, ms = stats.nbytes, stats.ms
            log.info(
                "cross KV for %s: %d bytes in %.2f ms (%s, encoder batch %d)",
                request_id,
                nbytes,
                ms,
                spec.transport,
                response.batch_size,
            )
            self.metrics.encode.observe(time.monotonic() - encode_start)
            self.metrics.observe_transfer(nbytes, ms)
        finally:
            if arrival is not None:  # blocks until no scatter for this transfer is in flight
                await asyncio.to_thread(self.pool.cancel, transfer_id)

    async def _signature(
        self, request_id: str, transfer_id: int, block_ids: list[int], target, source: dict, deadline: float | None
    ) -> dict:
        """``{"target_mac", "expires_s"}`` of one Encode (``shared.internal_auth``): the target signed with the
        input's digest, valid until the call's own end (the earlier of ``encode_timeout_s`` and ``deadline``);
        ``{}`` without an internal token. A large input is hashed off the event loop."""
        if not self.auth.enabled:
            return {}
        left_s = self.config.encode_timeout_s
        if deadline is not None:
            left_s = min(left_s, max(deadline - time.monotonic(), 0.0))
        expires_s = time.time() + min(left_s, MAX_SIGNED_LIFETIME_S)
        digest = await input_digest_off_loop(**source)
        mac = self.auth.sign_target(
            request_id, transfer_id, block_ids, target, self.config.model, digest=digest, expires_s=expires_s
        )
        return {"target_mac": mac, "expires_s": expires_s}

    async def _call_encode(self, request: encoder_pb2.EncodeRequest, deadline: float | None, **call_options):
        """One Encode RPC, waiting for the channel to be ready until the earlier of ``encode_timeout_s`` and
        ``deadline``; a call that failed to connect is retried (at most ``CONNECT_RETRIES`` times, jittered
        exponential backoff) while time is left. ``call_options`` go to the stub call (e.g. ``metadata``).

        Raises:
            UnavailableError: the encoder failed, stayed unreachable or did not answer in time (the message says
                which, names the encoder's address and the limit that ran out).
        """
        timeout_s = self.config.encode_timeout_s
        end, limit = time.monotonic() + timeout_s, f"encode_timeout_s={timeout_s:g} s"
        if deadline is not None and deadline < end:
            end, limit = deadline, "the request's deadline"
        if not self.encoders.static:
            return await self._call_picked(request, end, limit, **call_options)
        target = self.encoders.static_target
        address = target.address
        for attempt in range(CONNECT_RETRIES + 1):
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            try:
                return await target.stub.Encode(request, timeout=remaining, wait_for_ready=True, **call_options)
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break
                if code == grpc.StatusCode.UNAVAILABLE and _not_sent(details):
                    if attempt < CONNECT_RETRIES:  # nothing was sent: the same call may go again
                        delay = RETRY_BASE_S * 2**attempt * random.uniform(0.5, 1.0)
                        await asyncio.sleep(max(min(delay, end - time.monotonic()), 0.0))
                        continue
                    raise UnavailableError(
                        f"encoder at {address} is unreachable ({details}); retry later or send the request to "
                        "another replica"
                    ) from None
                raise UnavailableError(f"encoder failed: {code.name}: {details}") from None
        # Out of time. Name the limit, not gRPC's "Deadline Exceeded"; say whether a connection was ever there.
        if target.channel.get_state() != grpc.ChannelConnectivity.READY:
            raise UnavailableError(
                f"encoder at {address} is unreachable: no connection within {limit}; retry later or send the "
                "request to another replica"
            )
        raise UnavailableError(f"encoder failed: no answer within {limit} (encoder overloaded or hung)")

    async def _call_picked(self, request: encoder_pb2.EncodeRequest, end: float, limit: str, **call_options):
        """Registry mode: Encode on a picked encoder, without wait-for-ready; one that fails to connect is marked
        failed and the call goes to the next candidate at once.

        Raises:
            UnavailableError: no candidate is left, the encoder failed mid-call (named: id and address) or did not
                answer before ``end`` (``limit`` names it).
        """
        tried: set[str] = set()
        while (remaining := end - time.monotonic()) > 0:
            try:  # the first pick waits for the first read of the registry
                target: EncoderTarget = await asyncio.wait_for(self.encoders.pick(exclude=tried), remaining)
            except TimeoutError:
                break
            try:
                with self.encoders.calling(target):
                    timeout = max(end - time.monotonic(), 0.001)
                    return await target.stub.Encode(request, timeout=timeout, wait_for_ready=False, **call_options)
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise UnavailableError(
                        f"{target.name} gave no answer within {limit} (encoder overloaded or hung); retry the request"
                    ) from None
                if code in MISCONFIGURED:  # refused before any work: not an encoder of ours; try the next one
                    self.encoders.mark_failed(target, f"{code.name}: {details}", until_registered_again=True)
                    tried.add(target.replica_id)
                    continue
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise UnavailableError(f"{target.name} failed: {code.name}: {details}") from None
                if _not_sent(details):
                    self.encoders.mark_failed(target, details)
                    tried.add(target.replica_id)
                    continue
                # Mid-call: the encoder died, or answered UNAVAILABLE itself; only a dead one is skipped from now on.
                if (reason := await health_reason(target)) is not None:
                    self.encoders.mark_failed(target, reason)
                raise UnavailableError(f"{target.name} failed: {details}; retry the request") from None
        raise UnavailableError(f"no encoder answered within {limit}; retry the request")

    async def close(self) -> None:
        await self.encoders.close()


# Answers of a registered "encoder" that can never serve this decoder, given before it does any work: another
# service at that address (UNIMPLEMENTED), another deployment's internal token (UNAUTHENTICATED, PERMISSION_DENIED),
# another model (NOT_FOUND). Registry mode skips such a replica until it registers again under a new id.
MISCONFIGURED = frozenset(
    {
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.NOT_FOUND,
    }
)


def _not_sent(details: str) -> bool:
    """True for gRPC's UNAVAILABLE of a call that never reached the peer (no connection: nothing was sent)."""
    return "failed to connect" in details.lower()
