"""``ServiceConfig``: the settings every service has, and the checks they share.

The encoder and decoder configs (``shared.config.encoder``, ``shared.config.decoder``)
inherit it and set their own defaults for ``port``, ``kv_transport`` and
``metrics_port``.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.device import CPU_BF16_FLAGS, MODEL_DTYPES, check_device_name, cpu_bf16_flags, is_cuda

DEFAULT_MODEL = "whisper-tiny.en"
DEFAULT_ENCODER_ADDRESS = "127.0.0.1:50061"
DEFAULT_DECODER_ADDRESS = "127.0.0.1:50051"
KV_TRANSPORTS = ("shm", "torch_dist", "cuda_ipc")  # cross-KV transports (``shared.kv_transport``)
KV_DIST_BACKENDS = ("gloo", "nccl")  # torch_dist backends
KV_DTYPES = ("float32", "float16", "bfloat16")  # cross-KV pool / transfer dtypes
# Registry leases: a renewal every third of the lease must survive a busy event loop / Redis round trip.
MIN_LEASE_TTL_S, MAX_LEASE_TTL_S = 0.5, 300.0


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
            activation scales, encoder-decoder models (Whisper, T5, BART, mBART, Marian) on the CPU;
            see ``shared.models.quantize``).
        kv_transport: the cross-KV transport(s) (``shm``, ``torch_dist``,
            ``cuda_ipc``; ``shared.kv_transport``).
        kv_dist_backend: torch_dist: ``gloo`` (CPU tensors over TCP) or
            ``nccl`` (CUDA tensors); encoder and decoder must match.
        kv_device: the device cross KV is kept or staged on; empty picks one
            from ``device``.
        kv_transfer_timeout_s: torch_dist: bound on pairing and on a transfer (seconds).
        metrics_port: Prometheus ``/metrics`` HTTP port (``shared.metrics``);
            0 = off. A port already taken is logged and metrics stay off.
        metrics_host: the address ``/metrics`` listens on (plain HTTP, no token); empty = ``host``. ``encdec up``
            bound beyond loopback sets 127.0.0.1 unless given (issue 34: no public port without a secret).
        device: where the model runs: ``cpu``, ``cuda`` or ``cuda:N``
            (``shared.device``). A missing GPU fails at startup.
        dtype: weight and activation dtype: ``float32`` (default); ``float16`` on a CUDA ``device`` only;
            ``bfloat16`` on CUDA, or on a CPU with AVX-512 BF16 / AMX (``shared.device.CPU_BF16_FLAGS``; refused
            elsewhere), where it is mixed precision (``shared.models.bfloat16``: bfloat16 weights and products with
            float32 accumulation, float32 residual stream, norms and softmax) and the decoder keeps both KV caches
            in bfloat16 (docs/devices.md).
        internal_token_file: path of the secret decoder and encoder of one
            deployment share (``shared.internal_auth``): the decoder sends it
            with every Encode and signs the KV target it reserved; the encoder
            refuses Encode without it (UNAUTHENTICATED) and a target whose
            signature does not match (PERMISSION_DENIED). The encoder writes
            a new token there if the file does not exist (compose: on the
            volume the decoder mounts too); the decoder requires it. Read at
            start-up: a file that cannot be read or written fails the start.
            Empty: no check (a warning at start-up). ``encdec up`` generates one.
        redis_url: Redis of the deployment (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS):
            request state (decoder) and the replica registry (every service: ``shared.registry``). The encoder's
            default is empty: no registration (static ``--encoder-address`` deployments need none).
        redis_password_file: a file holding the Redis password (Kubernetes / compose secrets); it replaces the
            password in ``redis_url`` (the user name stays). Empty: the URL's own.
        advertise_address: ``host:port`` other replicas reach this one at, as registered in Redis; empty =
            ``host:port``, with an unspecified ``host`` (``0.0.0.0``, ``::``) replaced by ``$POD_IP`` or this
            machine's address.
        lease_ttl_s: seconds the replica's registry lease lives without renewal (renewed every third of it);
            a replica not renewed for this long counts as gone (``shared.registry``).
        auth_token_file: file holding the bearer token every public RPC needs (``authorization: Bearer <token>``
            metadata; UNAUTHENTICATED otherwise; health stays open); ``shared.public_auth``. Empty with
            ``auth_token`` empty: no check.
        auth_token: the token itself (prefer ``ENCDEC_AUTH_TOKEN`` or the file: a flag shows in ``ps``).
        tls_cert / tls_key: PEM certificate chain and private key: the public port serves TLS (both or neither).
        tls_client_ca: PEM CA bundle: clients must present a certificate it signed (mutual TLS); needs tls_cert.
        max_requests_per_client: most calls in flight from one client address (the peer IP) on the public port;
            more get RESOURCE_EXHAUSTED; 0 = no limit. Behind the HTTP gateway every call comes from its address:
            512 is the gateway's ``--max-concurrent-requests`` (``gateway_svc.config``), so a gateway in front
            meets its own cap (503 to its clients, per client 429) before its backend's limit.
        max_message_bytes: largest gRPC message received or sent (bytes): audio travels in Generate.
        max_concurrent_rpcs: most calls the port runs at once, every client, method and outcome together (gRPC's
            ``maximum_concurrent_rpcs``: a call past it ends at once with RESOURCE_EXHAUSTED, before its body is
            read); it bounds what calls without the token, which no per-client limit counts, can hold. 0 = no limit.
            ``health_port``'s health service is outside it.
        health_port: a second, plaintext port serving only ``grpc.health.v1.Health`` (the same status as the
            main port's), for probes that cannot speak TLS: Kubernetes' native ``grpc:`` probes. 0 = none.
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
    metrics_host: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    internal_token_file: str = ""
    redis_url: str = ""
    redis_password_file: str = ""
    advertise_address: str = ""
    lease_ttl_s: float = 5.0
    auth_token_file: str = ""
    auth_token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    max_requests_per_client: int = 512
    max_message_bytes: int = 64 * 1024 * 1024
    max_concurrent_rpcs: int = 4096
    health_port: int = 0

    def __post_init__(self) -> None:
        check_port(self.port)
        check_port(self.metrics_port)
        check_port(self.health_port)
        if not MIN_LEASE_TTL_S <= self.lease_ttl_s <= MAX_LEASE_TTL_S:  # also refuses NaN
            raise ValueError(
                f"lease_ttl_s must be in [{MIN_LEASE_TTL_S:g}, {MAX_LEASE_TTL_S:g}] seconds, got {self.lease_ttl_s}: "
                "shorter, a busy replica misses its renewal and its requests are failed; longer, a dead one's "
                "requests wait that long"
            )
        if self.health_port and self.health_port == self.port:
            raise ValueError(f"health_port must differ from port ({self.port}), or be 0 (none)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both (PEM files) or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key: the port must serve TLS")
        if self.max_requests_per_client < 0:
            raise ValueError(f"max_requests_per_client must be >= 0 (0 = no limit), got {self.max_requests_per_client}")
        if self.max_concurrent_rpcs < 0:
            raise ValueError(f"max_concurrent_rpcs must be >= 0 (0 = no limit), got {self.max_concurrent_rpcs}")
        if not 1024 <= self.max_message_bytes <= 2**31 - 1:
            raise ValueError(f"max_message_bytes must be in [1024, 2**31 - 1], got {self.max_message_bytes}")
        if self.advertise_address:
            check_address(self.advertise_address, "advertise_address")
            host = self.advertise_address.rpartition(":")[0].strip("[]")
            if host in ("0.0.0.0", "::", "") or self.advertise_address.endswith(":0"):
                raise ValueError(
                    f"advertise_address {self.advertise_address!r} is not an address other replicas can reach: "
                    "give this machine's (or the pod's) IP or name and the port it serves"
                )

    def _check_model_device(self) -> None:
        """Refuses an unknown ``device`` / ``dtype`` and half precision or int8 where they do not belong."""
        device, dtype, quantize = self.device, self.dtype, self.quantize
        check_device_name(device)
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of: {', '.join(MODEL_DTYPES)}; got {dtype!r}")
        if dtype == "bfloat16" and not is_cuda(device) and not cpu_bf16_flags():
            raise ValueError(
                "dtype bfloat16 on the CPU needs AVX-512 BF16 or AMX (/proc/cpuinfo flags "
                f"{' or '.join(CPU_BF16_FLAGS)}), which this CPU lacks (or ENCDEC_MAX_CPU_ISA caps away): without them bfloat16 matmuls are emulated "
                "and slower than float32; use dtype float32 (or quantize int8)"
            )
        if dtype == "float16" and not is_cuda(device):
            raise ValueError(
                f"dtype {dtype} is for CUDA devices (half-precision matmuls on the CPU are slow and lose "
                "accuracy): set device cuda, or dtype float32 or bfloat16 (CPUs with AVX-512 BF16 / AMX), or "
                "quantize int8 on the CPU"
            )
        if dtype == "bfloat16" and quantize != "none":
            raise ValueError(f"quantize {quantize} takes float32 weights: use dtype float32 with it, or quantize none")
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


def check_address(address: str, name: str) -> None:
    """Refuses anything but ``host:port`` (port 0..65535, no scheme, list or whitespace) with a ``ValueError``."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or any(c in address for c in "/, \t") or int(port) > 65535:
        raise ValueError(f"{name} must be host:port (port 0..65535), got {address!r}")


def check_port(port: int) -> None:
    """Refuses a TCP port outside 0..65535 with a ``ValueError``."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
