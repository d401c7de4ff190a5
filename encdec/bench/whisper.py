"""``encdec bench whisper``: our two services vs HF transformers vs CTranslate2.

Every system transcribes the same requests (the clips cycled up to
``--requests``) greedily from audio bytes, log-mel features included, with the
same thread count. Columns: wall seconds, generated tokens per second,
``x realtime`` (audio seconds transcribed per wall second: higher is better),
and how many transcripts have exactly HF's tokens (HF sequential is the truth).
CTranslate2 runs in its own process (see ``ct2_worker``).

Batched runs (HF batched, CTranslate2 batched, each of our concurrency levels)
are timed ``--repeats`` times and the median is reported, as in ``encdec bench
seq2seq``, since one run of 16 clips varies widely against the same services
within minutes (measured: docs/benchmarks.md, Measurements formerly in
docstrings); sequential runs once.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch

from decoder_svc.audio import decode_audio
from encdec.bench.table import markdown_table, median_run, write_json
from shared.models.registry import resolve_model
from shared.models.whisper_features import log_mel_spectrogram
from shared.proto import decoder_pb2, decoder_pb2_grpc

SAMPLE_RATE = 16000
SPECIAL = {50256, 50257, 50362}
COLUMNS = ["system", "mode", "requests", "wall s", "tokens/s", "x realtime", "same as HF"]


def _strip(ids: list[int]) -> list[int]:
    return [t for t in ids if t not in SPECIAL]


def _row(
    system: str, mode: str, audio_s: float, wall: float, tokens: list[list[int]], truth: list[list[int]] | None
) -> dict:
    n_tok = sum(len(_strip(t)) + 1 for t in tokens)  # + the end token each
    same = None if truth is None else f"{sum(_strip(a) == _strip(b) for a, b in zip(tokens, truth))}/{len(tokens)}"
    return {
        "system": system,
        "mode": mode,
        "requests": len(tokens),
        "wall s": wall,
        "tokens/s": n_tok / wall,
        "x realtime": audio_s / wall,
        "same as HF": same,
    }


def run_hf(audio: list, threads: int, repeats: int = 1) -> tuple[dict[str, float], dict[str, list[list[int]]]]:
    """HF ``generate`` one request at a time and as one batch (the median of ``repeats`` batched runs)."""
    from encdec.bench.hf_whisper import build_hf_whisper

    torch.set_num_threads(threads)
    model = build_hf_whisper(resolve_model("whisper-tiny.en")[1])
    walls, tokens = {}, {}
    with torch.inference_mode():
        model.generate(log_mel_spectrogram(audio[0])[None])  # warm-up
        start = time.perf_counter()
        tokens["sequential"] = [model.generate(log_mel_spectrogram(a)[None]).tolist()[0] for a in audio]
        walls["sequential"] = time.perf_counter() - start
        runs = []
        for _ in range(max(repeats, 1)):
            start = time.perf_counter()
            feats = torch.stack([log_mel_spectrogram(a) for a in audio])
            batch_tokens = model.generate(feats).tolist()
            runs.append((time.perf_counter() - start, batch_tokens))
        walls["batched"], tokens["batched"] = median_run(runs)
    return walls, tokens


def run_ct2(
    files: list[str], compute_type: str, mode: str, threads: int, repeats: int = 1
) -> tuple[float, list[list[int]]]:
    """CTranslate2 in a subprocess: ``(wall_s, tokens)``, the median of ``repeats`` runs."""
    model_dir = str(resolve_model("whisper-tiny.en")[1])
    cmd = [
        sys.executable,
        "-m",
        "encdec.bench.ct2_worker",
        model_dir,
        compute_type,
        mode,
        str(threads),
        str(repeats),
        *files,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    result = json.loads(out)
    return result["wall_s"], result["tokens"]


async def _ours_once(address: str, files: list[str], concurrency: int) -> tuple[float, list[list[int]]]:
    payloads = [Path(f).read_bytes() for f in files]
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)

        async def one(data: bytes) -> list[int]:
            async with sem:
                ids: list[int] = []
                async for m in stub.Generate(decoder_pb2.GenerateRequest(audio=data)):
                    ids.extend(m.token_ids)
                return ids

        await one(payloads[0])  # warm-up
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in payloads))
        return time.perf_counter() - start, list(tokens)


def run_ours(
    files: list[str],
    concurrencies: list[int],
    threads: int,
    address: str | None,
    quantize: str = "none",
    repeats: int = 1,
) -> dict[int, tuple[float, list[list[int]]]]:
    """Our services end to end over gRPC (started here unless ``address`` is given): per concurrency level, the
    median of ``repeats`` runs against the same services."""
    from encdec.launcher import Services

    def median_of_runs(address: str, concurrency: int) -> tuple[float, list[list[int]]]:
        return median_run([asyncio.run(_ours_once(address, files, concurrency)) for _ in range(max(repeats, 1))])

    results = {}
    if address:
        for c in concurrencies:
            results[c] = median_of_runs(address, c)
        return results
    flags = ["--num-threads", str(threads), "--quantize", quantize]
    # Clips repeat across requests: turn the encoder-output cache off so every request is encoded, as
    # HF and CTranslate2 encode every one.
    with Services(
        log_level="WARNING", extra_encoder_args=flags, extra_decoder_args=[*flags, "--encoder-cache", "0"]
    ) as svc:
        for c in concurrencies:
            results[c] = median_of_runs(svc.decoder_address, c)
    return results


def main(args) -> int:
    clip_dir = Path(args.clips)
    clips = sorted(str(p) for p in clip_dir.glob("*.wav")) + sorted(str(p) for p in clip_dir.glob("*.flac"))
    if not clips:
        print(f"no .wav/.flac clips in {clip_dir}", file=sys.stderr)
        return 2
    files = [clips[i % len(clips)] for i in range(args.requests)]
    audio = [decode_audio(Path(f).read_bytes()) for f in files]
    audio_s = sum(len(a) for a in audio) / SAMPLE_RATE
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    print(f"{len(files)} requests, {audio_s:.1f} s of audio, {args.threads} threads per system", file=sys.stderr)

    rows = []
    walls, hf_tokens = run_hf(audio, args.threads, args.repeats)
    truth = hf_tokens["sequential"]
    for mode in ("sequential", "batched"):
        rows.append(_row("HF transformers fp32", mode, audio_s, walls[mode], hf_tokens[mode], truth))
    if not args.skip_ct2:
        for compute_type in ("float32", "int8"):
            for mode in ("sequential", "batched"):
                wall, tokens = run_ct2(
                    files, compute_type, mode, args.threads, args.repeats if mode == "batched" else 1
                )
                rows.append(_row(f"CTranslate2 {compute_type}", mode, audio_s, wall, tokens, truth))
    for quantize in ("none", "int8") if args.int8 else ("none",):
        name = "encdec-serve " + ("fp32" if quantize == "none" else "int8") + " (2 services, gRPC)"
        for c, (wall, tokens) in run_ours(
            files, concurrencies, args.threads, args.address, quantize, args.repeats
        ).items():
            rows.append(_row(name, f"concurrency {c}", audio_s, wall, tokens, truth))
        if args.address:
            break  # running services have their own settings
    print(markdown_table(rows, COLUMNS))
    if args.json:
        write_json(
            args.json,
            {
                "bench": "whisper",
                "requests": len(files),
                "audio_s": audio_s,
                "threads": args.threads,
                "repeats": args.repeats,
                "cpu_count": os.cpu_count(),
                "rows": rows,
            },
        )
    return 0
