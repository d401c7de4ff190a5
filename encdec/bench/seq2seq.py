"""``encdec bench seq2seq``: decode-bound text generation, ours vs HF ``generate`` vs CTranslate2.

Per model shape (``t5-small`` and ``bart-base`` by default; random weights,
``seq2seq_checkpoints``): ``--requests`` sources of ``--source-len`` token ids,
each decoded greedily to exactly ``--new-tokens`` tokens:

- ours: redis + encoder + decoder started by ``encdec.launcher.Services`` on
  the checkpoint directory, every request sent at once over gRPC (one
  ``Generate`` stream each, ``input_ids``); ``min_tokens`` / ``ignore_eos``
  are set when the proto has them, else only ``max_tokens`` (a sampled end
  token then ends a request early: the ``tokens`` column shows it). One row
  per ``--stream-intervals`` value (the decoder's ``--stream-interval``: 1
  sends a message per token, vLLM's and SGLang's default; 16 merges a
  request's tokens into messages of 16, the first token and the finish still
  at once: 32 x 64 tokens are 2048 messages or ~160). The bench client runs
  on the same cores as the services, so each message costs twice here.
  ``--int8`` adds a ``--quantize int8`` row (a note compares it with
  CTranslate2 int8 batched), ``--bf16`` a ``--dtype bfloat16``
  one (CPUs with AVX-512 BF16 / AMX), both counted against HF fp32's tokens;
- HF transformers ``generate`` (in this process, after our services stopped):
  one request at a time, and all of them as one static batch
  (``min_new_tokens = max_new_tokens``);
- CTranslate2 ``Translator`` converted from the same directory by its own
  converter, sequential and batched (``min_decoding_length =
  max_decoding_length``), fp32 (and int8 with ``--int8``), in a subprocess
  (``ct2_translator_worker``).

Batched runs (ours, HF batched, CTranslate2 batched) are timed ``--repeats``
times and the median is reported (a shared machine varies from run to run:
docs/benchmarks.md, Measurements formerly in docstrings); sequential runs once.

Columns: generated tokens, wall seconds, tokens/s, ``x best batched`` (tokens/s
over the better of HF batched and CTranslate2 fp32 batched, the issue-7 target)
and ``same as HF`` (outputs token-for-token equal to HF sequential greedy). The
JSON rows also carry ``load``, the 1-minute load average right after that system ran
(on a shared machine, how noisy that measurement was).

Over 300 lines: one benchmark per file (the runs of our services, HF ``generate`` and
CTranslate2 on the same checkpoints, and the rows comparing them).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from encdec.bench import roofline
from encdec.bench.flops import seq2seq_dims, seq2seq_request_flops
from encdec.bench.machine import machine_line
from encdec.bench.peak import machine_peak, peak_line
from encdec.bench.seq2seq_checkpoints import SHAPES, build_checkpoint, source_ids
from encdec.bench.table import markdown_table, median_run, write_json

COLUMNS = [
    "model", "system", "mode", "requests", "tokens", "wall s", "tokens/s", "x best batched", "same as HF",
    *roofline.COLUMNS,
]  # fmt: skip


def _gen_kwargs(n: int) -> dict:
    return dict(
        min_new_tokens=n,
        max_new_tokens=n,
        do_sample=False,
        num_beams=1,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
    )


def run_hf(
    model_dir: Path,
    sources: list[list[int]],
    new_tokens: int,
    threads: int,
    sequential: bool = True,
    progress: bool = True,
    repeats: int = 1,
) -> dict[str, tuple[float, list[list[int]]]]:
    """HF ``generate`` (fp32, greedy): ``{"sequential" | "batched": (wall_s, tokens)}``; tokens exclude the start token;
    batched: the median of ``repeats`` runs."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForSeq2SeqLM

    torch.set_num_threads(threads)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kw = _gen_kwargs(new_tokens)
    out: dict[str, tuple[float, list[list[int]]]] = {}
    with torch.inference_mode():
        model.generate(torch.tensor(sources[:1]), **kw)  # warm-up
        if sequential:
            start = time.perf_counter()
            tokens = [
                model.generate(torch.tensor([s]), **kw)[0, 1:].tolist()
                for s in tqdm(sources, desc="HF sequential", disable=not progress, leave=False)
            ]
            out["sequential"] = (time.perf_counter() - start, tokens)
        ids = torch.tensor(sources)  # every source has the same length: no padding
        runs = []
        for _ in range(max(repeats, 1)):
            start = time.perf_counter()
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[:, 1:].tolist()
            runs.append((time.perf_counter() - start, tokens))
        out["batched"] = median_run(runs)
    return out


