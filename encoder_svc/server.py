"""The encoder service's RPCs: gRPC ``EncoderService`` over an ``EncodeBatcher``.

``EncoderServicer.Encode`` checks the caller's internal token and the signature
of its KV target (``shared.internal_auth``), checks and converts the request
into an ``EncodeItem``, reaches a torch_dist target's decoder off the batcher
thread, submits the item to the batcher and converts the result back. Errors raised here become
status codes in ``shared.grpc_server.ErrorStatusInterceptor``. Loading the model
and serving: ``encoder_svc.startup``.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import Future

import numpy as np

from encoder_svc.batcher import WRITE_MARGIN_S, EncodeBatcher, EncodeItem
from shared.config import EncoderServiceConfig
from shared.errors import InvalidRequestError, NotFoundError
from shared.internal_auth import InternalAuth, input_digest_off_loop
from shared.kv_transport import KVTargetSpec, WriterSet
from shared.metrics import EncoderMetrics
from shared.models.registry import model_names
from shared.proto import encoder_pb2, encoder_pb2_grpc

FEATURE_FRAMES = 3000  # log-mel frames of Whisper's 30 s window (10 ms hop)


def encode_order(request) -> tuple:
    """The batcher's order of an Encode (``EncodeItem.order``): lower priority first, then the earlier arrival of
    its Generate request (every window of a long-form request keeps its request's: first come first served)."""
    return (request.priority, request.arrival_s)


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    """Thin servicer: validate and convert, submit to the batcher, convert back."""

    def __init__(
        self, config: EncoderServiceConfig, model, batcher: EncodeBatcher, auth: InternalAuth | None = None
    ) -> None:
        self.config = config
        self.auth = auth or InternalAuth(None)
        self.model = model
        self.batcher = batcher
        self.metrics = EncoderMetrics()
        self.writers: WriterSet = batcher.writer
        self.served_names = model_names(config.model)

    def _item(self, request: encoder_pb2.EncodeRequest) -> EncodeItem:
        if request.model and request.model not in self.served_names:
            raise NotFoundError(
                f"model {request.model!r} is not served here; this encoder serves {self.config.model!r}"
            )
        text_model = getattr(self.model, "input_modality", "audio") == "text"
        if text_model:
            if not request.input_ids:
                raise InvalidRequestError("this model encodes token ids: set input_ids")
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in request.input_ids):
                raise InvalidRequestError(f"input_ids must be in [0, {vocab})")
        elif request.features:
            want = self.model.config.num_mel_bins * FEATURE_FRAMES * 4
            if len(request.features) != want or request.pcm:
                raise InvalidRequestError(
                    f"features must be [{self.model.config.num_mel_bins}, {FEATURE_FRAMES}] float32 ({want} bytes) "
                    f"without pcm, got {len(request.features)} bytes"
                )
        elif not request.pcm or len(request.pcm) % 4:
            raise InvalidRequestError(f"pcm must be non-empty float32 bytes, got {len(request.pcm)} bytes")
        target = request.target
        spec = KVTargetSpec(target.transport, target.segment, tuple(target.shape), target.dtype, target.instance_id)
        spec.validate()  # ValueError -> INVALID_ARGUMENT before any shape is used
        self.writers.check(spec)
        if request.transfer_id >= 2**63:
            raise InvalidRequestError(f"transfer_id {request.transfer_id} does not fit int64")
        cfg = self.model.config
        expected = (cfg.decoder_layers, 2, cfg.num_heads, cfg.head_dim)
        if len(spec.shape) != 6 or (spec.shape[0], spec.shape[1], spec.shape[4], spec.shape[5]) != expected:
            raise InvalidRequestError(
                f"KV target shape {list(spec.shape)} does not fit this model: expected "
                f"[{expected[0]}, 2, num_blocks, block_size, {expected[2]}, {expected[3]}]"
            )
        encoder_len = len(request.input_ids) if text_model else cfg.max_source_positions
        if encoder_len > cfg.max_source_positions:
            raise InvalidRequestError(
                f"source has {encoder_len} tokens; this model accepts at most {cfg.max_source_positions}"
            )
        needed = math.ceil(encoder_len / spec.shape[3])
        if len(request.block_ids) != needed:
            raise InvalidRequestError(
                f"{encoder_len} encoder positions need {needed} blocks, got {len(request.block_ids)}"
            )
        common = dict(transfer_id=request.transfer_id, order=encode_order(request))
        if text_model:
            return EncodeItem(request.request_id, None, spec, list(request.block_ids), input_ids=list(request.input_ids),
                              **common)  # fmt: skip
        if request.features:
            features = np.frombuffer(request.features, dtype="<f4").astype(np.float32)
            features = features.reshape(self.model.config.num_mel_bins, FEATURE_FRAMES)
            if not np.isfinite(features).all():
                raise InvalidRequestError("features contain NaN or infinite values")
            return EncodeItem(request.request_id, None, spec, list(request.block_ids), features=features, **common)
        pcm = np.frombuffer(request.pcm, dtype="<f4").astype(np.float32)
        return EncodeItem(request.request_id, pcm, spec, list(request.block_ids), **common)

    async def _connect(self, spec: KVTargetSpec) -> None:
        """Reaches a target's decoder (torch_dist) on a thread of its own, off the batcher and the event loop: a
        target that accepts and stays silent fails its own request after ``kv_dist_handshake_timeout_s``."""
        if self.writers.connected(spec):
            return
        done: Future = Future()

        def connect() -> None:
            try:
                self.writers.connect(spec)
                done.set_result(None)
            except BaseException as exc:  # noqa: BLE001 - raised again in the awaiting handler
                done.set_exception(exc)

        threading.Thread(target=connect, name="kv-connect", daemon=True).start()
        await asyncio.wrap_future(done)

    async def Encode(self, request, context):
        try:
            # Before any work: the token, then the signature of what the caller claims a decoder reserved.
            self.auth.check_metadata(context.invocation_metadata())
            if self.auth.enabled:
                self.auth.verify_target(
                    request.target_mac,
                    request.request_id,
                    request.transfer_id,
                    request.block_ids,
                    request.target,
                    request.model,
                    digest=await input_digest_off_loop(request.pcm, request.features, request.input_ids),
                    expires_s=request.expires_s,
                )
            item = self._item(request)
            await self._connect(item.spec)
            remaining = context.time_remaining()  # seconds to the caller's deadline; None without one
            if remaining is not None:
                item.write_deadline = time.monotonic() + remaining - WRITE_MARGIN_S
            encoder_len, encode_ms, batch_size, stats = await asyncio.wrap_future(self.batcher.submit(item))
        except Exception:
            self.metrics.requests.labels(outcome="error").inc()
            raise  # ErrorStatusInterceptor turns it into the status code
        self.metrics.observe_encode(encode_ms, batch_size, stats.nbytes, stats.ms)
        return encoder_pb2.EncodeResponse(
            request_id=request.request_id,
            encoder_len=encoder_len,
            encode_ms=encode_ms,
            batch_size=batch_size,
            transfer_bytes=stats.nbytes,
            transfer_ms=stats.ms,
        )
