"""Starting the decoder service: load the model, size and create the KV pools, build the engine, serve.

``run`` is what ``encdec serve-decoder`` calls; the servicer itself (what each
RPC does) is ``decoder_svc.server.DecoderServicer``.

As a replica (``Replica``): the decoder registers in the Redis registry under a
lease (``shared.registration``; load = running + waiting sequences) once the
server serves, and deregisters once the shutdown's drain ended its requests; the records it creates
name it as their owner; it listens for Aborts other replicas forward
(``decoder_svc.replicas.replica_control``) and fails the requests of decoders whose
lease expired (``decoder_svc.replicas.lost_replicas``).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from decoder_svc.core.engine import DecoderEngine
from decoder_svc.core.kv_budget import block_bytes, resolve_budget, size_kv_cache
from decoder_svc.core.model_runner import self_cache_dtype
from decoder_svc.replicas.lost_replicas import LostDecoderReaper, RedisUptime
from decoder_svc.replicas.replica_control import ReplicaControl
from decoder_svc.replicas.request_state import RequestStateStore
from decoder_svc.server import DecoderServicer
from decoder_svc.session.readiness import DecoderReadiness
from decoder_svc.whisper.options import warm_audio_front_end
from kernels.calibration import calibrate_packed_isa
from shared.compute_thread import single_threaded_main
from shared.config import DecoderServiceConfig
from shared.device import resolve_device, torch_dtype
from shared.grpc_server import serve
from shared.internal_auth import InternalAuth, read_token_file
from shared.kv_transport import create_pool
from shared.metrics import start_metrics_server
from shared.models.linear import products_dtype
from shared.models.quantize import apply_quantization
from shared.models.registry import load_model_in, load_tokenizer
from shared.proto import decoder_pb2_grpc
from shared.public_port import public_port_security
from shared.redis_url import resolve_redis_url
from shared.registration import service_lease
from shared.registry import cuda_gpu_ids

__all__ = ["KV_DTYPE_BYTES", "build_engine", "run"]

log = logging.getLogger(__name__)

KV_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def build_engine(config: DecoderServiceConfig, model):
    """Creates the cross-KV pool (shared with the encoder) and the engine over it.

    ``model`` is already on ``config.device``; the pool goes on ``kv_device``
    (the same device, as the config enforces) and the engine's self cache
    beside it. Pool sizes come from ``decoder_svc.core.kv_budget.size_kv_cache`` (explicit
    block counts, else ``kv_cache_memory``, else ``max_num_seqs``) and are
    logged with the max number of concurrent max-length requests.

    Raises:
        ValueError: ``kv_cache_memory`` cannot hold one max-length request.
    """
    cfg = model.config
    cross_dtype_bytes = KV_DTYPE_BYTES[config.kv_transfer_dtype]
    self_dtype = self_cache_dtype(  # the dtype ModelRunner allocates the self cache in
        torch.device(config.kv_device), products_dtype(model), torch_dtype(config.kv_transfer_dtype)
    )
    self_dtype_bytes = self_dtype.itemsize
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
    log.info(
        "%s; %d tokens per block, self KV %s, cross KV %s (%s)",
        sizing.describe(config.max_num_seqs),
        config.block_size,
        str(self_dtype).removeprefix("torch."),
        config.kv_transfer_dtype,
        pool.spec.segment,
    )
    return engine, pool


def _pool_options(config: DecoderServiceConfig) -> dict:
    """Transport-specific keyword options of the cross-KV pool."""
    if config.kv_transport == "torch_dist":
        return dict(
            address=config.kv_dist_address,
            backend=config.kv_dist_backend,
            device=config.kv_device,
            timeout_s=config.kv_transfer_timeout_s,
            # Pairing signed with the internal token (no warning here: the Encode client logs a missing file).
            pair_key=InternalAuth(read_token_file(config.internal_token_file)).pair_key
            if config.internal_token_file
            else None,
        )
    if config.kv_transport == "cuda_ipc":
        return dict(device=config.kv_device)  # must be a CUDA device; CudaIpcCrossKVPool says so otherwise
    return {}


class Replica:
    """This decoder's part in the deployment: its lease, its control channel, the lost-decoder reaper.

    Args:
        config: ``redis_url`` / ``redis_password_file``, ``lease_ttl_s``, the advertised address.
        servicer: the decoder's servicer (its sessions own the records; its Abort forwards through ``control``).
        store: the request-state store.
        gpu_ids: the CUDA device UUIDs the decoder uses (``()`` on the CPU).

    Raises:
        ValueError: the Redis password file cannot be read, or the address cannot be advertised (port 0).
    """

    def __init__(self, config: DecoderServiceConfig, servicer: DecoderServicer, store: RequestStateStore, gpu_ids):
        scheduler = servicer.engine.scheduler
        # Plain int reads of the engine thread's lists, as the /metrics scrape does (shared.metrics).
        self.lease = service_lease(
            config,
            "decoder",
            (config.kv_transport,),
            gpu_ids,
            lambda: scheduler.num_running + scheduler.num_waiting,
        )
        self.replica_id = self.lease.info.replica_id
        registry = self.lease.registry
        self.uptime = RedisUptime()
        self.control = ReplicaControl(store.redis_url, self.replica_id, store, registry, store.key_prefix)
        self.reaper = LostDecoderReaper(store, registry, self.replica_id, config.lease_ttl_s, self.uptime)
        self._leased = False
        servicer.sessions.replica_id = self.replica_id
        servicer.control = self.control

    def start(self, servicer: DecoderServicer) -> None:
        """On the serving event loop: listens on the control channel and starts reaping (the lease waits for
        ``on_serving``)."""
        self.control.start(asyncio.get_running_loop(), servicer.sessions.abort)
        self.reaper.start()

    async def on_serving(self) -> None:
        """The server takes calls (``serve``'s ``on_serving``): registers the lease (never raises: a Redis away is
        retried on the lease's thread)."""
        if not self._leased:
            self._leased = True
            await asyncio.to_thread(self.lease.start)

    async def on_shutdown(self) -> None:
        """After the drain, once every record this decoder opened has ended: deregisters. The lease lives through
        the drain, so an Abort forwarded meanwhile still reaches the requests finishing here, and a decoder killed
        during its drain is still reaped once its lease expires."""
        if self._leased:
            await asyncio.to_thread(self.lease.stop)

    async def close(self) -> None:
        await self.reaper.stop()
        await asyncio.to_thread(self.control.stop)
        self.lease.registry.close()


def run(config: DecoderServiceConfig) -> None:
    """Loads the model onto ``config.device``, creates the KV pools there and serves until SIGINT/SIGTERM.

    Raises:
        ValueError: ``device`` names a GPU this machine does not have (``shared.device.resolve_device``).
    """
    threads = single_threaded_main(config.num_threads)  # loading stays on one thread; the engine thread gets these
    device = resolve_device(config.device)  # before anything is loaded: a missing GPU fails fast
    public_port_security(config)  # the token and TLS files fail the start now, not after the model loaded
    model = load_model_in(config.model, config.dtype, device)  # bfloat16 on the CPU: mixed (shared.models.bfloat16)
    apply_quantization(model, config.quantize, "decoder")  # CPU only (the config refuses int8 on CUDA)
    model.to(device)  # before the KV pools are sized: a fractional kv_cache_memory sees the weights' memory taken
    if config.quantize == "none" and (packed := model.pack_decode_weights()):  # CPU float32: kernels/packed_linear.py
        log.info("decode-step weights packed for the CPU kernel (+%.0f MB)", packed / 2**20)
        calibrate_packed_isa(model.packed_weights(), threads)  # float32 weights: the fastest micro-kernel here
    log.info(
        "decoder model %s on %s (%s%s), attention %s, stream interval %d",
        config.model,
        device,
        config.dtype,
        ", int8 linears" if config.quantize == "int8" else "",
        config.attention_backend,
        config.stream_interval,
    )
    if getattr(model, "input_modality", "audio") == "audio":  # else the first request pays for it (0.3-0.5 s)
        warm_audio_front_end(model.config.num_mel_bins)
    store = RequestStateStore(resolve_redis_url(config.redis_url, config.redis_password_file))
    store.ping()
    engine, pool = build_engine(config, model)

    async def main() -> None:
        servicer = DecoderServicer(config, model, engine, pool, store, threads)
        replica = Replica(config, servicer, store, cuda_gpu_ids(device))
        servicer.start()
        sessions = servicer.sessions
        readiness = servicer.readiness = DecoderReadiness(
            store, sessions.encoder, sessions.flush_unrecorded, replica.uptime
        )
        start_metrics_server(config.metrics_port, config.metrics_host or config.host, servicer.metrics.registry)
        replica.start(servicer)

        async def on_stop() -> None:
            await servicer.close()  # its open records end FAILED first: only then does the lease go
            await replica.on_shutdown()
            await replica.close()
            pool.close()

        await serve(
            lambda server: decoder_pb2_grpc.add_DecoderServiceServicer_to_server(servicer, server),
            ["encdec.v1.DecoderService"],
            f"{config.host}:{config.port}",
            on_stop,
            drain=lambda: servicer.drain(config.shutdown_grace_s),
            # health NOT_SERVING while Redis or the encoder does not answer
            readiness=readiness,
            on_serving=replica.on_serving,
            config=config,  # public: bearer token, TLS, per-client limit, message size (shared.public_port)
        )

    try:
        asyncio.run(main())
    finally:
        pool.close()
