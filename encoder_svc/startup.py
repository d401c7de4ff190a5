"""Starting the encoder service: load the model, build the transport writers and the batcher, serve.

``run`` is what ``encdec serve-encoder`` calls; the servicer itself (what each
RPC does) is ``encoder_svc.server.EncoderServicer``, or, for an encoder-only
model, ``encoder_svc.embed.server.EmbedServicer`` (started by
``encoder_svc.embed.startup.run``).
"""

from __future__ import annotations

import asyncio
import functools
import logging

import numpy as np
import torch

from encoder_svc.batcher import EncodeBatcher
from encoder_svc.server import EncoderServicer
from shared.compute_thread import single_threaded_main
from shared.config import EncoderServiceConfig
from shared.device import resolve_device
from shared.grpc_server import serve
from shared.internal_auth import InternalAuth, InternalTokenInterceptor
from shared.kv_transport import WriterSet
from shared.metrics import start_metrics_server
from shared.models.quantize import apply_quantization
from shared.models.registry import is_encoder_only, load_model_in
from shared.models.whisper_features import log_mel_spectrogram
from shared.proto import encoder_pb2_grpc
from shared.registration import serve_hooks, service_lease
from shared.registry import cuda_gpu_ids

__all__ = ["run"]

log = logging.getLogger(__name__)


def _warm_up(model, device: torch.device) -> None:
    """One encoder forward before reporting healthy, so the first request does not pay for it
    (nor, on a GPU, for CUDA context and kernel setup). On the batcher thread, with its torch threads:
    there the encoder's linears also measure oneDNN against ``F.linear`` (``use_onednn_encoder``)."""
    if getattr(model, "input_modality", "audio") != "audio":
        return
    if hasattr(model, "use_onednn_encoder"):
        log.info("encoder linears on oneDNN's packed product: %d", model.use_onednn_encoder())
    with torch.inference_mode():
        mels = _featurizer(model)(np.zeros(16000, dtype=np.float32))  # [num_mel_bins, 3000]
        model.compute_cross_kv(model.encode(mels[None].to(device)))


def _featurizer(model):
    """The checkpoint's log-mel features (80 bins; 128 for large-v3 / turbo)."""
    return functools.partial(log_mel_spectrogram, num_mel_bins=model.config.num_mel_bins)


def run(config: EncoderServiceConfig) -> None:
    """Loads the model and serves until SIGINT/SIGTERM: ``EncoderService`` for an
    encoder-decoder model, ``EmbedService`` for an encoder-only one.

    Raises:
        ValueError: ``device`` names a missing GPU, ``quantize`` is set for an encoder-only model, or
            ``internal_token_file`` holds no usable token (``shared.internal_auth``), or, with ``redis_url`` set,
            ``redis_password_file`` cannot be read or the port is 0 (``shared.registration.service_lease``).
        BindError: the port is taken (``shared.grpc_server.serve``).
    """
    threads = single_threaded_main(config.num_threads)  # loading stays on one thread; the batcher thread gets these
    device = resolve_device(config.device)  # ValueError (a clear one) when the GPU is missing
    if is_encoder_only(config.model):  # BERT family: EmbedService instead of Encode
        if config.quantize != "none":
            raise ValueError(
                f"quantize {config.quantize} is for encoder-decoder models only; the Embed service runs "
                f"{config.model} in {config.dtype}: use quantize none"
            )
        from encoder_svc.embed.startup import run as run_embed

        return run_embed(config, threads)
    auth = InternalAuth.from_file(config.internal_token_file, "encoder", create=True)  # before the model: fail fast
    transports = [t.strip() for t in config.kv_transport.split(",") if t.strip()]
    # Listed in the replica registry (config.redis_url set) from the first readiness probe to the shutdown.
    lease = service_lease(config, "encoder", transports, cuda_gpu_ids(device), load_fn=lambda: batcher.in_flight)
    model = load_model_in(config.model, config.dtype, device)  # bfloat16 on the CPU: mixed (shared.models.bfloat16)
    apply_quantization(model, config.quantize, "encoder")  # CPU only (the config refuses int8 on CUDA)
    model.to(device)
    log.info(
        "encoder model %s on %s (%s%s)",
        config.model,
        device,
        config.dtype,
        ", int8 linears" if config.quantize == "int8" else "",
    )
    max_batch_size = config.max_batch_size  # int8 too: its activation scales are per row (shared.models.quantize)
    writer = WriterSet(
        transports,
        {
            "torch_dist": dict(
                backend=config.kv_dist_backend,
                device=config.kv_device,
                timeout_s=config.kv_transfer_timeout_s,
                handshake_timeout_s=config.kv_dist_handshake_timeout_s,
                pair_key=auth.pair_key,
            )
        },
    )
    batcher = EncodeBatcher(
        model,
        _featurizer(model) if getattr(model, "input_modality", "audio") == "audio" else log_mel_spectrogram,
        writer,
        max_batch_size,
        config.batch_wait_ms,
        threads,
        warm_up=lambda: _warm_up(model, device),
        max_batch_tokens=config.max_batch_tokens,
        max_batch_wait_ms=config.max_batch_wait_ms,
    )
    servicer = EncoderServicer(config, model, batcher, auth)
    start_metrics_server(config.metrics_port, config.metrics_host or config.host, servicer.metrics.registry)

    async def on_stop() -> None:
        batcher.stop()
        writer.close()

    asyncio.run(
        serve(
            lambda server: encoder_pb2_grpc.add_EncoderServiceServicer_to_server(servicer, server),
            ["encdec.v1.EncoderService"],
            f"{config.host}:{config.port}",
            on_stop,
            **serve_hooks(lease),
            config=config,
            public=False,  # Encode is internal: its own token (shared.internal_auth); TLS with --tls-cert
            # The internal token checked at each call's headers, before its body is read.
            extra_interceptors=[InternalTokenInterceptor(auth)] if auth.enabled else None,
        )
    )
