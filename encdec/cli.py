"""The ``encdec`` command line: serve, run everything, transcribe."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from encdec import DATA_DIR

from shared.config import (
    DEFAULT_DECODER_ADDRESS,
    DecoderServiceConfig,
    EncoderServiceConfig,
    add_config_arguments,
    config_from,
)

BUNDLED_CLIP = DATA_DIR / "sample.wav"


def _serve_encoder(args: argparse.Namespace) -> int:
    from shared.compute_thread import short_omp_spin

    short_omp_spin()  # before torch loads: see shared.compute_thread
    from encoder_svc.server import run

    run(config_from(EncoderServiceConfig, args))
    return 0


def _serve_decoder(args: argparse.Namespace) -> int:
    from shared.compute_thread import short_omp_spin

    short_omp_spin()  # before torch loads: see shared.compute_thread
    from decoder_svc.startup import run

    run(config_from(DecoderServiceConfig, args))
    return 0


def _services(args: argparse.Namespace, log_level: str = "INFO"):
    from encdec.launcher import Services

    return Services(
        log_level=log_level,
        model=args.model,
        redis_url=args.redis_url or os.environ.get("REDIS_URL"),
        encoder_port=args.encoder_port,
        decoder_port=args.decoder_port,
        extra_encoder_args=shlex.split(args.encoder_args),
        extra_decoder_args=shlex.split(args.decoder_args),
    )


def _up(args: argparse.Namespace) -> int:
    services = _services(args, log_level=args.log_level)
    print("starting redis, encoder and decoder ...", flush=True)
    stop: list[int] = []
    # Both handled explicitly: a shell starts background jobs with SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    with services:
        print(f"ready: decoder (public API) at {services.decoder_address}, encoder at {services.encoder_address}, "
              f"redis at {services.redis_url}. Ctrl-C stops all.", flush=True)
        while not stop and all(p.poll() is None for p in services.procs):
            time.sleep(0.5)
        dead = [f"{name} (exit code {code})" for name, code in services.exited().items()]
        if dead and not stop:
            print(f"encdec: error: {', '.join(dead)} stopped; stopping the rest (its log says why)", file=sys.stderr, flush=True)
        print("stopping ...", flush=True)
    return 1 if dead and not stop else 0


def _print_results(results, start: float) -> int:
    from encdec.client import Transcript

    failed = 0
    for r in results:
        if isinstance(r, Transcript):
            print(f"{r.path}: {r.completion_tokens} tokens, finish_reason={r.finish_reason}, {r.seconds:.2f} s", file=sys.stderr)
        else:
            failed += 1
            detail = f"{r.code().name}: {r.details()}" if hasattr(r, "code") else repr(r)
            print(f"error: {detail}", file=sys.stderr)
    print(f"wall time {time.perf_counter() - start:.2f} s for {len(results)} file(s)", file=sys.stderr)
    return 1 if failed else 0


def _transcribe(args: argparse.Namespace) -> int:
    from encdec.client import transcribe_files

    start = time.perf_counter()
    keys = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens", "repetition_penalty", "no_repeat_ngram_size", "stop")
    results = asyncio.run(transcribe_files(args.address, args.files, **{k: getattr(args, k) for k in keys}))
    return _print_results(results, start)


def _demo(args: argparse.Namespace) -> int:
    from encdec.client import transcribe_files

    files = args.files or [str(BUNDLED_CLIP)]
    print("starting redis, encoder and decoder as separate processes ...", file=sys.stderr, flush=True)
    with _services(args, log_level="WARNING") as services:
        print(f"transcribing {', '.join(files)} through {services.decoder_address}:", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results = asyncio.run(transcribe_files(services.decoder_address, files))
        code = _print_results(results, start)
    return code


def _bench_whisper(args: argparse.Namespace) -> int:
    from encdec.bench.whisper import main as bench_main

    return bench_main(args)


def _bench_embed(args: argparse.Namespace) -> int:
    from encdec.bench.embed import main as bench_main

    return bench_main(args)


def _bench_module(name: str):
    """``func`` for ``encdec bench <name>``: the module's ``main(args)``, imported when run."""

    def run(args: argparse.Namespace) -> int:
        import importlib

        return importlib.import_module(f"encdec.bench.{name}").main(args)

    return run


def _bench_default(args: argparse.Namespace) -> int:
    """``encdec bench`` with no sub-command = ``encdec bench all`` with its defaults."""
    all_args = build_parser().parse_args(["--log-level", args.log_level, "bench", "all"])
    return all_args.func(all_args)


