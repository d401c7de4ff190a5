"""Prometheus metrics of both services and their ``/metrics`` HTTP endpoint (prometheus-client).

Each service keeps its metrics in its own ``CollectorRegistry`` (so several
services, or tests, in one process never collide) and serves it with
``start_metrics_server`` on ``metrics_port`` (0 = off). Names follow the
Prometheus conventions (``_seconds``, ``_bytes``, ``_total`` for counters) and
vLLM's choice of serving metrics (TTFT, time per output token, running /
waiting sequences, KV blocks, preemptions).

Gauges of the decoder's scheduler and block pools are read when scraped
(``DecoderMetrics.watch_engine``), not pushed every step: a scrape costs the
engine nothing. They are plain int reads of lists the engine thread owns,
taken without a lock, so a scrape may see a state a step is half-way through
(off by one for an instant, never corrupt).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Latency buckets (seconds): vLLM's TTFT / TPOT buckets, trimmed, plus CPU-speed tails.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ENCODE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TRANSFER_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def new_registry() -> CollectorRegistry:
    """An empty registry with the process collector (CPU seconds, resident memory, open fds)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


class _EngineCollector(Collector):
    """Reads the decoder engine's counts at scrape time."""

    def __init__(self, stats: Callable[[], dict], scheduler) -> None:
        self._stats = stats
        self._scheduler = scheduler

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "encdec_decoder_num_requests_running", "Sequences in the running batch", s["num_running"]
        )
        yield GaugeMetricFamily(
            "encdec_decoder_num_requests_waiting",
            "Sequences not running: waiting for cross blocks, encoding, or waiting for self blocks / a seat",
            s["num_waiting"],
        )
        free = GaugeMetricFamily(
            "encdec_decoder_kv_free_blocks", "Free KV cache blocks per cache group", labels=["group"]
        )
        total = GaugeMetricFamily("encdec_decoder_kv_blocks", "KV cache blocks per cache group", labels=["group"])
        for group in ("self", "cross"):
            free.add_metric([group], s[f"num_free_{group}_blocks"])
            total.add_metric([group], s[f"num_{group}_blocks"])
        yield free
        yield total
        yield CounterMetricFamily(
            "encdec_decoder_model_steps", "Engine steps that ran the model (decode or prefill)", s["num_model_steps"]
        )
        yield CounterMetricFamily(
            "encdec_decoder_step_sequences",
            "Sequences over all model steps (mean batch = this / encdec_decoder_model_steps)",
            s["num_step_sequences"],
        )
        sched = self._scheduler
        yield CounterMetricFamily(
            "encdec_decoder_num_preemptions", "Recompute preemptions since start", sched.num_preemptions
        )
        yield CounterMetricFamily(
            "encdec_decoder_encoder_cache_hits",
            "Requests that shared another unfinished request's cross KV instead of being encoded",
            sched.encoder_cache.num_hits,
        )
        yield GaugeMetricFamily(
            "encdec_decoder_encoder_cache_entries",
            "Distinct encoder inputs whose cross KV is shareable now",
            len(sched.encoder_cache.entries),
        )


class _AdmissionCollector(Collector):
    """Reads the decoder's admission queue (``decoder_svc.session.admission.AdmissionQueue``) at scrape time."""

    def __init__(self, admission) -> None:
        self._admission = admission

    def collect(self) -> Iterable[Metric]:
        a = self._admission
        s = a.stats()
        yield GaugeMetricFamily(
            "encdec_decoder_queue_requests",
            "Generate requests admitted without a first token yet (waiting for cross blocks, their Encode or a seat)",
            s["num_queued_requests"],
        )
        yield GaugeMetricFamily(
            "encdec_decoder_queue_oldest_wait_seconds",
            "How long the longest-waiting queued request has waited",
            s["oldest_queue_wait_s"],
        )
        yield GaugeMetricFamily(
            "encdec_decoder_queue_estimated_wait_seconds",
            "Estimated wait of a new priority-0 request (queued ahead x measured time between two starting)",
            s["estimated_queue_wait_s"],
        )
        refused = CounterMetricFamily(
            "encdec_decoder_admission_refusals",
            "Generate requests refused at admission (queue_full, queue_time: RESOURCE_EXHAUSTED; deadline: "
            "DEADLINE_EXCEEDED) or displaced from the queue by a higher-priority one (displaced)",
            labels=["reason"],
        )
        for reason, n in dict(a.num_refused).items():
            refused.add_metric([reason], n)
        yield refused


