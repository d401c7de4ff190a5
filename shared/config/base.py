"""``ServiceConfig``: the settings every service has, and the checks they share.

The encoder and decoder configs (``shared.config.encoder``, ``shared.config.decoder``)
inherit it and set their own defaults for ``port``, ``kv_transport`` and
``metrics_port``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.device import MODEL_DTYPES, check_device_name, is_cuda

DEFAULT_MODEL = "whisper-tiny.en"
DEFAULT_ENCODER_ADDRESS = "127.0.0.1:50061"
DEFAULT_DECODER_ADDRESS = "127.0.0.1:50051"
KV_TRANSPORTS = ("shm", "torch_dist", "cuda_ipc")  # cross-KV transports (``shared.kv_transport``)
KV_DIST_BACKENDS = ("gloo", "nccl")  # torch_dist backends
KV_DTYPES = ("float32", "float16", "bfloat16")  # cross-KV pool / transfer dtypes


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Settings both services share. Not built on its own: each service's config sets ``port``,
    ``kv_transport`` and ``metrics_port``, and says what the ``kv_*`` and ``device`` fields mean there.

    Attributes:
        model: model name (``whisper-tiny.en``) or a model directory.
        host: address to listen on.
        port: gRPC port.
        num_threads: torch intra-op threads; 0 keeps torch's default.
        quantize: ``none`` or ``int8`` (opt-in int8 weights with per-token
            activation scales, Whisper models on the CPU; see ``shared.models.quantize``).
        kv_transport: the cross-KV transport(s) (``shm``, ``torch_dist``,
            ``cuda_ipc``; ``shared.kv_transport``).
        kv_dist_backend: torch_dist: ``gloo`` (CPU tensors over TCP) or
            ``nccl`` (CUDA tensors); encoder and decoder must match.
        kv_device: the device cross KV is kept or staged on; empty picks one
            from ``device``.
        kv_transfer_timeout_s: torch_dist: bound on pairing and on a transfer (seconds).
        metrics_port: Prometheus ``/metrics`` HTTP port (``shared.metrics``);
            0 = off. A port already taken is logged and metrics stay off.
        device: where the model runs: ``cpu``, ``cuda`` or ``cuda:N``
            (``shared.device``). A missing GPU fails at startup.
        dtype: weight dtype: ``float32`` (default), or ``float16`` / ``bfloat16``
            on a CUDA ``device`` only (docs/devices.md).
        internal_token_file: path of the secret decoder and encoder of one
            deployment share (``shared.internal_auth``): the decoder sends it
            with every Encode and signs the KV target it reserved; the encoder
            refuses Encode without it (UNAUTHENTICATED) and a target whose
            signature does not match (PERMISSION_DENIED). The encoder writes
            a new token there if the file does not exist (compose: on the
            volume the decoder mounts too); the decoder requires it. Read at
            start-up: a file that cannot be read or written fails the start.
            Empty: no check (a warning at start-up). ``encdec up`` generates one.
    """

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int
    num_threads: int = 0
    quantize: str = "none"
    kv_transport: str
    kv_dist_backend: str = "gloo"
    kv_device: str = ""
    kv_transfer_timeout_s: float = 30.0
    metrics_port: int
    device: str = "cpu"
    dtype: str = "float32"
    internal_token_file: str = ""

    def __post_init__(self) -> None:
        check_port(self.port)
        check_port(self.metrics_port)

    def _check_model_device(self) -> None:
        """Refuses an unknown ``device`` / ``dtype`` and half precision or int8 where they do not belong."""
        device, dtype, quantize = self.device, self.dtype, self.quantize
        check_device_name(device)
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of: {', '.join(MODEL_DTYPES)}; got {dtype!r}")
        if dtype != "float32" and not is_cuda(device):
            raise ValueError(
                f"dtype {dtype} is for CUDA devices (half-precision matmuls on the CPU are slow and lose "
                "accuracy): set device cuda, or dtype float32 (or quantize int8 on the CPU)"
            )
        if quantize != "none" and is_cuda(device):
            raise ValueError(
                f"quantize {quantize} is CPU dynamic quantization (torch._int_mm on the CPU): on device {device!r} "
                "use quantize none (dtype float16 or bfloat16 halves the weights on a GPU)"
            )

    def _check_kv_dist(self, used: bool = True) -> None:
        """Checks the torch_dist fields; ``used``: torch_dist is one of the service's transports
        (gloo's CPU-only rule applies only then)."""
        backend, device = self.kv_dist_backend, self.kv_device
        if backend not in KV_DIST_BACKENDS:
            raise ValueError(f"kv_dist_backend must be one of: {', '.join(KV_DIST_BACKENDS)}; got {backend!r}")
        if backend == "nccl" and not device.startswith("cuda"):
            raise ValueError(f"kv_dist_backend nccl moves CUDA tensors: set kv_device to cuda, got {device!r}")
        if used and backend == "gloo" and is_cuda(device):
            # torch.distributed's backend table: gloo send/recv take CPU tensors only.
            raise ValueError(
                f"kv_dist_backend gloo sends CPU tensors only, but kv_device is {device!r}: "
                "use kv_dist_backend nccl, or keep the KV on the CPU"
            )
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")

    def _check_quantize(self) -> None:
        if self.quantize not in ("none", "int8"):
            raise ValueError(f"quantize must be 'none' or 'int8', got {self.quantize!r}")


def check_port(port: int) -> None:
    """Refuses a TCP port outside 0..65535 with a ``ValueError``."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