def run_ct2(
    model_dir: Path,
    ct2_dir: Path,
    sources: list[list[int]],
    new_tokens: int,
    threads: int,
    compute_type: str,
    modes: list[str],
    repeats: int = 1,
) -> dict[str, tuple[float, list[list[int]]]]:
    """CTranslate2 in a subprocess (converts on first use): ``{mode: (wall_s, tokens)}``; batched: the median of
    ``repeats`` runs."""
    job = {
        "model_dir": str(model_dir),
        "ct2_dir": str(ct2_dir),
        "compute_type": compute_type,
        "threads": threads,
        "sources": sources,
        "new_tokens": new_tokens,
        "modes": modes,
        "repeats": repeats,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "encdec.bench.ct2_translator_worker"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"CTranslate2 worker failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {m: (res[m]["wall_s"], res[m]["tokens"]) for m in modes}


def sampling_for(new_tokens: int, fixed_length: bool = True):
    """``SamplingParams`` for exactly ``new_tokens`` tokens: greedy, ``max_tokens``, and
    ``min_tokens`` + ``ignore_eos`` when the proto has them and ``fixed_length``."""
    from shared.proto import decoder_pb2

    fields = decoder_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    kw: dict = {"temperature": 0.0, "max_tokens": new_tokens}
    if fixed_length and "min_tokens" in fields:
        kw["min_tokens"] = new_tokens
    if fixed_length and "ignore_eos" in fields:
        kw["ignore_eos"] = True
    return decoder_pb2.SamplingParams(**kw)


async def generate_ids(stub, ids: list[int], sampling) -> tuple[list[int], float, float]:
    """One ``Generate`` stream from token ids: ``(tokens, ttft_s, total_s)`` (times from the call)."""
    from shared.proto import decoder_pb2

    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    async for m in stub.Generate(
        decoder_pb2.GenerateRequest(input_ids=decoder_pb2.TokenIds(ids=ids), sampling=sampling)
    ):
        if m.token_ids and first is None:
            first = time.perf_counter() - start
        tokens.extend(m.token_ids)
    return tokens, first if first is not None else 0.0, time.perf_counter() - start


async def _ours_once(
    address: str, sources: list[list[int]], new_tokens: int, pids: dict[str, int]
) -> tuple[float, list[list[int]], dict[str, float]]:
    """One timed run after a warm-up request: ``(wall_s, tokens, cpu_s)``, ``cpu_s`` each process of ``pids``'s
    CPU seconds over the timed part."""
    import grpc

    from shared.grpc_server import GRPC_OPTIONS
    from shared.proto import decoder_pb2_grpc

    sampling = sampling_for(new_tokens)
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        await generate_ids(stub, sources[0], sampling)  # warm-up
        cpu = roofline.cpu_seconds(pids)
        start = time.perf_counter()
        results = await asyncio.gather(*(generate_ids(stub, s, sampling) for s in sources))
        wall = time.perf_counter() - start
        after = roofline.cpu_seconds(pids)
        return wall, [r[0] for r in results], {n: after[n] - cpu[n] for n in pids}


def service_args(
    threads: int, max_num_seqs: int, quantize: str = "none", dtype: str = "float32"
) -> tuple[list[str], list[str]]:
    """(encoder, decoder) extra CLI flags for a text-model bench run."""
    common = ["--num-threads", str(threads), "--quantize", quantize, "--dtype", dtype]
    return common, [*common, "--max-num-seqs", str(max_num_seqs)]


def run_ours(
    model_dir: Path,
    sources: list[list[int]],
    new_tokens: int,
    threads: int,
    quantize: str = "none",
    stream_interval: int = 1,
    repeats: int = 1,
    dtype: str = "float32",
) -> tuple[float, list[list[int]], dict[str, float]]:
    """Our services (started and stopped here) on ``model_dir``: all requests at once over gRPC, ``repeats`` times
    against the same services; the median run ``(wall_s, tokens, cpu_s)``, ``cpu_s`` the encoder's and the
    decoder's CPU seconds over it. ``dtype``: both services' ``--dtype``."""
    from encdec.launcher import Services

    enc, dec = service_args(threads, max(len(sources), 1), quantize, dtype)
    dec = [*dec, "--stream-interval", str(stream_interval)]
    with Services(model=str(model_dir), log_level="WARNING", extra_encoder_args=enc, extra_decoder_args=dec) as svc:
        pids = {n: svc.process(n).pid for n in ("encoder", "decoder")}
        return median_run(
            [asyncio.run(_ours_once(svc.decoder_address, sources, new_tokens, pids)) for _ in range(max(repeats, 1))]
        )


def _row(
    model: str,
    system: str,
    mode: str,
    wall: float,
    tokens: list[list[int]],
    truth: list[list[int]] | None,
    load: float,
    source_len: int,
    cpu: dict[str, float] | None = None,
) -> dict:
    """One table row; its FLOPs (``encdec.bench.flops``) from each request's generated tokens, and ``cpu s`` (our
    encoder's and decoder's CPU seconds) where known, for ``roofline.add_achieved``."""
    n = sum(len(t) for t in tokens)
    dims = seq2seq_dims(SHAPES[model])
    same = None if truth is None else f"{sum(a == b for a, b in zip(tokens, truth))}/{len(tokens)}"
    return {
        "model": model,
        "system": system,
        "mode": mode,
        "requests": len(tokens),
        "tokens": n,
        "wall s": wall,
        "tokens/s": n / wall if wall > 0 else 0.0,
        "same as HF": same,
        "load": load,
        **roofline.totals([seq2seq_request_flops(dims, source_len, len(t)) for t in tokens]),
        "cpu s": cpu,
    }


def bench_model(name: str, args, progress: bool = True) -> list[dict]:
    """All systems on one shape; returns the table rows (``x best batched`` filled in)."""
    model_dir = build_checkpoint(name, args.cache_dir)
    sources = source_ids(name, args.requests, args.source_len)
    n = args.new_tokens
    say = (
        (lambda msg: print(f"[seq2seq {name}] {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    )
    rows: list[dict] = []
    load = os.getloadavg
    intervals = [int(k) for k in str(args.stream_intervals).split(",") if k.strip()] or [1]
    ours = {}
    for k in intervals:
        say(f"our services (gRPC, all requests at once, stream interval {k}) ...")
        ours[("fp32", k)] = (
            *run_ours(model_dir, sources, n, args.threads, stream_interval=k, repeats=args.repeats),
            load()[0],
        )
    if args.int8:
        ours[("int8", intervals[0])] = (
            *run_ours(model_dir, sources, n, args.threads, "int8", intervals[0], args.repeats),
            load()[0],
        )
    if getattr(args, "bf16", False):
        say("our services, --dtype bfloat16 ...")
        ours[("bf16", intervals[0])] = (
            *run_ours(model_dir, sources, n, args.threads, "none", intervals[0], args.repeats, "bfloat16"),
            load()[0],
        )
    say("HF generate ...")
    hf = run_hf(
        model_dir,
        sources,
        n,
        args.threads,
        sequential=not args.skip_hf_sequential,
        progress=progress,
        repeats=args.repeats,
    )
    hf_load = load()[0]
    truth = hf.get("sequential", hf["batched"])[1]
    for mode, (wall, tokens) in hf.items():
        rows.append(_row(name, "HF transformers fp32", mode, wall, tokens, truth, hf_load, args.source_len))
    ct2_batched = None
    if not args.skip_ct2:
        modes = ["batched"] if args.skip_hf_sequential else ["sequential", "batched"]
        for compute_type in ("float32", "int8") if args.int8 else ("float32",):
            say(f"CTranslate2 {compute_type} ...")
            res = run_ct2(
                model_dir,
                Path(args.cache_dir) / f"{model_dir.name}-ct2",
                sources,
                n,
                args.threads,
                compute_type,
                modes,
                args.repeats,
            )
            ct2_load = load()[0]
            for mode, (wall, tokens) in res.items():
                rows.append(
                    _row(name, f"CTranslate2 {compute_type}", mode, wall, tokens, truth, ct2_load, args.source_len)
                )
                if compute_type == "float32" and mode == "batched":
                    ct2_batched = rows[-1]
    for (q, k), (wall, tokens, cpu, ours_load) in ours.items():
        system = f"encdec-serve {q} (2 services, gRPC{'' if k == 1 else f', stream interval {k}'})"
        rows.append(
            _row(name, system, f"concurrent {len(sources)}", wall, tokens, truth, ours_load, args.source_len, cpu)
        )
    hf_batched = next(r for r in rows if r["system"].startswith("HF") and r["mode"] == "batched")
    best = max(hf_batched["tokens/s"], ct2_batched["tokens/s"] if ct2_batched else 0.0)
    for r in rows:
        r["x best batched"] = r["tokens/s"] / best if best else None
    return rows


def run(args, progress: bool = True) -> dict:
    """Runs every shape in ``args.models``; returns the JSON payload (``rows``, settings)."""
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in SHAPES]
    if unknown:
        raise ValueError(f"unknown model shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    machine_peak(args.threads)  # at bench start, before any system runs
    rows: list[dict] = []
    for name in names:
        rows += bench_model(name, args, progress)
    peak = machine_peak(args.threads, remeasure=True)  # and at its end: the best of both
    roofline.add_achieved(rows, peak, args.threads)
    fixed = {"min_tokens", "ignore_eos"} <= set(_sampling_fields())
    return {
        "bench": "seq2seq",
        "models": names,
        "requests": args.requests,
        "source_len": args.source_len,
        "new_tokens": args.new_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "stream_intervals": args.stream_intervals,
        "cpu_count": os.cpu_count(),
        "ours_fixed_length": fixed,
        "columns": COLUMNS,
        "rows": rows,
        "peak": peak.to_dict(),
        "notes": [peak_line(peak), roofline.NOTE, *_int8_notes(rows)],
    }


def _int8_notes(rows: list[dict]) -> list[str]:
    """Per model with an int8 row: ours int8 against CTranslate2 int8 batched (the comparable mode), both counted
    against HF fp32's outputs."""
    notes = []
    for ours in (r for r in rows if r["system"].startswith("encdec-serve int8")):
        ct2 = next(
            (
                r
                for r in rows
                if r["model"] == ours["model"] and r["system"] == "CTranslate2 int8" and r["mode"] == "batched"
            ),
            None,
        )
        if ct2 is not None:
            notes.append(
                f"{ours['model']} int8: ours {ours['tokens/s']:.0f} tokens/s, CTranslate2 int8 batched "
                f"{ct2['tokens/s']:.0f}: {ours['tokens/s'] / ct2['tokens/s']:.2f}x; same as HF fp32: ours "
                f"{ours['same as HF']}, CTranslate2 int8 {ct2['same as HF']}"
            )
    return notes


def _sampling_fields() -> list[str]:
    from shared.proto import decoder_pb2

    return list(decoder_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def main(args) -> int:
    payload = run(args)
    print(f"Machine: {machine_line()}\n")
    print(markdown_table(payload["rows"], COLUMNS))
    print("\n" + "\n".join(payload["notes"]))
    if args.json:
        write_json(args.json, payload)
    return 0
