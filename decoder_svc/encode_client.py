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
(``RECONNECT_OPTIONS``). ``probe`` asks the encoder's standard gRPC health
(the decoder's readiness, ``decoder_svc.readiness``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decoder_svc.inputs import RequestInput
from shared.config import DecoderServiceConfig
from shared.errors import UnavailableError
from shared.grpc_server import GRPC_OPTIONS
from shared.internal_auth import InternalAuth
from shared.metrics import DecoderMetrics
from shared.proto import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)

ENCODER_SERVICE = "encdec.v1.EncoderService"  # the name an encoder's health reports SERVING
PROBE_TIMEOUT_S = 1.0  # the readiness probe's health Check
# gRPC's default reconnect backoff grows to 120 s (1 s initial, x1.6, jittered): after an encoder restart the
# channel could stay in TRANSIENT_FAILURE for seconds after the encoder is back. A local peer is cheap to retry.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CONNECT_RETRIES = 4  # Encode calls retried after a connect failure (with wait-for-ready this is rare)
RETRY_BASE_S = 0.1  # first retry after 0.05-0.1 s, doubling, jittered


class EncodeClient:
    """One channel to ``config.encoder_address``; names each request's cross-KV transfer.

    Args:
        config: ``encoder_address``, ``model``, ``encode_timeout_s``, ``kv_transfer_timeout_s``.
        pool: this decoder's cross-KV pool (``shared.kv_transport.create_pool``): its ``spec`` is the
            transfer target, ``expect`` / ``cancel`` announce and retire a transfer.
        metrics: Encode round trip and transfer size / time are observed here.
    """

    def __init__(self, config: DecoderServiceConfig, pool, metrics: DecoderMetrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.transfer_ids = itertools.count(1)  # names each request's cross-KV transfer (torch_dist)
        self.channel = grpc.aio.insecure_channel(config.encoder_address, options=GRPC_OPTIONS + RECONNECT_OPTIONS)
        self.stub = encoder_pb2_grpc.EncoderServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        # The deployment's internal token: sent with every Encode, and signs each reserved KV target (never logged).
        self.auth = InternalAuth.from_file(config.internal_token_file, "decoder")

    async def probe(self) -> str | None:
        """Asks the encoder's gRPC health for ``ENCODER_SERVICE`` within ``PROBE_TIMEOUT_S`` seconds.

        Returns:
            None when the encoder reports SERVING, else why this decoder cannot use it (unreachable, not
            serving, or not an encoder), naming its address.
        """
        address = self.config.encoder_address
        try:
            response = await self.health.Check(
                health_pb2.HealthCheckRequest(service=ENCODER_SERVICE), timeout=PROBE_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return f"the service at {address} is not an encoder (its health does not know {ENCODER_SERVICE})"
            return f"encoder at {address} is unreachable ({exc.code().name}: {exc.details()})"
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            return f"encoder at {address} reports {name}"
        return None

    async def encode(
        self, request_id: str, inp: RequestInput, block_ids: list[int], deadline: float | None = None
    ) -> None:
        """Has the encoder fill ``block_ids`` (in order) with the cross-attention KV of ``inp``.

        ``deadline``: the request's own (``time.monotonic()`` seconds, from its gRPC deadline), if any; the
        call waits for the encoder's channel until the earlier of it and ``encode_timeout_s``.

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
                    target_mac=self.auth.sign_target(request_id, transfer_id, block_ids, target, self.config.model),
                    **inp.encoder_source(),
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
        address = self.config.encoder_address
        for attempt in range(CONNECT_RETRIES + 1):
            remaining = end - time.monotonic()
            if remaining <= 0:
                break
            try:
                return await self.stub.Encode(request, timeout=remaining, wait_for_ready=True, **call_options)
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break
                if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
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
        if self.channel.get_state() != grpc.ChannelConnectivity.READY:
            raise UnavailableError(
                f"encoder at {address} is unreachable: no connection within {limit}; retry later or send the "
                "request to another replica"
            )
        raise UnavailableError(f"encoder failed: no answer within {limit} (encoder overloaded or hung)")

    async def close(self) -> None:
        await self.channel.close()
