"""The decoder's client of the encoder's internal Encode RPC, and the wait for the cross KV to arrive.

``EncodeClient.encode`` asks the encoder service to fill a request's reserved
cross blocks in this decoder's pool (``shared.kv_transport``) and returns
once no write for that transfer can still land: with an in-place transport
(shm, cuda_ipc) the encoder has written the blocks when Encode answers; with
one that delivers on its own connection (torch_dist) the transfer is
announced first (``pool.expect``) and awaited after Encode answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import grpc

from decoder_svc.inputs import RequestInput
from shared.config import DecoderServiceConfig
from shared.errors import UnavailableError
from shared.grpc_server import GRPC_OPTIONS
from shared.metrics import DecoderMetrics
from shared.proto import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)


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
        self.channel = grpc.aio.insecure_channel(config.encoder_address, options=GRPC_OPTIONS)
        self.stub = encoder_pb2_grpc.EncoderServiceStub(self.channel)

    async def encode(self, request_id: str, inp: RequestInput, block_ids: list[int]) -> None:
        """Has the encoder fill ``block_ids`` (in order) with the cross-attention KV of ``inp``.

        Once this returns or raises, no write for the request can still land in
        the pool, so its blocks may be freed. After a timeout that rests on the
        encoder: it starts no in-place (shm / cuda_ipc) write later than
        ``encoder_svc.batcher.WRITE_MARGIN_S`` before the call's deadline.

        Raises:
            UnavailableError: the encoder failed or gave no answer within ``encode_timeout_s`` seconds, or the
                cross KV did not arrive within ``kv_transfer_timeout_s`` seconds after its answer.
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
            response = await self.stub.Encode(
                encoder_pb2.EncodeRequest(
                    request_id=request_id,
                    model=self.config.model,
                    block_ids=block_ids,
                    target=target,
                    transfer_id=transfer_id,
                    **inp.encoder_source(),
                ),
                timeout=self.config.encode_timeout_s,
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
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # name the setting, not gRPC's "Stream removed"
                raise UnavailableError(
                    f"encoder failed: no answer within encode_timeout_s={self.config.encode_timeout_s:g} s "
                    "(encoder overloaded or hung)"
                ) from None
            raise UnavailableError(f"encoder failed: {exc.code().name}: {exc.details()}") from None
        finally:
            if arrival is not None:  # blocks until no scatter for this transfer is in flight
                await asyncio.to_thread(self.pool.cancel, transfer_id)

    async def close(self) -> None:
        await self.channel.close()
