"""The ``encdec`` argument parser: every sub-command's flags, built in this one module.

``encdec.cli`` parses with it and dispatches on ``command``; ``encdec.launcher``
reads a decoder's flags with it as the decoder will; ``encdec bench all`` builds
each bench's arguments with it. So it imports none of them: a bench sub-command's
``func`` names the bench's entry point, imported only when the bench runs (torch
and the services load then, not for ``--help``).
"""

from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import dataclass

from encdec import DATA_DIR
from encdec.bench import ORDER
from encdec.bench.seq2seq_checkpoints import DEFAULT_CACHE, SHAPES
from encdec.bench.table import non_negative_float, positive_int
from encdec.bench.transfer_payloads import PAYLOADS, TRANSPORTS
from gateway_svc.config import GatewayConfig
from shared.config import (
    DEFAULT_DECODER_ADDRESS,
    DecoderServiceConfig,
    EncoderServiceConfig,
    add_config_arguments,
)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``encdec`` parser. ``command`` is the sub-command; ``bench`` sub-commands also set ``func``."""
    parser = argparse.ArgumentParser(
        prog="encdec", description="Encoder-decoder serving: Whisper over split encoder/decoder services."
    )
    parser.add_argument("--log-level", default=os.environ.get("ENCDEC_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve-encoder", help="run the encoder service")
    add_config_arguments(p, EncoderServiceConfig)

    p = sub.add_parser("serve-decoder", help="run the decoder service")
    add_config_arguments(p, DecoderServiceConfig)

    p = sub.add_parser("serve-http", help="run the OpenAI-compatible HTTP gateway in front of the services")
    add_config_arguments(p, GatewayConfig)

    p = sub.add_parser(
        "up",
        help="start redis (if needed), encoder, decoder and the HTTP gateway (and --embed-model); Ctrl-C stops all",
    )
    _add_services(p, 50061, 50051, 50071, 8000)

    p = sub.add_parser(
        "transcribe",
        help="transcribe audio or video files (wav, flac, mp3, m4a, ogg, webm, mp4...: any format FFmpeg reads; sent concurrently) and stream the text",
    )
    p.add_argument("files", nargs="+")
    p.add_argument("--address", default=os.environ.get("ENCDEC_DECODER_ADDRESS", DEFAULT_DECODER_ADDRESS))
    add_client_security(p)
    _add_sampling(p)
    _add_whisper(p)
    _add_realtime(p)

    p = sub.add_parser("demo", help="start everything, transcribe the bundled clip (or FILES), stop")
    p.add_argument("files", nargs="*")
    _add_services(p, 0, 0, 0)  # free ports: a demo never clashes with a running `encdec up`

    _add_bench(sub)
    return parser


def add_client_security(p: argparse.ArgumentParser) -> None:
    """A client's flags for a secured service (``shared.tls.ClientSecurity``): bearer token, TLS, mutual TLS."""
    p.add_argument(
        "--token",
        default=os.environ.get("ENCDEC_TOKEN") or None,
        help="bearer token of the service (its --auth-token-file); default $ENCDEC_TOKEN (a flag shows in ps)",
    )
    p.add_argument("--token-file", default=None, help="read the bearer token from this file instead")
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("ENCDEC_TLS_CA") or None,
        help="PEM CA bundle that signed the server's certificate: connect over TLS (default $ENCDEC_TLS_CA)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM client certificate, for a server with mutual TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument(
        "--tls-server-name",
        default=None,
        help="name the server's certificate carries when it differs from the --address host",
    )


