"""``encdec bench whisper``: our two services vs HF transformers vs CTranslate2.

Every system transcribes the same requests (the clips cycled up to
``--requests``) greedily from audio bytes, log-mel features included, with the
same thread count, in English (``--model`` multilingual: HF ``language="en",
task="transcribe"``, our requests ``WhisperOptions(language="en")``, CTranslate2
prompted with ``<|en|><|transcribe|>``: no language detection anywhere). Columns:
wall seconds, generated tokens per second, ``x realtime`` (audio seconds
transcribed per wall second: higher is better), and how many transcripts have
exactly HF's text tokens (HF sequential is the truth). CTranslate2 runs in its
own process (``faster_whisper_anchor``'s ``ct2`` system). ``--long-form`` adds
the 2-5 minute recordings table of ``whisper_longform``; ``--requests 0`` leaves
the short-form table out.

Batched runs (HF batched, CTranslate2 batched, each of our concurrency levels)
are timed ``--repeats`` times and the median is reported, as in ``encdec bench
seq2seq``, since one run of 16 clips varies widely against the same services
within minutes (measured: docs/benchmarks.md, Measurements formerly in
docstrings); sequential runs once.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import grpc
import torch

from decoder_svc.session.audio import decode_audio
from encdec.bench import roofline
from encdec.bench.flops import Dims, whisper_dims, whisper_prompt_len, whisper_request_flops
from encdec.bench.peak import machine_peak, peak_line
from encdec.bench.table import markdown_table, median_run, write_json
from shared.models.registry import resolve_model
from shared.models.whisper_features import log_mel_spectrogram, special_token_ids
from shared.proto import decoder_pb2, decoder_pb2_grpc

SAMPLE_RATE = 16000
COLUMNS = ["system", "mode", "requests", "wall s", "tokens/s", "x realtime", "same as HF", *roofline.COLUMNS]
# Our services' flags per variant of the weights (both services get them).
VARIANT_FLAGS = {"fp32": [], "int8": ["--quantize", "int8"], "bf16": ["--dtype", "bfloat16"]}


def _row(
    system: str,
    mode: str,
    audio_s: float,
    wall: float,
    tokens: list[list[int]],
    truth: list[list[int]] | None,
    eot: int,
    dims: Dims,
    cpu: dict[str, float] | None = None,
) -> dict:
    """One table row; ids from ``eot`` (``<|endoftext|>``) up are specials and timestamps, not text. Its FLOPs
    (``encdec.bench.flops``: one window per request) from each request's text tokens + the end token, and ``cpu
    s`` (our encoder's and decoder's CPU seconds) where known, for ``roofline.add_achieved``."""

    def text(ids: list[int]) -> list[int]:
        return [t for t in ids if t < eot]

    n_tok = sum(len(text(t)) + 1 for t in tokens)  # + the end token each
    same = None if truth is None else f"{sum(text(a) == text(b) for a, b in zip(tokens, truth))}/{len(tokens)}"
    return {
        "system": system,
        "mode": mode,
        "requests": len(tokens),
        "wall s": wall,
        "tokens/s": n_tok / wall,
        "x realtime": audio_s / wall,
        "same as HF": same,
        **roofline.totals([whisper_request_flops(dims, len(text(t)) + 1, whisper_prompt_len(dims)) for t in tokens]),
        "cpu s": cpu,
    }


def run_hf(
    audio: list, threads: int, repeats: int = 1, model_name: str = "whisper-tiny.en"
) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """HF ``generate`` one request at a time and as one batch (the median of ``repeats`` batched runs); a
    multilingual checkpoint with ``language="en", task="transcribe"``, no timestamps."""
    from encdec.bench.hf_whisper import build_hf_whisper

    torch.set_num_threads(threads)
    model = build_hf_whisper(resolve_model(model_name)[1])
    # English-only checkpoints refuse a language argument; their prompt has no language.
    kw = {"language": "en", "task": "transcribe"} if model.generation_config.is_multilingual else {}
    walls, tokens = {}, {}
    with torch.inference_mode():
        model.generate(log_mel_spectrogram(audio[0])[None], **kw)  # warm-up
        start = time.perf_counter()
        tokens["sequential"] = [model.generate(log_mel_spectrogram(a)[None], **kw).tolist()[0] for a in audio]
        walls["sequential"] = time.perf_counter() - start
        runs = []
        for _ in range(max(repeats, 1)):
            start = time.perf_counter()
            feats = torch.stack([log_mel_spectrogram(a) for a in audio])
            batch_tokens = model.generate(feats, **kw).tolist()
            runs.append((time.perf_counter() - start, batch_tokens))
        walls["batched"], tokens["batched"] = median_run(runs)
    return walls, tokens


def run_ct2(
    files: list[str], compute_type: str, mode: str, threads: int, repeats: int = 1, model_name: str = "whisper-tiny.en"
) -> tuple[float, list[list[int]]]:
    """CTranslate2 in a subprocess (``faster_whisper_anchor``'s ``ct2``, prompted in English): ``(wall_s, tokens)``,
    the median of ``repeats`` runs."""
    from encdec.bench.faster_whisper_anchor import run_anchor

    result = run_anchor("ct2", str(resolve_model(model_name)[1]), compute_type, threads, mode, repeats, files)
    return result["wall_s"], result["tokens"]


async def _ours_once(
    address: str, files: list[str], concurrency: int, pids: dict[str, int]
) -> tuple[float, list[list[int]], dict[str, float] | None]:
    """One timed run after a warm-up request: ``(wall_s, tokens, cpu_s)``, ``cpu_s`` each process of ``pids``'s
    CPU seconds over the timed part (None without ``pids``)."""
    payloads = [Path(f).read_bytes() for f in files]
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)

        async def one(data: bytes) -> list[int]:
            async with sem:
                ids: list[int] = []
                # language given: a multilingual model detects none (English-only ones take "en" too)
                request = decoder_pb2.GenerateRequest(audio=data, whisper=decoder_pb2.WhisperOptions(language="en"))
                async for m in stub.Generate(request):
                    ids.extend(m.token_ids)
                return ids

        await one(payloads[0])  # warm-up
        cpu = roofline.cpu_seconds(pids)
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in payloads))
        wall = time.perf_counter() - start
        after = roofline.cpu_seconds(pids)
        return wall, list(tokens), {n: after[n] - cpu[n] for n in pids} if pids else None


def run_ours(
    files: list[str],
    concurrencies: list[int],
    threads: int,
    address: str | None,
    variant: str = "fp32",
    repeats: int = 1,
    model: str = "whisper-tiny.en",
) -> dict[int, tuple[float, list[list[int]], dict[str, float] | None]]:
    """Our services end to end over gRPC (started here unless ``address`` is given): per concurrency level, the
    median of ``repeats`` runs against the same services, ``(wall_s, tokens, cpu_s)`` (``cpu_s``: the encoder's
    and the decoder's CPU seconds over the run; None with ``address``). ``variant``: a key of ``VARIANT_FLAGS`` (both
    services' weights: ``fp32``, ``int8`` = ``--quantize int8``, ``bf16`` = ``--dtype bfloat16``)."""
    from encdec.launcher import Services

    def median_of_runs(address: str, concurrency: int, pids: dict[str, int]):
        runs = [asyncio.run(_ours_once(address, files, concurrency, pids)) for _ in range(max(repeats, 1))]
        return median_run(runs)

    results = {}
    if address:
        for c in concurrencies:
            results[c] = median_of_runs(address, c, {})
        return results
    flags = ["--num-threads", str(threads), *VARIANT_FLAGS[variant]]
    # Clips repeat across requests: turn the encoder-output cache off so every request is encoded, as
    # HF and CTranslate2 encode every one.
    with Services(
        model=model, log_level="WARNING", extra_encoder_args=flags, extra_decoder_args=[*flags, "--encoder-cache", "0"]
    ) as svc:
        pids = {n: svc.process(n).pid for n in ("encoder", "decoder")}
        for c in concurrencies:
            results[c] = median_of_runs(svc.decoder_address, c, pids)
    return results


async def transcribe_over_grpc(stub, path: str, options) -> dict:
    """One file through ``stub`` (a ``DecoderServiceStub`` on an aio channel) with ``options``
    (``WhisperOptions``): ``{"text", "language", "segments": [{"start", "end", "text"[, "words": [{"word",
    "start", "end"}]]}]}``, times in seconds of the file.

    Raises:
        grpc.aio.AioRpcError: the call failed.
    """
    text, segments, language = [], [], ""
    request = decoder_pb2.GenerateRequest(audio=Path(path).read_bytes(), whisper=options)
    async for m in stub.Generate(request):
        text.append(m.text)
        language = m.language or language
        for seg in m.segments:
            segments.append({"start": seg.start, "end": seg.end, "text": seg.text})
            if seg.words:
                segments[-1]["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in seg.words]
    return {"text": "".join(text), "language": language, "segments": segments}


async def _ours_long_form_once(address: str, files: list[str], warmup: str) -> tuple[float, list[str], int]:
    options = decoder_pb2.WhisperOptions(language="en", timestamps=decoder_pb2.TIMESTAMP_GRANULARITY_SEGMENT)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        await transcribe_over_grpc(stub, warmup, options)
        start = time.perf_counter()
        results = await asyncio.gather(*(transcribe_over_grpc(stub, f, options) for f in files))
        wall = time.perf_counter() - start
    return wall, [r["text"] for r in results], sum(len(r["segments"]) for r in results)


def run_ours_long_form(model: str, files: list[str], warmup: str, threads: int, address: str | None) -> dict:
    """Every file at once through our services (started here unless ``address``), long-form with segment
    timestamps in English, after one untimed ``warmup`` file.

    Returns:
        ``{"wall_s", "texts", "segments"}`` and, with services started here, ``"cpu_s"``: the encoder's and
        the decoder's CPU seconds over the timed run.
    """
    (wall, texts, segments), cpu = on_services(
        model, threads, address, lambda at: asyncio.run(_ours_long_form_once(at, files, warmup))
    )
    out = {"wall_s": wall, "texts": texts, "segments": segments}
    return out if cpu is None else {**out, "cpu_s": cpu}


def on_services(model: str, threads: int, address: str | None, job):
    """Runs ``job(decoder_address)`` against the services at ``address``, or against a stack started here
    (``--num-threads threads`` each, the encoder-output cache off); returns ``(job's result, cpu_s)``, ``cpu_s``
    the encoder's and the decoder's CPU seconds over the job (None with ``address``)."""
    from encdec.launcher import Services

    if address:
        return job(address), None
    flags = ["--num-threads", str(threads)]
    with Services(
        model=model, log_level="WARNING", extra_encoder_args=flags, extra_decoder_args=[*flags, "--encoder-cache", "0"]
    ) as svc:
        pids = {n: svc.process(n).pid for n in ("encoder", "decoder")}
        before = roofline.cpu_seconds(pids)
        result = job(svc.decoder_address)
        after = roofline.cpu_seconds(pids)
        return result, {n: after[n] - before[n] for n in pids}


def short_form_rows(args, clips: list[str], eot: int) -> tuple[list[dict], float]:
    """The short-form table's rows: ``--requests`` clips (cycled) through every system; and their audio seconds."""
    files = [clips[i % len(clips)] for i in range(args.requests)]
    audio = [decode_audio(Path(f).read_bytes()) for f in files]
    audio_s = sum(len(a) for a in audio) / SAMPLE_RATE
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print(f"{len(files)} requests, {audio_s:.1f} s of audio, {args.threads} threads per system", file=sys.stderr)

    rows = []
    dims = model_dims(args.model)
    walls, hf_tokens = run_hf(audio, args.threads, args.repeats, args.model)
    truth = hf_tokens["sequential"]
    for mode in ("sequential", "batched"):
        rows.append(_row("HF transformers fp32", mode, audio_s, walls[mode], hf_tokens[mode], truth, eot, dims))
    if not args.skip_ct2:
        for compute_type in ("float32", "int8"):
            for mode in ("sequential", "batched"):
                repeats = args.repeats if mode == "batched" else 1
                wall, tokens = run_ct2(files, compute_type, mode, args.threads, repeats, args.model)
                rows.append(_row(f"CTranslate2 {compute_type}", mode, audio_s, wall, tokens, truth, eot, dims))
    variants = ["fp32"] + ["int8"] * bool(args.int8) + ["bf16"] * bool(getattr(args, "bf16", False))
    for variant in variants:
        name = f"encdec-serve {variant} (2 services, gRPC)"
        for c, (wall, tokens, cpu) in run_ours(
            files, concurrencies, args.threads, args.address, variant, args.repeats, args.model
        ).items():
            rows.append(_row(name, f"concurrency {c}", audio_s, wall, tokens, truth, eot, dims, cpu))
        if args.address:
            break  # running services have their own settings
    peak = machine_peak(args.threads, remeasure=True)  # at the start (main) and the end: the best of both
    roofline.add_achieved(rows, peak, args.threads)
    return rows, audio_s


def model_dims(model: str) -> Dims:
    """The FLOP-counting shapes of a Whisper model name (its CTranslate2 weights' shapes)."""
    from shared.models.ct2_reader import load_ct2_weights
    from shared.models.whisper import WhisperConfig

    return whisper_dims(WhisperConfig.from_ct2_weights(load_ct2_weights(resolve_model(model)[1] / "model.bin")))


def main(args) -> int:
    from encdec.bench.machine import machine_info, machine_line

    clip_dir = Path(args.clips)
    clips = sorted(str(p) for p in clip_dir.glob("*.wav")) + sorted(str(p) for p in clip_dir.glob("*.flac"))
    if not clips:
        print(f"no .wav/.flac clips in {clip_dir}", file=sys.stderr)
        return 2
    info = machine_info()
    line = machine_line(info)
    machine_peak(args.threads)  # at bench start, before any system runs
    print(f"Machine: {line}; model {args.model}; {args.threads} threads per system\n")
    eot = special_token_ids(resolve_model(args.model)[1])["<|endoftext|>"]
    rows, audio_s = short_form_rows(args, clips, eot) if args.requests > 0 else ([], 0.0)
    peak = machine_peak(args.threads)
    if rows:
        print(markdown_table(rows, COLUMNS), flush=True)
        print(f"\n{peak_line(peak)}\n{roofline.NOTE}", flush=True)
    long_form = None
    if args.long_form:
        from encdec.bench.whisper_longform import render
        from encdec.bench.whisper_longform import run as run_long_form

        long_form = run_long_form(args, clips, run_ours_long_form)
        print(("\n" if rows else "") + render(long_form))
    if args.json:
        write_json(
            args.json,
            {
                "bench": "whisper",
                "machine": info,
                "model": args.model,
                "requests": args.requests,
                "audio_s": audio_s,
                "threads": args.threads,
                "repeats": args.repeats,
                "cpu_count": os.cpu_count(),
                "columns": COLUMNS,
                "rows": rows,
                "long_form": long_form,
                "peak": peak.to_dict(),
                "notes": [peak_line(peak), roofline.NOTE],
            },
        )
    return 0