class DecoderMetrics:
    """Metrics of the decoder service.

    Attributes:
        registry: where they live; serve it with ``start_metrics_server``.
        requests: finished Generate requests by final ``state`` (finished /
            aborted / failed) and ``finish_reason`` (stop / length / abort, or
            empty on failure).
        ttft: time to first token (seconds), from the Generate call's arrival
            to the first generated token (parse, queue, encode and prefill).
        tpot: time per output token (seconds): the interval between a
            request's consecutive tokens, observed once per token after the first.
        encode: Encode round trip as the decoder sees it (seconds).
        kv_transfer_bytes / kv_transfer: cross-KV bytes moved into this
            decoder's pool and the wall time of each transfer (seconds), as the
            transport reports them.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self.requests = Counter(
            "encdec_decoder_requests",
            "Finished Generate requests by final state",
            ["state", "finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "encdec_decoder_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "encdec_decoder_time_per_output_token_seconds",
            "Time between a request's consecutive tokens",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.encode = Histogram(
            "encdec_decoder_encode_seconds", "Encode round trip seen by the decoder", buckets=ENCODE_BUCKETS, registry=r
        )
        self.kv_transfer_bytes = Counter(
            "encdec_decoder_kv_transfer_bytes", "Cross-KV bytes transferred into the pool", registry=r
        )
        self.kv_transfer = Histogram(
            "encdec_decoder_kv_transfer_seconds",
            "Wall time of one request's cross-KV transfer",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )

    def watch_engine(self, stats: Callable[[], dict], scheduler) -> None:
        """Exposes the engine's running / waiting sequences, free and total blocks per group,
        model steps and the sequences they ran (mean batch size), preemptions and
        encoder-cache hits / entries, read at scrape time.

        Args:
            stats: ``DecoderEngine.stats`` (keys ``num_running``, ``num_waiting``,
                ``num_{self,cross}_blocks``, ``num_free_{self,cross}_blocks``,
                ``num_model_steps``, ``num_step_sequences``).
            scheduler: the ``decoder_svc.core.scheduler.Scheduler`` (``num_preemptions``,
                ``encoder_cache``).
        """
        self.registry.register(_EngineCollector(stats, scheduler))

    def watch_admission(self, admission) -> None:
        """Exposes the admission queue (``decoder_svc.session.admission.AdmissionQueue``: ``stats()``, ``num_refused``),
        read at scrape time: queued requests, the oldest one's wait, a new request's estimated wait (seconds),
        refusals by reason."""
        self.registry.register(_AdmissionCollector(admission))

    def observe_transfer(self, nbytes: int, ms: float) -> None:
        """Records one cross-KV transfer (``EncodeResponse.transfer_bytes`` / ``transfer_ms``)."""
        self.kv_transfer_bytes.inc(max(int(nbytes), 0))
        self.kv_transfer.observe(max(float(ms), 0.0) / 1000)


class EncoderMetrics:
    """Metrics of the encoder service.

    Attributes:
        requests: Encode calls by ``outcome`` (``ok`` / ``error``).
        encode: per request, time from its batch's start to its KV written (seconds).
        batch_size: requests encoded together, per request.
        kv_transfer_bytes / kv_transfer: cross-KV bytes written or sent, and
            the wall time of each request's write / send (seconds).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self.requests = Counter("encdec_encoder_requests", "Encode calls by outcome", ["outcome"], registry=r)
        self.encode = Histogram(
            "encdec_encoder_encode_seconds",
            "Batch start to cross KV written, per request",
            buckets=ENCODE_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "encdec_encoder_batch_size",
            "Requests encoded in one forward, per request",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "encdec_encoder_kv_transfer_bytes", "Cross-KV bytes written / sent", registry=r
        )
        self.kv_transfer = Histogram(
            "encdec_encoder_kv_transfer_seconds",
            "Wall time of one request's cross-KV write / send",
            buckets=TRANSFER_BUCKETS,
            registry=r,
        )

    def observe_encode(self, encode_ms: float, batch_size: int, transfer_bytes: int, transfer_ms: float) -> None:
        """Records one successful Encode (the values of its ``EncodeResponse``)."""
        self.requests.labels(outcome="ok").inc()
        self.encode.observe(encode_ms / 1000)
        self.batch_size.observe(batch_size)
        self.kv_transfer_bytes.inc(max(int(transfer_bytes), 0))
        self.kv_transfer.observe(max(float(transfer_ms), 0.0) / 1000)


EMBED_TOKENS_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 65536)