def temperature_list(value: str) -> list[float]:
    """``--temperature``: one number or a comma-separated fallback list (``0,0.2,0.4``), each in [0, 1]."""
    try:
        temps = [float(t) for t in value.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or a comma-separated list of numbers: {value!r}") from None
    if not temps or any(not 0.0 <= t <= 1.0 for t in temps):  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"each temperature must be in [0, 1], got {value!r}")
    return temps


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--temperature",
        type=temperature_list,
        default=None,
        help="one temperature (decoded at it only; 0 = greedy) or a fallback list 0,0.2,...: a long-form window "
        "that fails the thresholds is decoded again at the next one. Default: greedy, falling back through "
        "0.2 .. 1.0 (openai-whisper's transcribe())",
    )
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None, help="1 (default) = off")
    p.add_argument("--no-repeat-ngram-size", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


TIMESTAMPS = ("none", "segment", "word")
FORMATS = ("text", "json", "srt", "vtt")


def _seconds_list(text: str) -> list[float]:
    """``"0,12.5,30"`` -> ``[0.0, 12.5, 30.0]`` (argparse type of ``--clip-timestamps``)."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds separated by commas, got {text!r}") from None


def _add_whisper(p: argparse.ArgumentParser) -> None:
    """``encdec transcribe``'s Whisper options (``WhisperOptions`` in proto/encdec/v1/decoder.proto) and output."""
    p.add_argument("--language", default=None, help="ISO 639-1 code (en, de, ...); default: detected (multilingual)")
    p.add_argument("--task", choices=("transcribe", "translate"), default=None, help="translate: to English")
    p.add_argument("--prompt", default=None, help="initial prompt: spellings, names, style of the transcript")
    p.add_argument(
        "--timestamps",
        choices=TIMESTAMPS,
        default=None,
        help="segment / word timestamps (long-form decoding); default: none for --format text, segment otherwise",
    )
    p.add_argument("--vad", action="store_true", help="drop silence (silero-vad) before transcribing")
    p.add_argument(
        "--no-condition-on-previous-text",
        dest="condition_on_previous_text",
        action="store_false",
        default=None,
        help="long-form: do not prompt each 30 s window with the previous window's text",
    )
    p.add_argument("--compression-ratio-threshold", type=float, default=None, help="default 2.4")
    p.add_argument("--logprob-threshold", type=float, default=None, help="default -1.0")
    p.add_argument("--no-speech-threshold", type=float, default=None, help="default 0.6")
    p.add_argument(
        "--decoding-rules",
        choices=("openai", "hf"),
        default=None,
        help="openai: openai-whisper's transcribe() (fallback on every file, best_of, VAD gate); hf: HF generate's; "
        "default: the decoder's --decoding-rules (openai)",
    )
    p.add_argument("--best-of", type=int, default=None, help="samples per fallback temperature, best kept; default 5")
    p.add_argument(
        "--no-vad-gate",
        dest="vad_gate",
        action="store_false",
        default=None,
        help="decode silence too (default: stretches of about 7 s or more the VAD hears no speech in are skipped)",
    )
    p.add_argument(
        "--vad-gate-min-silence-s",
        type=float,
        default=None,
        help="silence the gate skips, after 0.4 s of padding each side; default 6.0",
    )
    p.add_argument(
        "--hallucination-silence-threshold",
        type=float,
        default=None,
        help="seconds: skip silence before a likely hallucination (words timed for it; openai-whisper's option)",
    )
    p.add_argument(
        "--clip-timestamps",
        type=_seconds_list,
        default=None,
        help="decode only these stretches: start,end,start,end,... seconds (an odd count ends at the end)",
    )
    p.add_argument(
        "--language-detection-segments",
        type=int,
        default=None,
        help="detect the language on up to this many 30 s windows of speech; default 1",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text: streamed as decoded; json: one object per file (text, language, duration, segments, words, "
        "usage) on one line; srt / vtt: subtitles (segment timestamps)",
    )
    p.add_argument(
        "--output-dir",
        default=None,
        help="write each file's result to DIR/<file stem>.<txt|json|srt|vtt> instead of standard output",
    )


def _add_realtime(p: argparse.ArgumentParser) -> None:
    """``encdec transcribe --realtime``'s flags (``RealtimeConfig`` in proto/encdec/v1/decoder.proto); all None
    unless given, so the command can tell which were set."""
    p.add_argument(
        "--realtime",
        action="store_true",
        help="stream FILE (or -: raw PCM from standard input) through TranscribeStream as it plays: partial text "
        "in place on a terminal, each final as a line (finals only into a pipe)",
    )
    p.add_argument(
        "--realtime-speed",
        type=non_negative_float,
        default=None,
        help="--realtime FILE: send it at this many times real time (default 1; 0 = as fast as the server "
        "takes it); standard input is sent as it arrives",
    )
    p.add_argument(
        "--sample-rate",
        type=int,
        default=None,
        help="--realtime -: Hz of the raw PCM on standard input, 8000-48000 (default 16000)",
    )
    p.add_argument(
        "--encoding",
        choices=("pcm_s16le", "pcm_f32le"),
        default=None,
        help="--realtime -: sample format of standard input (default pcm_s16le, as arecord -f S16_LE writes)",
    )
    p.add_argument(
        "--step-ms",
        type=int,
        default=None,
        help="--realtime: re-decode the running utterance every this many ms of audio (at least the server's "
        "--realtime-step-ms, its default): longer costs less, partials and finals come later",
    )
    p.add_argument(
        "--no-partials",
        dest="partials",
        action="store_false",
        default=None,
        help="--realtime: ask for finals only",
    )
    p.add_argument(
        "--silence-duration-ms",
        type=int,
        default=None,
        help="--realtime: silence that ends an utterance (the server's VAD; default 500)",
    )
    p.add_argument(
        "--vad-threshold",
        type=float,
        default=None,
        help="--realtime: speech probability above which audio is speech (default 0.5)",
    )
    p.add_argument(
        "--no-turn-detection",
        dest="turn_detection",
        action="store_false",
        default=None,
        help="--realtime: no server VAD; utterances end only at the end of the input",
    )


def _add_services(
    p: argparse.ArgumentParser, encoder_port: int, decoder_port: int, embed_port: int, http_port: int | None = None
) -> None:
    """The flags of ``up`` and ``demo``; ``http_port`` None: no gateway flags (the demo starts none)."""
    p.add_argument("--model", default=None, help="model name or directory (default whisper-tiny.en)")
    p.add_argument(
        "--redis-url", default=None, help="external Redis (default: $REDIS_URL, else start a local redis-server)"
    )
    p.add_argument(
        "--embed-model", default=None, help="also serve this encoder-only model (EmbedService, /v1/embeddings)"
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="weights of both the encoder and the decoder: float32 (default), bfloat16 (a CPU with AVX-512 BF16 / "
        "AMX, or CUDA), float16 (CUDA); a --dtype in --encoder-args / --decoder-args wins for that service",
    )
    p.add_argument("--encoder-port", type=int, default=encoder_port, help="0 picks a free port")
    p.add_argument("--decoder-port", type=int, default=decoder_port, help="0 picks a free port")
    p.add_argument("--embed-port", type=int, default=embed_port, help="with --embed-model; 0 picks a free port")
    if http_port is not None:
        p.add_argument(
            "--http-port", type=int, default=http_port, help="the OpenAI-compatible HTTP gateway; 0 picks a free port"
        )
        p.add_argument(
            "--host",
            default=None,
            help="address the public ports bind: the decoder's gRPC, --embed-model's and the HTTP API (default "
            "$ENCDEC_HOST, else 127.0.0.1). Beyond loopback they need a generated token / API key (files printed "
            "at start); the encoder stays on 127.0.0.1",
        )
        p.add_argument("--no-http", action="store_true", help="do not start the HTTP gateway")
        p.add_argument("--http-args", default="", help="more serve-http flags, one string: --http-args='--api-key k'")
    p.add_argument(
        "--encoder-args",
        default="",
        help="more serve-encoder flags, one string: --encoder-args='--max-batch-wait-ms 100'",
    )
    p.add_argument(
        "--decoder-args",
        default="",
        help="more serve-decoder flags, one string: --decoder-args='--stream-interval 4 --max-num-seqs 32'",
    )


@dataclass(frozen=True)
class BenchEntry:
    """``func`` of ``encdec bench <module>``: calls ``encdec.bench.<module>.<name>(args)``, imported when it runs.

    A plain object, not a closure: the parsed arguments pickle (the transfer bench sends them to spawned processes).
    """

    module: str
    name: str = "main"

    def __call__(self, args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"encdec.bench.{self.module}"), self.name)(args)


def _bench_default(args: argparse.Namespace) -> int:
    """``encdec bench`` with no sub-command = ``encdec bench all`` with its defaults."""
    all_args = build_parser().parse_args(["--log-level", args.log_level, "bench", "all"])
    return all_args.func(all_args)


def _add_bench(sub) -> None:
    """``encdec bench <name>``: one sub-command per benchmark; each prints a Markdown table.
    No sub-command (or ``all``) runs them all (``encdec.bench.suite``)."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks against HF transformers / CTranslate2 / sentence-transformers; no sub-command runs them all",
    )
    bench.set_defaults(func=_bench_default)
    benches = bench.add_subparsers(dest="bench")

    p = benches.add_parser("all", help="every bench in one invocation: Markdown tables, --json, --plot PNG")
    _add_suite_arguments(p)
    p.set_defaults(func=BenchEntry("suite"))

    p = benches.add_parser(
        "peak",
        help="the machine's peak (sgemm, bf16, int8, memory bandwidth) and the decode-step products against it",
    )
    p.add_argument("--threads", type=int, default=2, help="torch / kernel threads (the other benches' --threads)")
    p.add_argument("--rows", default="1,16,32,64", help="decode-step row counts (running sequences), comma-separated")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--plot", default=None, help="write a roofline PNG here (matplotlib)")
    p.add_argument(
        "--also", nargs="*", default=[], help="earlier runs' --json files: more roofline panels (e.g. --cpu-isa avx2)"
    )
    p.set_defaults(func=BenchEntry("products"))

    p = benches.add_parser("seq2seq", help="decode-bound T5 / BART shapes: our services vs HF generate vs CTranslate2")
    _add_seq2seq_arguments(p)
    p.set_defaults(func=BenchEntry("seq2seq"))

    p = benches.add_parser("online", help="Poisson arrivals against our services: TTFT / TPOT p50, p99, throughput")
    _add_online_arguments(p)
    p.set_defaults(func=BenchEntry("online"))

    p = benches.add_parser("whisper", help="Whisper: our services vs HF vs CTranslate2 (--long-form: faster-whisper)")
    p.add_argument("--model", default="whisper-tiny.en", help="whisper-tiny.en (default) or whisper-base")
    p.add_argument("--clips", default=str(DATA_DIR), help="folder of .wav/.flac clips (default: the bundled ones)")
    p.add_argument("--requests", type=int, default=16, help="requests per system (clips cycled); 0: no short-form")
    p.add_argument(
        "--long-form",
        action="store_true",
        help="also 2-5 min recordings joined from the clips: ours vs HF long-form vs faster-whisper, WER",
    )
    p.add_argument("--long-form-clips", type=positive_int, default=4, help="recordings of --long-form")
    p.add_argument("--long-form-max-s", type=float, default=300.0, help="cap on each recording's seconds")
    p.add_argument("--concurrency", default="1,4,16", help="our services' client concurrency levels")
    p.add_argument(
        "--threads", type=int, default=2, help="torch / CTranslate2 threads per system (per service for ours)"
    )
    p.add_argument("--skip-ct2", action="store_true", help="skip CTranslate2 (needs the [bench] extra)")
    p.add_argument(
        "--int8", action="store_true", help="also run our services with --quantize int8 (opt-in int8 weights)"
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="also run our services with --dtype bfloat16 (CPUs with AVX-512 BF16 or AMX; transcripts vs HF fp32)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs of each batched system and each concurrency level; the median is reported",
    )
    p.add_argument(
        "--address", default=None, help="use running services at this decoder address instead of starting them"
    )
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=BenchEntry("whisper"))

    p = benches.add_parser(
        "quality",
        help="transcript quality on a synthetic espeak-ng corpus: WER, words in silence gaps, repetition loops; "
        "ours vs faster-whisper vs HF",
    )
    _add_quality_arguments(p)
    p.set_defaults(func=BenchEntry("quality"))

    p = benches.add_parser(
        "embed", help="Embed (all-MiniLM-L6-v2): our EmbedService vs sentence-transformers, batch 1 and 32"
    )
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="encoder-only model name or directory")
    p.add_argument("--requests-b1", type=int, default=200, help="one-sentence requests")
    p.add_argument("--requests-b32", type=int, default=30, help="32-sentence requests")
    p.add_argument("--threads", type=int, default=2, help="torch threads per system")
    p.add_argument("--address", default=None, help="use a running encoder service (EmbedService) at this address")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=BenchEntry("embed"))

    p = benches.add_parser(
        "http",
        help="the OpenAI-compatible HTTP gateway vs gRPC to the same services: embeddings, transcriptions",
    )
    p.add_argument("--requests-b1", type=positive_int, default=200, help="one-sentence embedding requests per path")
    p.add_argument("--requests-b32", type=positive_int, default=20, help="32-sentence embedding requests per path")
    p.add_argument(
        "--requests-audio", type=positive_int, default=32, help="transcription requests per path (clips cycled)"
    )
    p.add_argument(
        "--concurrency", type=positive_int, default=8, help="workers of the concurrent embeddings batch 1 row"
    )
    p.add_argument("--audio-concurrency", type=positive_int, default=16, help="workers of the transcriptions row")
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=8,
        help="pieces each row's requests are sent in, every piece over HTTP and gRPC in turn (which first alternates)",
    )
    p.add_argument(
        "--encoding-format",
        default="float",
        choices=["float", "base64"],
        help="/v1/embeddings encoding_format (float: the API's default; base64: the openai client's)",
    )
    p.add_argument("--embed-model", default="all-MiniLM-L6-v2", help="encoder-only model of the embed service")
    p.add_argument("--clips", default=str(DATA_DIR), help="folder of .wav/.flac clips (default: the bundled ones)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the encoder and the decoder service")
    p.add_argument("--json", default=None, help="also write the results here")
    p.set_defaults(func=BenchEntry("http"))

    p = benches.add_parser(
        "realtime",
        help="N TranscribeStream streams at once at 1x real time: final / partial latency, real time held, WER "
        "stream vs file, file requests beside; faster-whisper LocalAgreement-2 as the anchor",
    )
    _add_realtime_bench_arguments(p)
    p.set_defaults(func=BenchEntry("realtime"))

    p = benches.add_parser(
        "transfer", help="cross-KV transports (shm, torch_dist, cuda_ipc) in GB/s next to a plain memcpy"
    )
    add_transfer_arguments(p)
    p.set_defaults(func=BenchEntry("transfer", "run"))

    for p in benches.choices.values():  # common to every bench, as the machine line is
        p.add_argument(
            "--cpu-isa",
            choices=["avx2", "avx512"],
            default=None,
            help="cap every system (our kernels, torch ATen, MKL, oneDNN, CTranslate2) to this instruction set, "
            "to reproduce an AVX2 CPU's ratios on an AVX-512 machine (encdec.bench.cpu_isa; re-runs the bench "
            "with the variables set)",
        )


def _add_suite_arguments(p: argparse.ArgumentParser) -> None:
    """The ``encdec bench all`` flags."""
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(ORDER)}")
    p.add_argument("--skip", default="", help="comma-separated benches to leave out")
    p.add_argument(
        "--threads", type=int, default=2, help="threads per system (per service for ours), passed to every bench"
    )
    p.add_argument("--skip-ct2", action="store_true", help="no CTranslate2 rows")
    for name in ORDER:
        p.add_argument(
            f"--{name}-args", default="", help=f"extra flags for the {name} bench (see encdec bench {name} -h)"
        )
    p.add_argument("--json", default=None, help="write every bench's results here (one JSON object)")
    p.add_argument("--plot", default=None, help="write a PNG plot here (matplotlib)")


def _add_seq2seq_arguments(p: argparse.ArgumentParser) -> None:
    """The ``encdec bench seq2seq`` flags (also used by ``encdec bench all``)."""
    p.add_argument("--models", default="t5-small,bart-base", help=f"comma-separated shapes from {', '.join(SHAPES)}")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--source-len", type=int, default=24, help="source tokens per request (special tokens included)")
    p.add_argument(
        "--new-tokens", type=int, default=64, help="generated tokens per request (exactly, where the system allows)"
    )
    p.add_argument(
        "--threads", type=int, default=2, help="torch / CTranslate2 threads per system (per service for ours)"
    )
    p.add_argument(
        "--cache-dir", default=DEFAULT_CACHE, help="where the random checkpoints and their CT2 conversions are kept"
    )
    p.add_argument("--skip-ct2", action="store_true", help="skip CTranslate2 (needs the [bench] extra)")
    p.add_argument("--skip-hf-sequential", action="store_true", help="skip the (slow) one-at-a-time HF and CT2 runs")
    p.add_argument("--int8", action="store_true", help="also run CTranslate2 int8 and our --quantize int8")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="also run our services with --dtype bfloat16 (CPUs with AVX-512 BF16 or AMX; tokens vs HF fp32)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=3, help="timed runs of each batched system; the median is reported"
    )
    p.add_argument(
        "--stream-intervals",
        default="1,16",
        help="our decoder's --stream-interval values, comma-separated: one row each (int8: the first only)",
    )
    p.add_argument("--json", default=None, help="also write the results here")


def _add_quality_arguments(p: argparse.ArgumentParser) -> None:
    """The ``encdec bench quality`` flags (also used by ``encdec bench all``)."""
    p.add_argument("--model", default="whisper-tiny.en", help="whisper-tiny.en (default) or whisper-base")
    p.add_argument(
        "--subsets",
        default=None,
        help="comma-separated among clean, pauses, long, gaps, noise, noise-only, lang-de, lang-es, lang-fr; "
        "default: all the model speaks (an English-only model: no lang-*)",
    )
    p.add_argument(
        "--threads", type=int, default=2, help="torch / CTranslate2 threads per system (per service for ours)"
    )
    p.add_argument(
        "--systems", default=None, help="comma-separated among ours, fw-sequential, fw-batched, hf (default: all)"
    )
    p.add_argument(
        "--address", default=None, help="use running services at this decoder address instead of starting them"
    )
    p.add_argument(
        "--corpus-dir", default=None, help="where the corpus is built / reused (default: a keyed cache folder)"
    )
    p.add_argument(
        "--corpus-seed",
        type=int,
        default=None,
        help="build the corpus from another seed (default: the fixed one): new files of the same kinds, to check "
        "that a change holds beyond the files it was measured on",
    )
    p.add_argument("--skip-ct2", action="store_true", help="no faster-whisper systems (CTranslate2)")
    p.add_argument("--skip-hf", action="store_true", help="no HF transformers system")
    p.add_argument(
        "--ours-options",
        default=None,
        help="more WhisperOptions for ours as JSON, e.g. '{\"hallucination_silence_threshold\": 2}' or "
        '\'{"decoding_rules": "hf"}\' (default: none, the user\'s default path)',
    )
    p.add_argument("--json", default=None, help="also write the results here, every file's hypothesis included")


def _add_realtime_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The ``encdec bench realtime`` flags (also used by ``encdec bench all``)."""
    p.add_argument("--model", default="whisper-tiny.en", help="whisper-tiny.en (default) or whisper-base")
    p.add_argument("--streams", default="1,2,4,8", help="comma-separated numbers of concurrent streams, a run each")
    p.add_argument(
        "--duration-s", type=float, default=60.0, help="length of each stream's recording (seconds, at least 10)"
    )
    p.add_argument("--clips", default=str(DATA_DIR), help="folder of the bundled clips the recordings are joined from")
    p.add_argument(
        "--corpus",
        default="auto",
        help="auto: also the quality corpus's pauses files (built or reused; needs espeak-ng and sox); none; "
        "or the corpus folder",
    )
    p.add_argument("--stagger-s", type=non_negative_float, default=0.3, help="seconds between the streams' starts")
    p.add_argument(
        "--file-every-s",
        type=non_negative_float,
        default=5.0,
        help="one file Generate (the bundled sample.wav) every this many seconds during each run; 0: none",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the clip recordings' order and pauses")
    p.add_argument(
        "--threads", type=int, default=2, help="torch threads per service; CTranslate2 threads of the anchor"
    )
    p.add_argument("--skip-fw", action="store_true", help="no faster-whisper anchor (marked optional in the notes)")
    p.add_argument("--skip-ct2", action="store_true", help="the same as --skip-fw (what encdec bench all passes)")
    p.add_argument(
        "--address", default=None, help="use running services at this decoder address instead of starting them"
    )
    p.add_argument(
        "--decoder-args",
        default="",
        help="more serve-decoder flags for the services started here: --decoder-args='--realtime-step-ms 500'",
    )
    p.add_argument("--json", default=None, help="also write the results here, every stream's scores and text")
    p.add_argument("--plot", default=None, help="write a PNG of the latencies against N here (matplotlib)")


def _add_online_arguments(p: argparse.ArgumentParser) -> None:
    """The ``encdec bench online`` flags (also used by ``encdec bench all``)."""
    p.add_argument(
        "--workload",
        default="whisper",
        help="whisper (bundled clips, or --clips) or a text model shape: t5-small, bart-base, t5-tiny, bart-tiny",
    )
    p.add_argument("--rate", type=float, default=1.0, help="mean arrival rate, requests/s (Poisson)")
    p.add_argument(
        "--rates",
        default=None,
        help="rate sweep instead of --rate: comma-separated requests/s (e.g. 0.5,1,2,4), one run each against the "
        "same services; adds refusals and goodput per rate",
    )
    p.add_argument(
        "--ttft-slo-ms",
        type=float,
        default=2000.0,
        help="rate sweep: the TTFT target (ms) a request must meet to count in goodput",
    )
    p.add_argument("--duration", type=float, default=30.0, help="seconds during which requests arrive")
    # The lone requests' defaults: 10 (the 5 bundled clips, two each), each after 1 s idle. A request sent right
    # after another one finds the services warmer (TTFT ~10% lower on 2 cores) than one arriving after the idle gap
    # of a 1 req/s run.
    p.add_argument(
        "--lone-requests",
        type=positive_int,
        default=10,
        help="requests sent one at a time on the idle services before each timed run (the lone TTFT ms column)",
    )
    p.add_argument(
        "--lone-gap-s",
        type=non_negative_float,
        default=1.0,
        help="seconds the services stay idle before each lone request",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--clips", default=str(DATA_DIR), help="whisper: folder of .wav/.flac clips")
    p.add_argument("--source-len", type=int, default=24, help="text workloads: source tokens per request")
    p.add_argument("--new-tokens", type=int, default=64, help="text workloads: generated tokens per request")
    p.add_argument("--threads", type=int, default=2, help="torch threads per service")
    p.add_argument("--max-num-seqs", type=int, default=32, help="decoder --max-num-seqs")
    p.add_argument("--cache-dir", default=None, help="text workloads: checkpoint cache (default: the seq2seq bench's)")
    p.add_argument(
        "--address", default=None, help="use running services at this decoder address instead of starting them"
    )
    p.add_argument("--json", default=None, help="also write the results here")


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``encdec bench transfer`` flags (also ``python -m encdec.bench.transfer``'s)."""
    parser.add_argument(
        "--payloads",
        default="whisper-tiny,whisper-small,whisper-large-v3",
        help=f"comma-separated: {', '.join(PAYLOADS)} or LxHxDxS (layers x heads x head_dim x encoder_len)",
    )
    parser.add_argument(
        "--transports",
        default="auto",
        help=f"comma-separated rows among {', '.join(TRANSPORTS)}; auto = every one available here",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="pool and payload dtype"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--iters", type=int, default=10, help="timed transfers per payload (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed transfers first (mapping, connection set-up)")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads in both processes; 0 keeps torch's default"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
