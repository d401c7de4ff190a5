"""Typed configuration of both services: one source of defaults.

Every field maps onto a CLI flag (``--max-num-seqs``) and an environment
variable (``ENCDEC_MAX_NUM_SEQS``); the flag wins over the variable, the
variable over the default here.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, TypeVar

from shared.device import MODEL_DTYPES, check_device_name, is_cuda, same_device

DEFAULT_MODEL = "whisper-tiny.en"
DEFAULT_ENCODER_ADDRESS = "127.0.0.1:50061"
DEFAULT_DECODER_ADDRESS = "127.0.0.1:50051"
KV_TRANSPORTS = ("shm", "torch_dist", "cuda_ipc")  # cross-KV transports (``shared.kv_transport``)
KV_DIST_BACKENDS = ("gloo", "nccl")  # torch_dist backends
KV_DTYPES = ("float32", "float16", "bfloat16")  # cross-KV pool / transfer dtypes

C = TypeVar("C")


CPU_MAX_BATCH_TOKENS = 4096
"""The encoder's default padded-token budget per forward on the CPU. A forward of ~3000 rows already runs its
products at the GEMM's peak; more rows only stream larger activations (a Whisper tiny FFN's ``[8, 1500, 1536]``
is 74 MB against a 32 MB L3) through memory. Whisper tiny.en, 16 clips at once through both services on 2 cores,
3 alternating service starts x 2 runs: 8 windows per forward 6.6-9.1 s, mean 7.9 (encoder 10.7-14.9 CPU-s), 2 windows
6.5-8.0 s, mean 6.9 (encoder 10.0-12.8 CPU-s), measured on one 2-core AMD EPYC (Zen 4) machine. Embed batches of 32
inputs of up to 128 tokens still run in one forward; 32 text sources of more than 128 tokens now take several."""
CUDA_MAX_BATCH_TOKENS = 12288
"""The encoder's default padded-token budget per forward on a GPU: 8 Whisper windows, where a larger batch keeps
more of the device busy."""


@dataclass(frozen=True)
class EncoderServiceConfig:
    """Settings of the encoder service.

    Attributes:
        model: model name (``whisper-tiny.en``) or a model directory.
        host: address to listen on.
        port: gRPC port.
        max_batch_size: most Encode requests run in one encoder forward (see
            also ``max_batch_tokens``).
        batch_wait_ms: how long a forming batch waits for the next request
            (milliseconds); each arrival restarts the wait, up to ``max_batch_wait_ms``.
        max_batch_wait_ms: the longest the first request of a batch waits for
            company in all (milliseconds).
        num_threads: torch intra-op threads; 0 keeps torch's default.
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
        metrics_port: Prometheus ``/metrics`` HTTP port (``shared.metrics``);
            0 = off. A port already taken is logged and metrics stay off.
        device: where the model runs: ``cpu``, ``cuda`` or ``cuda:N``
            (``shared.device``); features and source ids are moved there and
            cross KV is handed to the writer from there (copied to the CPU for
            shm / gloo, device to device for cuda_ipc). A missing GPU fails at
            startup.
        dtype: weight dtype: ``float32`` (default), or ``float16`` / ``bfloat16``
            on a CUDA ``device`` only (docs/devices.md).
    """

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 50061
    max_batch_size: int = 64
    batch_wait_ms: float = 20.0
    max_batch_wait_ms: float = 200.0
    num_threads: int = 0
    max_batch_tokens: int = 0
    max_inputs_per_request: int = 2048
    quantize: str = "none"
    kv_transport: str = "shm,torch_dist"
    kv_dist_backend: str = "gloo"
    kv_device: str = ""
    kv_transfer_timeout_s: float = 30.0
    metrics_port: int = 9401
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_port(self.port)
        _check_port(self.metrics_port)
        names = [t.strip() for t in self.kv_transport.split(",") if t.strip()]
        if not names or any(t not in KV_TRANSPORTS for t in names):
            raise ValueError(f"kv_transport must list some of: {', '.join(KV_TRANSPORTS)}; got {self.kv_transport!r}")
        _check_model_device(self.device, self.dtype, self.quantize)
        if self.max_batch_tokens == 0:
            object.__setattr__(self, "max_batch_tokens", CUDA_MAX_BATCH_TOKENS if is_cuda(self.device) else CPU_MAX_BATCH_TOKENS)
        if not self.kv_device:  # staging follows the model onto the GPU only where the backend can send from there
            object.__setattr__(self, "kv_device", self.device if self.kv_dist_backend == "nccl" else "cpu")
        check_device_name(self.kv_device, "kv_device")
        _check_kv_dist(self.kv_dist_backend, self.kv_device, self.kv_transfer_timeout_s, "torch_dist" in names)
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not (self.batch_wait_ms >= 0 and self.max_batch_wait_ms >= 0):  # also refuses NaN
            raise ValueError(f"batch_wait_ms and max_batch_wait_ms must be >= 0, got {self.batch_wait_ms} and {self.max_batch_wait_ms}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, or 0 for the device's default; got {self.max_batch_tokens}")
        if self.max_inputs_per_request < 1:
            raise ValueError(f"max_inputs_per_request must be >= 1, got {self.max_inputs_per_request}")
        _check_quantize(self.quantize)


@dataclass(frozen=True)
class DecoderServiceConfig:
    """Settings of the decoder service.

    Attributes:
        model: model name (``whisper-tiny.en``) or a model directory.
        host: address to listen on.
        port: gRPC port of the public API.
        encoder_address: ``host:port`` of the encoder service.
        redis_url: Redis holding request state.
        block_size: tokens per KV block (both cache groups).
        max_num_seqs: most sequences in the running batch.
        max_num_batched_tokens: most query tokens in one step.
        num_self_blocks: self-attention KV blocks; 0 sizes the pool for
            ``max_num_seqs`` sequences of the model's max decoder length.
        num_cross_blocks: cross-attention KV blocks (the shared pool the
            encoder writes into); 0 sizes it for ``max_num_seqs`` requests of
            the model's max encoder length.
        kv_transport: how cross-attention KV arrives: ``shm`` (same host,
            shared memory), ``torch_dist`` (Gloo / NCCL point-to-point, any
            host) or ``cuda_ipc`` (same host, pool on the GPU ``kv_device``
            names); see docs/kv_transport.md.
        kv_dist_address: torch_dist: ``host:port`` of the rendezvous store this
            decoder hosts (port 0 picks a free one); encoders must reach it,
            and Gloo binds to ``host``.
        kv_dist_backend: torch_dist: ``gloo`` (CPU pool) or ``nccl`` (needs ``kv_device`` cuda).
        kv_device: device of both KV caches; empty = ``device``. The model
            attends over them in place, so a value naming another device is
            refused.
        kv_transfer_timeout_s: torch_dist: how long a request waits for its
            cross KV to land once Encode answered, and the bound on pairing
            (seconds); past it the request fails with UNAVAILABLE.
        kv_transfer_dtype: dtype of the cross-KV pool, hence of what the
            encoder writes / sends: ``float32`` (default), ``float16`` or
            ``bfloat16`` (half the bytes; accuracy in docs/kv_transport.md).
        encode_timeout_s: an Encode call slower than this fails the request
            with UNAVAILABLE and frees its blocks (seconds).
        max_decode_hold_ms: while requests wait for their cross KV, model steps
            are held for at most this long before one runs (milliseconds), so
            a burst starts decoding together and the encoder gets the cores it
            shares with the decoder (``decoder_svc.engine_loop``); 0 = never hold.
            The clock starts when some sequence could step.
        decode_hold_gap_steps: when a hold ran out while the encoder delivered
            (a long burst), the requests still encoding may hold again after
            this many model steps (TGI's ``max_waiting_tokens``, default 20).
        stream_interval: Generate streams a message per new token (1, the default), or, for a
            larger value, merges a request's messages until this many new tokens are held: its first
            token and its finish are sent at once. Fewer messages cost less CPU on both ends on busy
            hosts (SGLang's and vLLM's ``--stream-interval``); beam search always streams per message.
            Tokens held when the client goes away are never sent, yet count in the request's usage
            (Redis ``completion_tokens``), as everything generated does.
        max_audio_s: longest accepted audio (seconds); longer audio gets
            INVALID_ARGUMENT naming both lengths. Audio over Whisper's 30 s
            window is decoded as consecutive 30 s windows in one request
            (``decoder_svc.inputs.RequestInput.windows``). Default 600 s (10 min,
            20 windows; 38 MB of float32 PCM, within the 64 MiB gRPC message limit).
        num_threads: torch intra-op threads; 0 keeps torch's default.
        quantize: ``none`` or ``int8`` (opt-in int8 decoder weights and output
            projection with per-token activation scales, Whisper models; see
            ``shared.models.quantize``).
        kv_cache_memory: memory for both KV cache groups: bytes (``2GiB``,
            ``512MB``, ``1073741824``) or a fraction of the memory free after the
            model is loaded (``0.3`` or ``30%``; RAM on CPU, GPU memory on a
            GPU). Split between self and cross blocks in proportion to what one
            max-length request needs of each (``decoder_svc.kv_budget``); an
            explicit ``num_self_blocks`` / ``num_cross_blocks`` wins for its
            group. Empty: size for ``max_num_seqs`` max-length requests.
        metrics_port: Prometheus ``/metrics`` HTTP port (``shared.metrics``);
            0 = off. A port already taken is logged and metrics stay off.
        encoder_cache: 1 = a request whose encoder input (audio samples /
            source ids) equals that of an unfinished request shares its
            cross-attention KV instead of being encoded (``decoder_svc.encoder_cache``); 0 = off.
        attention_backend: ``torch`` (default) or ``triton``: what runs the
            decoder's paged self- and cross-attention (``kernels.attention_backend``);
            ``triton`` needs the triton package and a CUDA device (or
            ``TRITON_INTERPRET=1``, tests only).
        device: where the model and both KV caches live and every step's
            tensors are built: ``cpu``, ``cuda`` or ``cuda:N`` (``shared.device``).
            On CUDA the cross-KV pool must be on the GPU too: kv_transport
            ``cuda_ipc``, or ``torch_dist`` with ``nccl`` (``shm`` is host
            memory). Seeded sampling draws from a generator on this device, so a
            seed reproduces its tokens on the same device type only. A missing
            GPU fails at startup.
        dtype: weight dtype: ``float32`` (default), or ``float16`` / ``bfloat16``
            on a CUDA ``device`` only (docs/devices.md).
        shutdown_grace_s: on SIGTERM / SIGINT, how long running Generate calls
            may take to finish (seconds) while health reports NOT_SERVING and
            new calls get UNAVAILABLE; calls still running then end with
            UNAVAILABLE ("shutting down ... send it again") and are recorded
            FAILED. Keep it below the orchestrator's kill timeout (compose's
            ``stop_grace_period``, 10 s by default; Kubernetes' 30 s).
    """

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 50051
    encoder_address: str = DEFAULT_ENCODER_ADDRESS
    redis_url: str = "redis://127.0.0.1:6379/0"
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    num_self_blocks: int = 0
    num_cross_blocks: int = 0
    kv_transport: str = "shm"
    kv_dist_address: str = "127.0.0.1:0"
    kv_dist_backend: str = "gloo"
    kv_device: str = ""
    kv_transfer_timeout_s: float = 30.0
    kv_transfer_dtype: str = "float32"
    encode_timeout_s: float = 120.0
    max_decode_hold_ms: float = 1000.0
    decode_hold_gap_steps: int = 20
    stream_interval: int = 1
    max_audio_s: float = 600.0
    num_threads: int = 0
    quantize: str = "none"
    kv_cache_memory: str = ""
    metrics_port: int = 9400
    encoder_cache: int = 1
    attention_backend: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    shutdown_grace_s: float = 8.0

    def __post_init__(self) -> None:
        _check_port(self.port)
        _check_port(self.metrics_port)
        if not 0 <= self.shutdown_grace_s < float("inf"):  # also refuses NaN
            raise ValueError(f"shutdown_grace_s must be >= 0 and finite (seconds), got {self.shutdown_grace_s}")
        parse_memory_size(self.kv_cache_memory)  # ValueError names the accepted forms
        if self.encoder_cache not in (0, 1):
            raise ValueError(f"encoder_cache must be 0 (off) or 1 (on), got {self.encoder_cache}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_self_blocks", "num_cross_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = sized automatically), got {getattr(self, name)}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of: {', '.join(KV_TRANSPORTS)}; got {self.kv_transport!r}")
        _check_model_device(self.device, self.dtype, self.quantize)
        self._check_kv_device()
        _check_kv_dist(self.kv_dist_backend, self.kv_device, self.kv_transfer_timeout_s, self.kv_transport == "torch_dist")
        host, _, port = self.kv_dist_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"kv_dist_address must be host:port, got {self.kv_dist_address!r}")
        _check_port(int(port))
        if self.kv_transfer_dtype not in KV_DTYPES:
            raise ValueError(f"kv_transfer_dtype must be one of: {', '.join(KV_DTYPES)}; got {self.kv_transfer_dtype!r}")
        if self.encode_timeout_s <= 0 or self.max_audio_s <= 0:
            raise ValueError("encode_timeout_s and max_audio_s must be > 0")
        if not self.max_decode_hold_ms >= 0:  # also refuses NaN
            raise ValueError(f"max_decode_hold_ms must be >= 0 (0 = never hold), got {self.max_decode_hold_ms}")
        if self.decode_hold_gap_steps < 0:
            raise ValueError(f"decode_hold_gap_steps must be >= 0, got {self.decode_hold_gap_steps}")
        _check_quantize(self.quantize)
        if self.attention_backend != "torch":
            from kernels.attention_backend import check_attention_backend  # imports torch: only off the default

            check_attention_backend(self.attention_backend, self.device)

    def _check_kv_device(self) -> None:
        """Resolves an empty ``kv_device`` to ``device``; refuses KV caches the model could not attend over."""
        if not self.kv_device:
            object.__setattr__(self, "kv_device", self.device)
        check_device_name(self.kv_device, "kv_device")
        if not same_device(self.kv_device, self.device):
            raise ValueError(f"kv_device {self.kv_device!r} differs from device {self.device!r}: the decoder attends over both "
                             "KV caches on its model's device; leave kv_device unset (it follows device) or set both alike")
        if is_cuda(self.device) and self.kv_transport == "shm":
            raise ValueError(f"kv_transport shm keeps the cross-KV pool in host shared memory, which a decoder on {self.device!r} "
                             "cannot attend over: use kv_transport cuda_ipc (encoder on the same host) or torch_dist with "
                             "kv_dist_backend nccl, or device cpu")
        if not is_cuda(self.device) and self.kv_transport == "cuda_ipc":
            raise ValueError("kv_transport cuda_ipc puts the cross-KV pool on a GPU: set device cuda (kv_device follows it), "
                             "or use kv_transport shm on the CPU")


_MEMORY_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
                 "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory_size(text: str) -> tuple[float, bool] | None:
    """Parses a memory setting: ``(bytes, False)``, ``(fraction, True)`` or None when empty.

    Bytes: a number with an optional unit, decimal (``KB``, ``MB``, ``GB``,
    ``TB``; ``K``/``M``/``G``/``T`` alike) or binary (``KiB``, ``MiB``, ``GiB``,
    ``TiB``), case-insensitive: ``2GiB``, ``512MB``, ``1073741824``. Fraction
    of free memory: a bare number below 1 (``0.3``) or a percentage (``30%``),
    in (0, 1].

    Raises:
        ValueError: anything else, with the accepted forms.
    """
    s = text.strip().lower().replace(" ", "")
    if not s:
        return None
    forms = "bytes with an optional unit (2GiB, 512MB, 1073741824) or a fraction of free memory (0.3, 30%)"
    try:
        if s.endswith("%"):
            fraction = float(s[:-1]) / 100
            if not 0 < fraction <= 1:
                raise ValueError
            return fraction, True
        number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        value, unit = float(number), s[len(number):]
        if unit not in _MEMORY_UNITS or value <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"memory size {text!r} must be {forms}") from None
    if not unit and value < 1:
        return value, True
    return value * _MEMORY_UNITS[unit], False


def _check_kv_dist(backend: str, device: str, timeout_s: float, used: bool = True) -> None:
    """``used``: torch_dist is one of the service's transports (gloo's CPU-only rule applies only then)."""
    if backend not in KV_DIST_BACKENDS:
        raise ValueError(f"kv_dist_backend must be one of: {', '.join(KV_DIST_BACKENDS)}; got {backend!r}")
    if backend == "nccl" and not device.startswith("cuda"):
        raise ValueError(f"kv_dist_backend nccl moves CUDA tensors: set kv_device to cuda, got {device!r}")
    if used and backend == "gloo" and is_cuda(device):
        # torch.distributed's backend table: gloo send/recv take CPU tensors only.
        raise ValueError(f"kv_dist_backend gloo sends CPU tensors only, but kv_device is {device!r}: "
                         "use kv_dist_backend nccl, or keep the KV on the CPU")
    if timeout_s <= 0:
        raise ValueError(f"kv_transfer_timeout_s must be > 0, got {timeout_s}")


def _check_model_device(device: str, dtype: str, quantize: str) -> None:
    check_device_name(device)
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype must be one of: {', '.join(MODEL_DTYPES)}; got {dtype!r}")
    if dtype != "float32" and not is_cuda(device):
        raise ValueError(f"dtype {dtype} is for CUDA devices (half-precision matmuls on the CPU are slow and lose "
                         "accuracy): set device cuda, or dtype float32 (or quantize int8 on the CPU)")
    if quantize != "none" and is_cuda(device):
        raise ValueError(f"quantize {quantize} is CPU dynamic quantization (torch._int_mm on the CPU): on device {device!r} "
                         "use quantize none (dtype float16 or bfloat16 halves the weights on a GPU)")


def _check_quantize(quantize: str) -> None:
    if quantize not in ("none", "int8"):
        raise ValueError(f"quantize must be 'none' or 'int8', got {quantize!r}")


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one ``--field-name`` flag per dataclass field, defaulting to None."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, dest=f.name, type=_field_type(f),
                            default=None, help=f"(env ENCDEC_{f.name.upper()}, default {f.default!r})")


def _field_type(f: dataclasses.Field) -> Any:
    return {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]


def config_from(cls: type[C], args: argparse.Namespace | None = None, env: dict[str, str] | None = None) -> C:
    """Builds ``cls`` from CLI args over ``ENCDEC_*`` environment variables over defaults.

    Raises:
        ValueError: a value does not parse or fails validation.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        convert = _field_type(f)
        raw = getattr(args, f.name, None) if args is not None else None
        source = f"--{f.name.replace('_', '-')}"
        for var in (f"ENCDEC_{f.name.upper()}",) + (("REDIS_URL",) if f.name == "redis_url" else ()):
            if raw is None and var in env:
                raw, source = env[var], var
        if raw is not None:
            try:
                values[f.name] = convert(raw)
            except ValueError as exc:
                raise ValueError(f"{f.name}: cannot parse {raw!r} (from {source}) as {convert.__name__}") from exc
    return cls(**values)


__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_ENCODER_ADDRESS",
    "DEFAULT_DECODER_ADDRESS",
    "EncoderServiceConfig",
    "DecoderServiceConfig",
    "add_config_arguments",
    "config_from",
    "parse_memory_size",
]
