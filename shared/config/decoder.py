"""``DecoderServiceConfig``: the decoder service's settings (Generate, KV caches, continuous batching)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.base import (
    DEFAULT_ENCODER_ADDRESS,
    KV_DTYPES,
    KV_TRANSPORTS,
    ServiceConfig,
    check_address,
    check_port,
)
from shared.config.memory_size import parse_memory_size
from shared.device import check_device_name, is_cuda, same_device


@dataclass(frozen=True, kw_only=True)
class DecoderServiceConfig(ServiceConfig):
    """Settings of the decoder service: the ``ServiceConfig`` fields, and these.

    Attributes:
        port: gRPC port of the public API.
        encoder_address: ``host:port`` of the encoder service, or ``registry``: per Encode, a live encoder
            replica from the Redis registry that serves this model and can reach this decoder's KV pool, least
            loaded first (``decoder_svc.replicas.encoder_pool``).
        encoder_tls_ca: PEM bundle of the CA that signed the encoders' certificates (their ``--tls-cert``): Encode
            travels over TLS (issue 34 item 3: where decoder and encoder sit on other hosts, a plaintext Encode can
            be read and captured on the way). Empty: plaintext (same host, or a network of its own).
        encoder_tls_cert / encoder_tls_key: this decoder's client certificate and key, for encoders that require
            mutual TLS (their ``--tls-client-ca``); both or neither.
        encoder_tls_server_name: the name the encoders' certificates carry when it is not the address's host.
        redis_url: Redis holding request state and the replica registry.
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
            encoder writes / sends: ``float32``, ``float16`` or ``bfloat16``
            (half the bytes; accuracy in docs/kv_transport.md); empty (the
            default): ``bfloat16`` for ``dtype bfloat16`` on the CPU, else
            ``float32``. An explicit value is kept whatever the ``dtype``.
        encode_timeout_s: an Encode call slower than this fails the request
            with UNAVAILABLE and frees its blocks (seconds); the time waiting for
            an unreachable encoder counts (``decoder_svc.session.encode_client``), and
            the request's gRPC deadline, if earlier, ends the call.
        max_decode_hold_ms: while requests wait for their cross KV, model steps
            are held for at most this long before one runs (milliseconds), so
            a burst starts decoding together and the encoder gets the cores it
            shares with the decoder (``decoder_svc.core.engine_loop``); 0 = never hold.
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
            window is decoded long-form, window by window, in one request
            (``decoder_svc.session.whisper_session``). Default 600 s (10 min, 20 or more
            windows; 38 MB of float32 PCM, within the 64 MiB gRPC message limit).
        max_audio_sample_rate: highest sample rate of an uploaded file or raw PCM (Hz); higher gets
            INVALID_ARGUMENT before decoding. 192000 (hi-res audio); decode time grows with the input
            rate, memory does not (``decoder_svc.session.audio``). At most 768000 (FFmpeg's resampler).
        max_audio_channels: most channels of an uploaded file (8, 7.1 surround); more gets INVALID_ARGUMENT
            before decoding.
        audio_decode_workers: audio files decoded at once, on a pool of their own (not the executor Redis
            writes and readiness share); more uploads queue for it, so a burst of large files costs at most
            this many decodes' memory (each: its 16 kHz output plus one frame).
        decoding_rules: Whisper's decoding rules when a request names none: ``openai``
            (default; openai-whisper's ``transcribe()`` as faster-whisper runs it, with the
            VAD gate and fallback on every request) or ``hf`` (HF transformers' ``generate``,
            the reference of the parity tests); see ``decoder_svc.whisper.quality``.
        quantize: ``none`` or ``int8`` (opt-in int8 decoder weights and output
            projection with per-token activation scales, encoder-decoder models; see
            ``shared.models.quantize``).
        kv_cache_memory: memory for both KV cache groups: bytes (``2GiB``,
            ``512MB``, ``1073741824``) or a fraction of the memory free after the
            model is loaded (``0.3`` or ``30%``; RAM on CPU, GPU memory on a
            GPU). Split between self and cross blocks in proportion to what one
            max-length request needs of each (``decoder_svc.core.kv_budget``); an
            explicit ``num_self_blocks`` / ``num_cross_blocks`` wins for its
            group. Empty: size for ``max_num_seqs`` max-length requests.
        encoder_cache: 1 = a request whose encoder input (audio samples /
            source ids) equals that of an unfinished request shares its
            cross-attention KV instead of being encoded (``decoder_svc.core.encoder_cache``); 0 = off.
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
        shutdown_grace_s: on SIGTERM / SIGINT, how long running Generate calls
            may take to finish (seconds) while health reports NOT_SERVING and
            new calls get UNAVAILABLE; calls still running then end with
            UNAVAILABLE ("shutting down ... send it again") and are recorded
            FAILED. Keep it below the orchestrator's kill timeout (compose's
            ``stop_grace_period``, 10 s by default; Kubernetes' 30 s).
        max_waiting_requests: most Generate requests queued (admitted, no first
            token yet) with a priority at least as good as a new one's; beyond it
            a new request gets RESOURCE_EXHAUSTED at once, before its input is
            parsed (``decoder_svc.session.admission``). The bound of a cold start's burst,
            before the queue's service rate is measured. 32: Whisper tiny.en
            requests complete at about one a second on 2 CPU cores past capacity
            (docs/benchmarks.md, online rate sweep), so a burst of 32 waits about
            ``max_queue_time_s``; and it admits the largest burst the benchmarks
            send (seq2seq: 32 at once).
        max_queue_time_s: a new request whose estimated wait (queued requests
            ahead of it x the median measured time between two of them starting,
            or the current stall if longer; without a busy queue, the time until
            a batch seat frees, from finished requests' service times; 0 with
            nothing ahead and a seat free: see ``decoder_svc.session.admission``) is
            longer than this gets RESOURCE_EXHAUSTED at once (seconds); one whose
            gRPC deadline is shorter than its estimated wait gets DEADLINE_EXCEEDED.
            30 s: the wait a client of an interactive service still accepts; the
            estimate follows the machine's measured rate, so the bound holds on any.
        max_input_tokens: most source tokens of a text request (0 = the model's max source positions).
        max_new_tokens: most tokens generated per sample; a larger ``max_tokens`` gets INVALID_ARGUMENT
            (0 = the model's max target length).
        min_client_priority: the most urgent ``priority`` a request may ask for (lower = earlier); a lower value
            gets INVALID_ARGUMENT. 0: clients can only lower their own urgency, never jump others' queue or win
            preemption over them; set it lower (-10) where the clients are trusted to rank their own requests.
        priority_token_file: a file holding the token that lets a call ask for a priority more urgent than
            ``min_client_priority`` (down to ``MIN_PRIORITY``): the call sends it as metadata
            ``x-encdec-priority-token`` (a wrong one: PERMISSION_DENIED). Empty: no call may.
        max_n: most samples per request (``n``), at most ``decoder_svc.core.sampling_params.MAX_N``.
        max_beams: most beams per request, at most ``decoder_svc.core.sampling_params.MAX_BEAMS``.
        realtime_step_ms: a realtime stream's running utterance is re-decoded this often (ms; ``TranscribeStream``,
            ``decoder_svc.realtime``): shorter gives earlier partials and finals for more compute per stream.
        max_realtime_streams: live ``TranscribeStream`` calls at most; a new one beyond gets RESOURCE_EXHAUSTED
            (so does one while the streams' steps take longer than ``realtime_step_ms``: the machine is full).
        realtime_capacity: seconds of decoding per second of audio the live streams may need in all, by the
            measured cost of a step (``decoder_svc.realtime.stream_admission``); a stream that would take them
            past it gets RESOURCE_EXHAUSTED at open. 1.0: the replica's whole time; 0: no such limit.
    """

    port: int = 50051
    encoder_address: str = DEFAULT_ENCODER_ADDRESS
    encoder_tls_ca: str = ""
    encoder_tls_cert: str = ""
    encoder_tls_key: str = ""
    encoder_tls_server_name: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 4096
    num_self_blocks: int = 0
    num_cross_blocks: int = 0
    kv_transport: str = "shm"
    kv_dist_address: str = "127.0.0.1:0"
    kv_transfer_dtype: str = ""
    encode_timeout_s: float = 120.0
    max_decode_hold_ms: float = 1000.0
    decode_hold_gap_steps: int = 20
    stream_interval: int = 1
    max_audio_s: float = 600.0
    max_audio_sample_rate: int = 192_000
    max_audio_channels: int = 8
    audio_decode_workers: int = 2
    decoding_rules: str = "openai"
    kv_cache_memory: str = ""
    metrics_port: int = 9400
    encoder_cache: int = 1
    attention_backend: str = "torch"
    shutdown_grace_s: float = 8.0
    max_waiting_requests: int = 32
    max_queue_time_s: float = 30.0
    max_input_tokens: int = 0
    max_new_tokens: int = 0
    min_client_priority: int = 0
    priority_token_file: str = ""
    max_n: int = 16
    max_beams: int = 16
    realtime_step_ms: int = 1000
    max_realtime_streams: int = 16
    realtime_capacity: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
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
        self._check_model_device()
        self._check_kv_device()
        self._check_kv_dist(self.kv_transport == "torch_dist")
        host, _, port = self.kv_dist_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"kv_dist_address must be host:port, got {self.kv_dist_address!r}")
        check_port(int(port))
        if not self.kv_transfer_dtype:  # a bfloat16 model on the CPU: KV in bfloat16 unless set
            cpu_bf16 = self.dtype == "bfloat16" and not is_cuda(self.device)
            object.__setattr__(self, "kv_transfer_dtype", "bfloat16" if cpu_bf16 else "float32")
        if self.kv_transfer_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_transfer_dtype must be one of: {', '.join(KV_DTYPES)}; got {self.kv_transfer_dtype!r}"
            )
        for name, top in (("max_n", 16), ("max_beams", 16)):  # decoder_svc.core.sampling_params.MAX_N / MAX_BEAMS
            if not 1 <= getattr(self, name) <= top:
                raise ValueError(f"{name} must be in [1, {top}], got {getattr(self, name)}")
        for name in ("max_input_tokens", "max_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = the model's limit), got {getattr(self, name)}")
        if self.encoder_address != "registry":
            try:
                check_address(self.encoder_address, "encoder_address")
            except ValueError as exc:
                raise ValueError(f"{exc}, or 'registry' (encoders from the Redis registry)") from None
        if not 100 <= self.realtime_step_ms <= 10_000:
            raise ValueError(f"realtime_step_ms must be in [100, 10000], got {self.realtime_step_ms}")
        if not 0 <= self.max_realtime_streams <= 1024:
            raise ValueError(f"max_realtime_streams must be in [0, 1024] (0 = none), got {self.max_realtime_streams}")
        if not 0 <= self.realtime_capacity <= 64:  # also refuses NaN
            raise ValueError(f"realtime_capacity must be in [0, 64] (0 = no limit), got {self.realtime_capacity}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if not 0 < self.max_queue_time_s < float("inf"):  # also refuses NaN
            raise ValueError(f"max_queue_time_s must be > 0 and finite (seconds), got {self.max_queue_time_s}")
        if self.decoding_rules not in ("openai", "hf"):
            raise ValueError(f"decoding_rules must be 'openai' or 'hf', got {self.decoding_rules!r}")
        for name in ("encode_timeout_s", "max_audio_s"):
            if not 0 < getattr(self, name) < float("inf"):  # also refuses NaN
                raise ValueError(f"{name} must be > 0 and finite (seconds), got {getattr(self, name)}")
        if not 1_000 <= self.max_audio_sample_rate <= 768_000:  # the largest rate FFmpeg's resampler takes
            raise ValueError(f"max_audio_sample_rate must be in [1000, 768000] Hz, got {self.max_audio_sample_rate}")
        if not 1 <= self.max_audio_channels <= 64:
            raise ValueError(f"max_audio_channels must be in [1, 64], got {self.max_audio_channels}")
        if not 1 <= self.audio_decode_workers <= 64:
            raise ValueError(f"audio_decode_workers must be in [1, 64], got {self.audio_decode_workers}")
        if not self.max_decode_hold_ms >= 0:  # also refuses NaN
            raise ValueError(f"max_decode_hold_ms must be >= 0 (0 = never hold), got {self.max_decode_hold_ms}")
        if self.decode_hold_gap_steps < 0:
            raise ValueError(f"decode_hold_gap_steps must be >= 0, got {self.decode_hold_gap_steps}")
        self._check_quantize()
        if self.attention_backend != "torch":
            from kernels.attention_backend import check_attention_backend  # imports torch: only off the default

            check_attention_backend(self.attention_backend, self.device)

    def _check_kv_device(self) -> None:
        """Resolves an empty ``kv_device`` to ``device``; refuses KV caches the model could not attend over."""
        if not self.kv_device:
            object.__setattr__(self, "kv_device", self.device)
        check_device_name(self.kv_device, "kv_device")
        if not same_device(self.kv_device, self.device):
            raise ValueError(
                f"kv_device {self.kv_device!r} differs from device {self.device!r}: the decoder attends over both "
                "KV caches on its model's device; leave kv_device unset (it follows device) or set both alike"
            )
        if is_cuda(self.device) and self.kv_transport == "shm":
            raise ValueError(
                f"kv_transport shm keeps the cross-KV pool in host shared memory, which a decoder on {self.device!r} "
                "cannot attend over: use kv_transport cuda_ipc (encoder on the same host) or torch_dist with "
                "kv_dist_backend nccl, or device cpu"
            )
        if not is_cuda(self.device) and self.kv_transport == "cuda_ipc":
            raise ValueError(
                "kv_transport cuda_ipc puts the cross-KV pool on a GPU: set device cuda (kv_device follows it), "
                "or use kv_transport shm on the CPU"
            )