class _EmbedQueueCollector(Collector):
    """Reads the embed batcher's queue (``EmbedBatcher.stats``) at scrape time."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        yield GaugeMetricFamily(
            "encdec_embed_queue_requests",
            "Embed / Rerank / Classify requests in the batcher, waiting or part run",
            s["num_requests"],
        )
        yield GaugeMetricFamily(
            "encdec_embed_queue_sequences", "Sequences of those requests not yet run", s["num_sequences"]
        )
        yield GaugeMetricFamily(
            "encdec_embed_queue_oldest_wait_seconds",
            "How long the oldest request in the batcher has been there",
            s["oldest_wait_s"],
        )


class EmbedMetrics:
    """Metrics of the Embed service (an encoder service serving an encoder-only model).

    Attributes:
        requests: finished calls by ``rpc`` (Embed / Rerank / Classify / Tokenize)
            and ``code`` (the gRPC status name, ``OK`` on success).
        request_seconds: a call's time in the service (seconds), by ``rpc``.
        batch_size / batch_tokens: sequences and tokens of each encoder forward.
        forward_seconds: wall time of each forward (seconds).
        sequences: sequences run through the encoder.
        dropped / dropped_sequences: requests, and their sequences, dropped from
            the batcher unrun, by ``reason`` (``expired``: deadline passed;
            ``cancelled``: the client went away).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self.requests = Counter(
            "encdec_embed_requests", "Finished calls by RPC and status", ["rpc", "code"], registry=r
        )
        self.request_seconds = Histogram(
            "encdec_embed_request_seconds", "A call's time in the service", ["rpc"], buckets=ENCODE_BUCKETS, registry=r
        )
        self.batch_size = Histogram(
            "encdec_embed_batch_size", "Sequences in one encoder forward", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "encdec_embed_batch_tokens", "Tokens in one encoder forward", buckets=EMBED_TOKENS_BUCKETS, registry=r
        )
        self.forward_seconds = Histogram(
            "encdec_embed_forward_seconds", "Wall time of one encoder forward", buckets=ENCODE_BUCKETS, registry=r
        )
        self.sequences = Counter("encdec_embed_sequences", "Sequences run through the encoder", registry=r)
        self.dropped = Counter(
            "encdec_embed_dropped_requests", "Requests dropped from the batcher unrun", ["reason"], registry=r
        )
        self.dropped_sequences = Counter(
            "encdec_embed_dropped_sequences", "Sequences dropped from the batcher unrun", ["reason"], registry=r
        )
        for reason in ("expired", "cancelled"):  # exported as 0 before the first drop
            self.dropped.labels(reason=reason)
            self.dropped_sequences.labels(reason=reason)

    def watch_batcher(self, stats: Callable[[], dict]) -> None:
        """Exposes the batcher's queue, read at scrape time.

        Args:
            stats: ``EmbedBatcher.stats`` (keys ``num_requests``, ``num_sequences``, ``oldest_wait_s``).
        """
        self.registry.register(_EmbedQueueCollector(stats))

    def observe_request(self, rpc: str, code: str, seconds: float) -> None:
        """Records one finished call (``code``: a ``grpc.StatusCode`` name)."""
        self.requests.labels(rpc=rpc, code=code).inc()
        self.request_seconds.labels(rpc=rpc).observe(max(seconds, 0.0))

    def observe_forward(self, num_sequences: int, num_tokens: int, seconds: float) -> None:
        """Records one encoder forward."""
        self.batch_size.observe(num_sequences)
        self.batch_tokens.observe(num_tokens)
        self.forward_seconds.observe(max(seconds, 0.0))
        self.sequences.inc(num_sequences)

    def observe_dropped(self, reason: str, num_sequences: int) -> None:
        """Records one request dropped unrun (``expired`` / ``cancelled``) with its sequences not yet run."""
        self.dropped.labels(reason=reason).inc()
        self.dropped_sequences.labels(reason=reason).inc(num_sequences)


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> bool:
    """Serves ``registry`` as Prometheus text on ``http://host:port/metrics`` (a daemon thread).

    ``port`` 0 means metrics are off. A port that cannot be bound is logged as
    an error and the service keeps running without metrics: losing them must
    not take the model down.

    Returns:
        True when the endpoint is up.
    """
    if not port:
        return False
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.error("metrics: cannot listen on %s:%d (%s); serving without /metrics", host, port, exc)
        return False
    log.info("metrics: http://%s:%d/metrics", host, port)
    return True


__all__ = ["DecoderMetrics", "EmbedMetrics", "EncoderMetrics", "new_registry", "start_metrics_server"]
