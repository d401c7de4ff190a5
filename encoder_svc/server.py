"""The encoder service process: gRPC ``EncoderService`` over an ``EncodeBatcher``."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import numpy as np
import torch

from encoder_svc.batcher import WRITE_MARGIN_S, EncodeBatcher, EncodeItem
from shared.compute_thread import single_threaded_main
from shared.config import EncoderServiceConfig
from shared.device import resolve_device, torch_dtype
from shared.errors import InvalidRequestError, NotFoundError
from shared.grpc_server import abort_with, serve
from shared.kv_transport import KVTargetSpec, WriterSet
from shared.metrics import EncoderMetrics, start_metrics_server
from shared.models.quantize import apply_quantization
from shared.models.registry import is_encoder_only, load_model, model_names
from shared.models.whisper_features import log_mel_spectrogram
from shared.proto import encoder_pb2, encoder_pb2_grpc

log = logging.getLogger(__name__)


class EncoderServicer(encoder_pb2_grpc.EncoderServiceServicer):
    """Thin servicer: validate and convert, submit to the batcher, convert back."""

    def __init__(self, config: EncoderServiceConfig, model, batcher: EncodeBatcher) -> None:
        self.config = config
        self.model = model
        self.batcher = batcher
        self.metrics = EncoderMetrics()
        self.writers: WriterSet = batcher.writer
        self.served_names = model_names(config.model)

    def _item(self, request: encoder_pb2.EncodeRequest) -> EncodeItem:
        if request.model and request.model not in self.served_names:
            raise NotFoundError(f"model {request.model!r} is not served here; this encoder serves {self.config.model!r}")
        text_model = getattr(self.model, "input_modality", "audio") == "text"
        if text_model:
            if not request.input_ids:
                raise InvalidRequestError("this model encodes token ids: set input_ids")
            vocab = self.model.config.vocab_size
            if any(not 0 <= t < vocab for t in request.input_ids):
                raise InvalidRequestError(f"input_ids must be in [0, {vocab})")
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
            raise InvalidRequestError(f"source has {encoder_len} tokens; this model accepts at most {cfg.max_source_positions}")
        needed = math.ceil(encoder_len / spec.shape[3])
        if len(request.block_ids) != needed:
            raise InvalidRequestError(f"{encoder_len} encoder positions need {needed} blocks, got {len(request.block_ids)}")
        if text_model:
            return EncodeItem(request.request_id, None, spec, list(request.block_ids), input_ids=list(request.input_ids),
                              transfer_id=request.transfer_id)
        pcm = np.frombuffer(request.pcm, dtype="<f4").astype(np.float32)
        return EncodeItem(request.request_id, pcm, spec, list(request.block_ids), transfer_id=request.transfer_id)

    async def Encode(self, request, context):
        try:
            item = self._item(request)
            remaining = context.time_remaining()  # seconds to the caller's deadline; None without one
            if remaining is not None:
                item.write_deadline = time.monotonic() + remaining - WRITE_MARGIN_S
            encoder_len, encode_ms, batch_size, stats = await asyncio.wrap_future(self.batcher.submit(item))
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            self.metrics.requests.labels(outcome="error").inc()
            await abort_with(context, exc)
        self.metrics.observe_encode(encode_ms, batch_size, stats.nbytes, stats.ms)
        return encoder_pb2.EncodeResponse(
            request_id=request.request_id, encoder_len=encoder_len, encode_ms=encode_ms, batch_size=batch_size,
            transfer_bytes=stats.nbytes, transfer_ms=stats.ms,
        )


def _warm_up(model, device: torch.device) -> None:
    """One encoder forward before reporting healthy, so the first request does not pay for it
    (nor, on a GPU, for CUDA context and kernel setup)."""
    if getattr(model, "input_modality", "audio") != "audio":
        return
    with torch.inference_mode():
        model.compute_cross_kv(model.encode(log_mel_spectrogram(np.zeros(16000, dtype=np.float32))[None].to(device)))


def run(config: EncoderServiceConfig) -> None:
    """Loads the model and serves until SIGINT/SIGTERM: ``EncoderService`` for an
    encoder-decoder model, ``EmbedService`` for an encoder-only one."""
    threads = single_threaded_main(config.num_threads)  # loading stays on one thread; the batcher thread gets these
    device = resolve_device(config.device)  # ValueError (a clear one) when the GPU is missing
    if is_encoder_only(config.model):  # BERT family: EmbedService instead of Encode
        if config.quantize != "none":
            raise ValueError(f"quantize {config.quantize} is for Whisper models only; the Embed service runs "
                             f"{config.model} in {config.dtype}: use quantize none")
        from encoder_svc.embed_servicer import run_embed

        return run_embed(config, threads)
    model = load_model(config.model, torch_dtype(config.dtype))
    apply_quantization(model, config.quantize, "encoder")  # CPU only (the config refuses int8 on CUDA)
    model.to(device)
    log.info("encoder model %s on %s (%s%s)", config.model, device, config.dtype, ", int8 linears" if config.quantize == "int8" else "")
    max_batch_size = config.max_batch_size  # int8 too: its activation scales are per row (shared.models.quantize)
    writer = WriterSet(
        [t.strip() for t in config.kv_transport.split(",") if t.strip()],
        {"torch_dist": dict(backend=config.kv_dist_backend, device=config.kv_device, timeout_s=config.kv_transfer_timeout_s)},
    )
    batcher = EncodeBatcher(model, log_mel_spectrogram, writer, max_batch_size, config.batch_wait_ms, threads,
                            warm_up=lambda: _warm_up(model, device), max_batch_tokens=config.max_batch_tokens,
                            max_batch_wait_ms=config.max_batch_wait_ms)
    servicer = EncoderServicer(config, model, batcher)
    start_metrics_server(config.metrics_port, config.host, servicer.metrics.registry)

    async def on_stop() -> None:
        batcher.stop()
        writer.close()

    asyncio.run(
        serve(
            lambda server: encoder_pb2_grpc.add_EncoderServiceServicer_to_server(servicer, server),
            ["encdec.v1.EncoderService"],
            f"{config.host}:{config.port}",
            on_stop,
        )
    )
