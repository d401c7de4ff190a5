"""``EncoderServiceConfig``: the encoder service's settings (Encode and, for encoder-only models, Embed)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.base import KV_TRANSPORTS, ServiceConfig
from shared.device import check_device_name, is_cuda

CPU_MAX_BATCH_TOKENS = 4096
"""The encoder's default padded-token budget per forward on the CPU. A forward of ~3000 rows already runs its
products at the GEMM's peak; more rows only stream larger activations (a Whisper tiny FFN's ``[8, 1500, 1536]``
is 74 MB against a 32 MB L3) through memory: with Whisper tiny.en, 2 windows per forward were no slower than 8
(measured: docs/benchmarks.md, Measurements formerly in docstrings). Embed batches of 32
inputs of up to 128 tokens still run in one forward; 32 text sources of more than 128 tokens now take several."""
CUDA_MAX_BATCH_TOKENS = 12288
"""The encoder's default padded-token budget per forward on a GPU: 8 Whisper windows, where a larger batch keeps
more of the device busy."""


@dataclass(frozen=True, kw_only=True)
class EncoderServiceConfig(ServiceConfig):
    """Settings of the encoder service: the ``ServiceConfig`` fields, and these.

    Attributes:
        port: gRPC port.
        max_batch_size: most Encode requests run in one encoder forward (see
            also ``max_batch_tokens``).
        batch_wait_ms: how long a forming batch waits for the next request
            (milliseconds); each arrival restarts the wait, up to ``max_batch_wait_ms``.
        max_batch_wait_ms: the longest the first request of a batch waits for
            company in all (milliseconds).
        max_batch_tokens: most padded tokens (sequences x longest) in one
            forward: of Encode requests (a Whisper window counts its 1500
            encoder positions; a text source its tokens) and, for
            encoder-only models, of Embed / Rerank / Classify inputs. 0 (the
            default) picks by ``device`` when the config is built:
            ``CPU_MAX_BATCH_TOKENS`` (2 Whisper windows) on the CPU,
            ``CUDA_MAX_BATCH_TOKENS`` (8) on a GPU (a ``dataclasses.replace``
            of the device keeps the number already picked).
        max_inputs_per_request: encoder-only models: most inputs (or rerank
            documents) in one request; more get RESOURCE_EXHAUSTED.
        kv_transport: comma-separated cross-KV transports this encoder accepts
            (``shm``, ``torch_dist``, ...); each Encode's target names one.
        kv_dist_backend: torch_dist: ``gloo`` (CPU tensors over TCP) or
            ``nccl`` (CUDA tensors); must match the decoder's.
        kv_device: torch_dist: where payloads are staged for sending
            (``cpu`` for gloo, which sends CPU tensors only; ``cuda`` for nccl).
            Empty: ``device`` with nccl, ``cpu`` with gloo.
        kv_transfer_timeout_s: torch_dist: bound on pairing with a decoder and
            on every send/receive of a transfer (seconds); a hung decoder holds
            the encoder's batcher at most this long.
        kv_dist_handshake_timeout_s: torch_dist: bound on reaching a
            decoder's rendezvous store and reading its identity (seconds). A
            target that accepts the TCP connection and says nothing fails its
            Encode with UNAVAILABLE after this long; connecting runs off the
            batcher thread, so other requests' encodes never wait for it.
        device: where the model runs: ``cpu``, ``cuda`` or ``cuda:N``
            (``shared.device``); features and source ids are moved there and
            cross KV is handed to the writer from there (copied to the CPU for
            shm / gloo, device to device for cuda_ipc). A missing GPU fails at
            startup.
    """

    port: int = 50061
    max_batch_size: int = 64
    batch_wait_ms: float = 20.0
    max_batch_wait_ms: float = 200.0
    max_batch_tokens: int = 0
    max_inputs_per_request: int = 2048
    kv_transport: str = "shm,torch_dist"
    kv_dist_handshake_timeout_s: float = 5.0
    metrics_port: int = 9401

    def __post_init__(self) -> None:
        super().__post_init__()
        names = [t.strip() for t in self.kv_transport.split(",") if t.strip()]
        if not names or any(t not in KV_TRANSPORTS for t in names):
            raise ValueError(f"kv_transport must list some of: {', '.join(KV_TRANSPORTS)}; got {self.kv_transport!r}")
        self._check_model_device()
        if self.max_batch_tokens == 0:
            object.__setattr__(
                self, "max_batch_tokens", CUDA_MAX_BATCH_TOKENS if is_cuda(self.device) else CPU_MAX_BATCH_TOKENS
            )
        if not self.kv_device:  # staging follows the model onto the GPU only where the backend can send from there
            object.__setattr__(self, "kv_device", self.device if self.kv_dist_backend == "nccl" else "cpu")
        check_device_name(self.kv_device, "kv_device")
        self._check_kv_dist("torch_dist" in names)
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not (self.batch_wait_ms >= 0 and self.max_batch_wait_ms >= 0):  # also refuses NaN
            raise ValueError(
                f"batch_wait_ms and max_batch_wait_ms must be >= 0, got {self.batch_wait_ms} and {self.max_batch_wait_ms}"
            )
        if self.max_batch_tokens < 1:
            raise ValueError(
                f"max_batch_tokens must be >= 1, or 0 for the device's default; got {self.max_batch_tokens}"
            )
        if not self.kv_dist_handshake_timeout_s > 0:  # also refuses NaN
            raise ValueError(f"kv_dist_handshake_timeout_s must be > 0, got {self.kv_dist_handshake_timeout_s}")
        if self.max_inputs_per_request < 1:
            raise ValueError(f"max_inputs_per_request must be >= 1, got {self.max_inputs_per_request}")
        self._check_quantize()