def _add_bench(sub) -> None:
    """``encdec bench <name>``: one sub-command per benchmark; each prints a Markdown table.
    No sub-command (or ``all``) runs them all (``encdec.bench.suite``)."""
    from encdec.bench import online, seq2seq, suite
    from encdec.bench.table import positive_int

    bench = sub.add_parser("bench", help="benchmarks against HF transformers / CTranslate2 / sentence-transformers; "
                                         "no sub-command runs them all")
    bench.set_defaults(func=_bench_default)
    benches = bench.add_subparsers(dest="bench")

    p = benches.add_parser("all", help="every bench in one invocation: Markdown tables, --json, --plot PNG")
    suite.add_arguments(p)
    p.set_defaults(func=_bench_module("suite"))

    p = benches.add_parser("seq2seq", help="decode-bound T5 / BART shapes: our services vs HF generate vs CTranslate2")
    seq2seq.add_arguments(p)
    p.set_defaults(func=_bench_module("seq2seq"))

    p = benches.add_parser("online", help="Poisson arrivals against our services: TTFT / TPOT p50, p99, throughput")
    online.add_arguments(p)
    p.set_defaults(func=_bench_module("online"))

    p = benches.add_parser("whisper", help="Whisper tiny.en: our services vs HF vs CTranslate2")
    p.add_argument("--clips", default=str(BUNDLED_CLIP.parent), help="folder of .wav/.flac clips (default: the bundled ones)")
    p.add_argument("--requests", type=int, default=16, help="requests per system (clips cycled)")
    p.add_argument("--concurrency", default="1,4,16", help="our services' client concurrency levels")
    p.add_argument("--threads", type=int, default=2, help="torch / CTranslate2 threads per system (per service for ours)")
    p.add_argument("--skip-ct2", action="store_true", help="skip CTranslate2 (needs the [bench] extra)")
    p.add_argument("--int8", action="store_true", help="also run our services with --quantize int8 (opt-in int8 weights)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs of each batched system and each concurrency level; the median is reported")
    p.add_argument("--address", default=None, help="use running services at this decoder address instead of starting them")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=_bench_whisper)

    p = benches.add_parser("embed", help="Embed (all-MiniLM-L6-v2): our EmbedService vs sentence-transformers, batch 1 and 32")
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="encoder-only model name or directory")
    p.add_argument("--requests-b1", type=int, default=200, help="one-sentence requests")
    p.add_argument("--requests-b32", type=int, default=30, help="32-sentence requests")
    p.add_argument("--threads", type=int, default=2, help="torch threads per system")
    p.add_argument("--address", default=None, help="use a running encoder service (EmbedService) at this address")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=_bench_embed)

    from encdec.bench import transfer  # imports torch only when the bench runs

    p = benches.add_parser("transfer", help="cross-KV transports (shm, torch_dist, cuda_ipc) in GB/s next to a plain memcpy")
    transfer.add_arguments(p)
    p.set_defaults(func=transfer.run)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=None, help="0 (default) = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None, help="1 (default) = off")
    p.add_argument("--no-repeat-ngram-size", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _add_services(p: argparse.ArgumentParser, encoder_port: int, decoder_port: int) -> None:
    p.add_argument("--model", default=None, help="model name or directory (default whisper-tiny.en)")
    p.add_argument("--redis-url", default=None, help="external Redis (default: $REDIS_URL, else start a local redis-server)")
    p.add_argument("--encoder-port", type=int, default=encoder_port, help="0 picks a free port")
    p.add_argument("--decoder-port", type=int, default=decoder_port, help="0 picks a free port")
    p.add_argument("--encoder-args", default="", help="more serve-encoder flags, one string: --encoder-args='--max-batch-wait-ms 100'")
    p.add_argument("--decoder-args", default="", help="more serve-decoder flags, one string: --decoder-args='--stream-interval 4 --max-num-seqs 32'")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="encdec", description="Encoder-decoder serving: Whisper over split encoder/decoder services.")
    parser.add_argument("--log-level", default=os.environ.get("ENCDEC_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve-encoder", help="run the encoder service")
    add_config_arguments(p, EncoderServiceConfig)
    p.set_defaults(func=_serve_encoder)

    p = sub.add_parser("serve-decoder", help="run the decoder service")
    add_config_arguments(p, DecoderServiceConfig)
    p.set_defaults(func=_serve_decoder)

    p = sub.add_parser("up", help="start redis (if needed), encoder and decoder; Ctrl-C stops all")
    _add_services(p, 50061, 50051)
    p.set_defaults(func=_up)

    p = sub.add_parser("transcribe", help="transcribe audio files (sent concurrently) and stream the text")
    p.add_argument("files", nargs="+")
    p.add_argument("--address", default=os.environ.get("ENCDEC_DECODER_ADDRESS", DEFAULT_DECODER_ADDRESS))
    _add_sampling(p)
    p.set_defaults(func=_transcribe)

    p = sub.add_parser("demo", help="start everything, transcribe the bundled clip (or FILES), stop")
    p.add_argument("files", nargs="*")
    _add_services(p, 0, 0)  # free ports: a demo never clashes with a running `encdec up`
    p.set_defaults(func=_demo)

    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shared.errors import (
        BIND_ERROR_EXIT,
        BindError,
        ServicesError,
        UnavailableError,
    )

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # config validation
        print(f"encdec: error: {exc}", file=sys.stderr)
        return 2
    except BindError as exc:
        print(f"encdec: error: {exc}", file=sys.stderr)
        return BIND_ERROR_EXIT
    except (ServicesError, UnavailableError) as exc:  # `up` / `demo`: a service did not start; a service: Redis unreachable
        print(f"encdec: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
