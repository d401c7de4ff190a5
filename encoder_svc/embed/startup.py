"""Starting the Embed service: load the encoder-only model, build its batcher, serve.

``run`` is what ``encoder_svc.startup.run`` calls for an encoder-only model (BERT
family); the servicer itself (what each RPC does) is
``encoder_svc.embed.server.EmbedServicer``.
"""

from __future__ import annotations

import asyncio
import logging

from encoder_svc.embed.batcher import EmbedBatcher
from encoder_svc.embed.engine import load_embed_engine
from encoder_svc.embed.server import EmbedServicer
from shared.config import EncoderServiceConfig
from shared.device import resolve_device, torch_dtype
from shared.grpc_server import serve
from shared.metrics import EmbedMetrics, start_metrics_server
from shared.models.registry import model_names
from shared.proto import embed_pb2_grpc
from shared.public_port import public_port_security
from shared.registration import serve_hooks, service_lease
from shared.registry import cuda_gpu_ids

log = logging.getLogger(__name__)


def run(config: EncoderServiceConfig, num_threads: int | None = None) -> None:
    """Loads an encoder-only model and serves ``EmbedService`` until SIGINT/SIGTERM, and its
    Prometheus ``/metrics`` on ``config.metrics_port`` (``shared.metrics.EmbedMetrics``; 0 = off).

    ``num_threads``: torch intra-op threads of the batcher thread (``shared.compute_thread``). With
    ``config.redis_url`` set it registers as an ``embed`` replica (``shared.registration``), its load the requests
    in its queue.
    """
    # Listed in the replica registry (config.redis_url set) from the first readiness probe to the shutdown.
    lease = service_lease(
        config,
        "embed",
        gpu_ids=cuda_gpu_ids(resolve_device(config.device)),
        load_fn=lambda: batcher.stats()["num_requests"],
    )
    public_port_security(config)  # the token and TLS files fail the start now, not after the model loaded
    engine = load_embed_engine(config.model, torch_dtype(config.dtype), resolve_device(config.device))
    log.info(
        "encoder-only model %s on %s (%s): pooling %s, normalize %s, max input %d tokens (%d characters), %d labels",
        config.model,
        engine.device,
        config.dtype,
        engine.spec.pooling,
        engine.spec.normalize,
        engine.max_input_length,
        engine.max_input_chars,
        engine.num_labels,
    )
    metrics = EmbedMetrics()
    batcher = EmbedBatcher(engine, max(config.max_batch_tokens, engine.max_input_length), num_threads, metrics)
    metrics.watch_batcher(batcher.stats)
    servicer = EmbedServicer(
        engine, batcher, config.model, model_names(config.model), config.max_inputs_per_request, metrics
    )
    start_metrics_server(config.metrics_port, config.metrics_host or config.host, metrics.registry)

    async def on_stop() -> None:
        batcher.stop()

    asyncio.run(
        serve(
            lambda server: embed_pb2_grpc.add_EmbedServiceServicer_to_server(servicer, server),
            ["encdec.v1.EmbedService"],
            f"{config.host}:{config.port}",
            on_stop,
            **serve_hooks(lease),
            config=config,  # public: bearer token, TLS, per-client limit (shared.public_port)
        )
    )
