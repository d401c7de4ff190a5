"""Starting the decoder service: load the model, size and create the KV pools, build the engine, serve.

``run`` is what ``encdec serve-decoder`` calls; the servicer itself (what each
RPC does) is ``decoder_svc.server.DecoderServicer``.
"""

from __future__ import annotations

import asyncio
import logging

from decoder_svc.engine import DecoderEngine
from decoder_svc.kv_budget import block_bytes, resolve_budget, size_kv_cache
from decoder_svc.readiness import DecoderReadiness
from decoder_svc.request_state import RequestStateStore
from decoder_svc.server import DecoderServicer
from shared.compute_thread import single_threaded_main
from shared.config import DecoderServiceConfig
from shared.device import resolve_device, torch_dtype
from shared.grpc_server import serve
from shared.kv_transport import create_pool
from shared.metrics import start_metrics_server
from shared.models.quantize import apply_quantization
from shared.models.registry import load_model, load_tokenizer
from shared.proto import decoder_pb2_grpc

__all__ = ["KV_DTYPE_BYTES", "build_engine", "run"]

log = logging.getLogger(__name__)

KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def build_engine(config: DecoderServiceConfig, model):
    """Creates the cross-KV pool (shared with the encoder) and the engine over it.

    ``model`` is already on ``config.device``; the pool goes on ``kv_device``
    (the same device, as the config enforces) and the engine's self cache
    beside it. Pool sizes come from ``decoder_svc.kv_budget.size_kv_cache`` (explicit
    block counts, else ``kv_cache_memory``, else ``max_num_seqs``) and are
    logged with the max number of concurrent max-length requests.

    Raises:
        ValueError: ``kv_cache_memory`` cannot hold one max-length request.
    """
    cfg = model.config
    cross_dtype_bytes = KV_DTYPE_BYTES[config.kv_transfer_dtype]
    self_dtype_bytes = 4 if config.kv_device == "cpu" else cross_dtype_bytes  # as ModelRunner allocates the self cache
    sizing = size_kv_cache(
        self_block_bytes=block_bytes(
            cfg.decoder_layers, config.block_size, cfg.num_heads, cfg.head_dim, self_dtype_bytes
        ),
        cross_block_bytes=block_bytes(
            cfg.decoder_layers, config.block_size, cfg.num_heads, cfg.head_dim, cross_dtype_bytes
        ),
        block_size=config.block_size,
        max_decoder_len=min(model.generation.max_length, cfg.max_target_positions),
        max_encoder_len=cfg.max_source_positions,
        max_num_seqs=config.max_num_seqs,
        budget_bytes=resolve_budget(config.kv_cache_memory, config.kv_device),  # both caches live on kv_device
        num_self_blocks=config.num_self_blocks,
        num_cross_blocks=config.num_cross_blocks,
    )
    num_self, num_cross = sizing.num_self_blocks, sizing.num_cross_blocks
    pool = create_pool(
        config.kv_transport,
        (cfg.decoder_layers, 2, num_cross, config.block_size, cfg.num_heads, cfg.head_dim),
        config.kv_transfer_dtype,
        **_pool_options(config),
    )
    engine = DecoderEngine(
        model,
        load_tokenizer(config.model),
        pool.tensor,
        num_self_blocks=num_self,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        attention_backend=config.attention_backend,
    )
    log.info("%s; %d tokens per block (%s)", sizing.describe(config.max_num_seqs), config.block_size, pool.spec.segment)
    return engine, pool


def _pool_options(config: DecoderServiceConfig) -> dict:
    """Transport-specific keyword options of the cross-KV pool."""
    if config.kv_transport == "torch_dist":
        return dict(
            address=config.kv_dist_address,
            backend=config.kv_dist_backend,
            device=config.kv_device,
            timeout_s=config.kv_transfer_timeout_s,
        )
    if config.kv_transport == "cuda_ipc":
        return dict(device=config.kv_device)  # must be a CUDA device; CudaIpcCrossKVPool says so otherwise
    return {}


def run(config: DecoderServiceConfig) -> None:
    """Loads the model onto ``config.device``, creates the KV pools there and serves until SIGINT/SIGTERM.

    Raises:
        ValueError: ``device`` names a GPU this machine does not have (``shared.device.resolve_device``).
    """
    threads = single_threaded_main(config.num_threads)  # loading stays on one thread; the engine thread gets these
    device = resolve_device(config.device)  # before anything is loaded: a missing GPU fails fast
    model = load_model(config.model, torch_dtype(config.dtype))
    apply_quantization(model, config.quantize, "decoder")  # CPU only (the config refuses int8 on CUDA)
    model.to(device)  # before the KV pools are sized: a fractional kv_cache_memory sees the weights' memory taken
    if config.quantize == "none" and (packed := model.pack_decode_weights()):  # CPU float32: kernels/packed_linear.py
        log.info("decode-step weights packed for the CPU kernel (+%.0f MB)", packed / 2**20)
    log.info(
        "decoder model %s on %s (%s%s), attention %s, stream interval %d",
        config.model,
        device,
        config.dtype,
        ", int8 linears" if config.quantize == "int8" else "",
        config.attention_backend,
        config.stream_interval,
    )
    store = RequestStateStore(config.redis_url)
    store.ping()
    engine, pool = build_engine(config, model)

    async def main() -> None:
        servicer = DecoderServicer(config, model, engine, pool, store, threads)
        servicer.start()
        sessions = servicer.sessions
        servicer.readiness = DecoderReadiness(store, sessions.encoder, sessions.flush_unrecorded)
        start_metrics_server(config.metrics_port, config.host, servicer.metrics.registry)

        async def on_stop() -> None:
            await servicer.close()
            pool.close()

        await serve(
            lambda server: decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, server),
            ["encdec.v1.DecoderService"],
            f"{config.host}:{config.port}",
            on_stop,
            drain=lambda: servicer.drain(config.shutdown_grace_s),
            # health NOT_SERVING while Redis or the encoder does not answer
            readiness=servicer.readiness,
        )

    try:
        asyncio.run(main())
    finally:
        pool.close()
