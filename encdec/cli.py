"""The ``encdec`` command line: serve, run everything, transcribe, bench.

The flags are built in ``encdec.parser``; this module holds what each sub-command
does and dispatches on ``command``. A bench sub-command runs its own entry point
(the parser's ``func``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import sys
import time

from encdec import DATA_DIR
from encdec.parser import build_parser
from shared.config import DecoderServiceConfig, EncoderServiceConfig, config_from

BUNDLED_CLIP = DATA_DIR / "sample.wav"


def _serve_encoder(args: argparse.Namespace) -> int:
    from shared.compute_thread import short_omp_spin

    short_omp_spin()  # before torch loads: see shared.compute_thread
    from encoder_svc.startup import run

    run(config_from(EncoderServiceConfig, args))
    return 0


def _serve_decoder(args: argparse.Namespace) -> int:
    from shared.compute_thread import short_omp_spin

    short_omp_spin()  # before torch loads: see shared.compute_thread
    from decoder_svc.startup import run

    run(config_from(DecoderServiceConfig, args))
    return 0


def _serve_http(args: argparse.Namespace) -> int:
    from gateway_svc.config import GatewayConfig
    from gateway_svc.startup import run

    try:
        run(config_from(GatewayConfig, args), log_level=args.log_level)
    except KeyboardInterrupt:  # uvicorn re-raises the signal after its graceful shutdown
        pass
    return 0


def _services(args: argparse.Namespace, log_level: str = "INFO"):
    from encdec.launcher import Services

    dtype = ["--dtype", args.dtype] if getattr(args, "dtype", None) else []
    return Services(
        log_level=log_level,
        model=args.model,
        redis_url=args.redis_url or os.environ.get("REDIS_URL"),
        encoder_port=args.encoder_port,
        decoder_port=args.decoder_port,
        extra_encoder_args=[*dtype, *shlex.split(args.encoder_args)],  # a later --dtype (the service's own) wins
        extra_decoder_args=[*dtype, *shlex.split(args.decoder_args)],
        embed_model=args.embed_model,
        embed_port=args.embed_port,
        http_port=None if getattr(args, "no_http", True) else args.http_port,
        extra_http_args=shlex.split(getattr(args, "http_args", "")),
        internal_token=True,  # Encode accepts only this decoder (shared.internal_auth)
    )


def _up(args: argparse.Namespace) -> int:
    from shared.redis_url import redact_url

    if args.host:  # what every service reads as its --host default; the launcher keeps the encoder on loopback
        os.environ["ENCDEC_HOST"] = args.host
    services = _services(args, log_level=args.log_level)
    print(
        "starting redis, encoder, decoder" + (", embed" if args.embed_model else "") + " and the HTTP gateway ..."
        if not args.no_http
        else "starting redis, encoder and decoder ...",
        flush=True,
    )
    stop: list[int] = []
    # Both handled explicitly: a shell starts background jobs with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    with services:
        public = f"decoder (gRPC) at {services.decoder_address}"
        if services.embed_model:
            public += f", embed (gRPC) at {services.embed_address}"
        if services.http_port is not None:
            public += f", OpenAI-compatible HTTP API at {services.http_url}/v1"
        print(
            f"ready: {public}, encoder at {services.encoder_address}, redis at {redact_url(services.redis_url)}. "
            "Ctrl-C stops all.",
            flush=True,
        )
        if services.public_token_file:  # bound beyond loopback: the public ports need the generated secrets
            print(
                f"bound beyond loopback: gRPC calls need the bearer token in {services.public_token_file} "
                f"(encdec transcribe --token-file {services.public_token_file})",
                flush=True,
            )
        if services.api_key_file:
            print(f"the HTTP API needs 'Authorization: Bearer <the key in {services.api_key_file}>'", flush=True)
        while not stop and all(p.poll() is None for p in services.procs):
            time.sleep(0.5)
        dead = [f"{name} (exit code {code})" for name, code in services.exited().items()]
        if dead and not stop:
            print(
                f"encdec: error: {', '.join(dead)} stopped; stopping the rest (its log says why)",
                file=sys.stderr,
                flush=True,
            )
        print("stopping ...", flush=True)
    return 1 if dead and not stop else 0


def _print_results(paths: list[str], results, start: float) -> int:
    """One line per file on stderr (``results[i]`` is the outcome of ``paths[i]``); 1 if any failed."""
    from encdec.client import Transcript

    failed = 0
    for path, r in zip(paths, results):
        if isinstance(r, Transcript):
            language = f", language {r.language} ({r.language_probability:.2f})" if r.language else ""
            print(
                f"{r.path}: {r.completion_tokens} tokens, finish_reason={r.finish_reason}, {r.seconds:.2f} s{language}",
                file=sys.stderr,
            )
        else:
            failed += 1
            if hasattr(r, "code"):
                detail = f"{r.code().name}: {r.details()}"
            elif isinstance(r, OSError):
                detail = f"cannot read the file: {r.strerror or r}"
            else:
                detail = repr(r)
            print(f"error: {path}: {detail}", file=sys.stderr)
    print(f"wall time {time.perf_counter() - start:.2f} s for {len(results)} file(s)", file=sys.stderr)
    return 1 if failed else 0


def _whisper_options(args: argparse.Namespace):
    """``encdec transcribe``'s Whisper flags as ``decoder_pb2.WhisperOptions`` (None when all are defaults).

    Raises:
        ValueError: srt / vtt with ``--timestamps none`` (subtitles need segment times).
    """
    from shared.proto import decoder_pb2

    timestamps = args.timestamps or ("none" if args.format == "text" else "segment")
    if args.format in ("srt", "vtt") and timestamps == "none":
        raise ValueError(f"--format {args.format} needs segment timestamps: drop --timestamps none")
    fields = {
        "language": args.language,
        "task": args.task,
        "prompt": args.prompt,
        "timestamps": decoder_pb2.TimestampGranularity.Value(f"TIMESTAMP_GRANULARITY_{timestamps.upper()}"),
        "condition_on_previous_text": args.condition_on_previous_text,
        "temperatures": args.temperature,  # explicit: only these; unset: the server's fallback list
        "compression_ratio_threshold": args.compression_ratio_threshold,
        "logprob_threshold": args.logprob_threshold,
        "no_speech_threshold": args.no_speech_threshold,
        "vad_filter": args.vad or None,
        "decoding_rules": args.decoding_rules,
        "best_of": args.best_of,
        "vad_gate": args.vad_gate,
        "vad_gate_min_silence_s": args.vad_gate_min_silence_s,
        "hallucination_silence_threshold": args.hallucination_silence_threshold,
        "clip_timestamps": args.clip_timestamps,
        "language_detection_segments": args.language_detection_segments,
    }
    options = decoder_pb2.WhisperOptions(**{k: v for k, v in fields.items() if v is not None})
    return options if options != decoder_pb2.WhisperOptions() else None


def client_security(args: argparse.Namespace):
    """``shared.tls.ClientSecurity`` from a client sub-command's flags (``encdec.parser.add_client_security``).

    Raises:
        ValueError: both ``--token`` and ``--token-file``, an unreadable token file, or a lone ``--tls-cert`` /
            ``--tls-key``.
    """
    from shared.public_auth import read_token_file
    from shared.tls import ClientSecurity

    token = args.token or ""
    if args.token_file:
        if args.token:
            raise ValueError("--token and --token-file are both set (or $ENCDEC_TOKEN): keep one")
        token = read_token_file(args.token_file, "--token-file")
    return ClientSecurity(
        token=token,
        tls_ca=args.tls_ca or "",
        tls_cert=args.tls_cert or "",
        tls_key=args.tls_key or "",
        tls_server_name=args.tls_server_name or "",
    )


# Flags of `encdec transcribe` a realtime stream has no field for, and the realtime-only ones (None unless given).
NOT_REALTIME = (
    *("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens", "repetition_penalty"),
    *("no_repeat_ngram_size", "stop", "condition_on_previous_text", "compression_ratio_threshold"),
    *("logprob_threshold", "no_speech_threshold", "decoding_rules", "best_of", "vad_gate", "vad_gate_min_silence_s"),
    *("hallucination_silence_threshold", "clip_timestamps", "language_detection_segments"),
)
REALTIME_ONLY = (
    *("realtime_speed", "sample_rate", "encoding", "step_ms", "partials", "silence_duration_ms", "vad_threshold"),
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _realtime_config(args: argparse.Namespace):
    """``encdec transcribe --realtime``'s flags as ``decoder_pb2.RealtimeConfig``.

    Raises:
        ValueError: several inputs, a flag a stream does not take, raw-PCM flags for a file.
    """
    from shared.proto import decoder_pb2

    if len(args.files) != 1:
        raise ValueError("--realtime streams one input: a FILE, or - for raw PCM on standard input")
    if given := [_flag(d) for d in NOT_REALTIME if getattr(args, d) is not None] + ["--vad"] * args.vad:
        raise ValueError(f"{', '.join(given)}: not for --realtime (a stream decodes greedily, its VAD cuts turns)")
    if args.files[0] != "-" and (args.sample_rate is not None or args.encoding is not None):
        raise ValueError("--sample-rate / --encoding describe raw PCM on standard input (--realtime -)")
    timestamps = args.timestamps or ("none" if args.format == "text" else "segment")
    if args.format in ("srt", "vtt") and timestamps == "none":
        raise ValueError(f"--format {args.format} needs segment timestamps: drop --timestamps none")
    vad = decoder_pb2.RealtimeVad(disabled=args.turn_detection is False)
    if args.vad_threshold is not None:
        vad.threshold = args.vad_threshold
    if args.silence_duration_ms is not None:
        vad.silence_duration_ms = args.silence_duration_ms
    config = decoder_pb2.RealtimeConfig(
        language=args.language or "",
        task=args.task or "",
        prompt=args.prompt or "",
        sample_rate=args.sample_rate or 0,
        encoding=args.encoding or "",
        vad=vad,
        timestamps=decoder_pb2.TIMESTAMP_GRANULARITY_WORD if timestamps == "word" else 0,
    )
    if args.partials is False:
        config.partials = False
    if args.step_ms is not None:
        config.step_ms = args.step_ms
    return config


def _transcribe_realtime(args: argparse.Namespace) -> int:
    """``encdec transcribe --realtime FILE|-``: one TranscribeStream, finals on standard output (or
    ``--output-dir``), partials in place on a terminal, the stream's totals on standard error."""
    import contextlib
    from pathlib import Path

    import grpc

    from decoder_svc.session.audio import AudioError, decode_audio
    from encdec.client import SUFFIXES
    from encdec.realtime_client import (
        Pacing,
        RealtimePrinter,
        chunk_bytes,
        pcm16,
        pcm_chunks,
        reader_chunks,
        transcribe_realtime,
    )

    config = _realtime_config(args)
    source = args.files[0]
    security = client_security(args)
    stdin = source == "-"
    pacing = Pacing(args.realtime_speed if args.realtime_speed is not None else 0.0 if stdin else 1.0)
    size = chunk_bytes(config.sample_rate or 16000, config.encoding or "pcm_s16le")
    if not stdin:
        try:
            pcm = pcm16(decode_audio(Path(source).read_bytes()))  # 16 kHz mono s16le
        except OSError as exc:
            print(f"error: {source}: cannot read the file: {exc.strerror or exc}", file=sys.stderr)
            return 1
        except AudioError as exc:
            print(f"error: {source}: {exc}", file=sys.stderr)
            return 1
    times = (args.timestamps or "none") != "none"
    start = time.perf_counter()

    async def run(out) -> object:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def interrupted() -> None:  # the first Ctrl-C ends the input (the tail is still transcribed), a second aborts
            stop.set()
            loop.remove_signal_handler(signal.SIGINT)
            print("\nencdec: input ended (Ctrl-C); transcribing the rest", file=sys.stderr, flush=True)

        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread, or no signals
            loop.add_signal_handler(signal.SIGINT, interrupted)

        async def file_chunks():
            for chunk in pcm_chunks(pcm, size):
                if stop.is_set():
                    return
                yield chunk

        chunks = reader_chunks(sys.stdin.fileno(), size, stop) if stdin else file_chunks()
        live = out is sys.stdout and out.isatty()
        printer = RealtimePrinter(out, args.format, times, live)
        return await transcribe_realtime(args.address, config, chunks, printer, pacing, security)

    name = "stdin" if stdin else Path(source).stem
    try:
        if args.output_dir is None:
            end = asyncio.run(run(sys.stdout))
        else:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(args.output_dir) / (name + SUFFIXES[args.format]), "w", encoding="utf-8") as out:
                end = asyncio.run(run(out))
    except grpc.aio.AioRpcError as exc:
        print(f"error: {source}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:  # reading standard input
        print(f"error: {source}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("encdec: aborted", file=sys.stderr)
        return 130
    if end is None:
        print(f"error: {source}: the stream ended without its end message", file=sys.stderr)
        return 1
    e = end.message.end
    language = f", language {e.language}" if e.language else ""
    print(
        f"{source}: {e.finals} finals in {e.utterances} utterances, {e.audio_s:.2f} s of audio{language}, "
        f"{e.usage.completion_tokens} tokens; wall time {time.perf_counter() - start:.2f} s",
        file=sys.stderr,
    )
    return 0


def _transcribe(args: argparse.Namespace) -> int:
    from pathlib import Path

    from encdec.client import transcribe_files

    if args.realtime:
        return _transcribe_realtime(args)
    if given := [_flag(d) for d in REALTIME_ONLY if getattr(args, d) is not None]:
        raise ValueError(f"{', '.join(given)}: only with --realtime")
    if args.turn_detection is not None:
        raise ValueError("--no-turn-detection: only with --realtime")
    start = time.perf_counter()
    many = len(args.files) > 1
    if many and args.format in ("srt", "vtt") and args.output_dir is None:
        raise ValueError(f"--format {args.format} of several files needs --output-dir (one subtitle file each)")
    stems = [Path(f).stem for f in args.files]
    if args.output_dir is not None and len(set(stems)) < len(stems):
        raise ValueError("--output-dir: two files have the same name stem; their outputs would overwrite each other")
    keys = (
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "stop",
    )
    sampling = {k: getattr(args, k) for k in keys}
    # Short-form (one window, no fallback) decodes at the first temperature.
    sampling["temperature"] = args.temperature[0] if args.temperature else None
    results = asyncio.run(
        transcribe_files(
            args.address,
            args.files,
            whisper=_whisper_options(args),
            output_format=args.format,
            output_dir=args.output_dir,
            security=client_security(args),
            **sampling,
        )
    )
    return _print_results(args.files, results, start)


def _demo(args: argparse.Namespace) -> int:
    from encdec.client import transcribe_files

    files = args.files or [str(BUNDLED_CLIP)]
    print("starting redis, encoder and decoder as separate processes ...", file=sys.stderr, flush=True)
    with _services(args, log_level="WARNING") as services:
        print(f"transcribing {', '.join(files)} through {services.decoder_address}:", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results = asyncio.run(transcribe_files(services.decoder_address, files))
        code = _print_results(files, results, start)
    return code


def _bench(args: argparse.Namespace) -> int:
    """``encdec bench [<name>]``: the bench's entry point, which the parser sets as ``func``."""
    return args.func(args)


COMMANDS = {
    "serve-encoder": _serve_encoder,
    "serve-decoder": _serve_decoder,
    "serve-http": _serve_http,
    "up": _up,
    "transcribe": _transcribe,
    "demo": _demo,
    "bench": _bench,
}
"""What each ``encdec`` sub-command runs: ``handler(args) -> exit code``."""


def main(argv: list[str] | None = None) -> int:
    from shared.errors import (
        BIND_ERROR_EXIT,
        BindError,
        ServicesError,
        UnavailableError,
    )

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "bench" and getattr(args, "cpu_isa", None):
            from encdec.bench.cpu_isa import cap_process

            cap_process(args.cpu_isa, argv)  # returns once the cap is in this process's environment
        return COMMANDS[args.command](args)
    except ValueError as exc:  # config validation
        print(f"encdec: error: {exc}", file=sys.stderr)
        return 2
    except BindError as exc:
        print(f"encdec: error: {exc}", file=sys.stderr)
        return BIND_ERROR_EXIT
    # `up` / `demo`: a service did not start; a service: Redis unreachable
    except (ServicesError, UnavailableError) as exc:
        print(f"encdec: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
