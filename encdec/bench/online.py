"""``encdec bench online``: Poisson arrivals against our services, latency percentiles.

Requests arrive as a Poisson process at ``--rate`` requests/s (exponential
inter-arrival gaps, seeded) for ``--duration`` seconds; each is one
``Generate`` stream, sent at its arrival time whatever is still running. The
workload is Whisper on the bundled clips (cycled; default model) or a
random-weight text model shape from ``seq2seq_checkpoints`` (``--workload
t5-small`` etc.; ``--source-len`` ids in, ``--new-tokens`` out).

Per request: TTFT (call start -> first message carrying tokens; includes
queueing and encoding) and TPOT (time per output token after the first:
``(end - first) / (tokens - 1)``). Reported: p50 / p99 of both, mean
end-to-end latency, completed requests/s and output tokens/s over the span
from the first arrival to the last completion. Before the timed arrivals,
``--lone-requests`` requests (default 10) run one at a time on the idle services, each after
``--lone-gap-s`` seconds idle (default 1 s): their median TTFT is the row's ``lone TTFT ms``, and
``p99 / lone`` is how much waiting behind other requests adds to the worst first token (issue 24's
online target: at most 1.3).

**Rate sweep** (``--rates 0.5,1,2,4``): one run per rate, one after another
against the same services (each starts when the previous one's requests
ended), past what the machine sustains. Each row adds the requests the
decoder refused at admission (RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED,
``decoder_svc.session.admission``) and the goodput: completed requests whose TTFT met
``--ttft-slo-ms``, per second of the run's span (vLLM's and DistServe's
goodput), beside the share of all requests that met it.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

from encdec.bench.machine import machine_line
from encdec.bench.table import markdown_table, write_json

COLUMNS = [
    "workload",
    "rate req/s",
    "duration s",
    "requests",
    "failed",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "lone TTFT ms",
    "p99 / lone",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "e2e mean s",
    "req/s",
    "tokens/s",
]
SWEEP_COLUMNS = [*COLUMNS, "refused", "TTFT SLO ms", "met SLO %", "goodput req/s"]
REFUSAL_CODES = ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")  # the decoder's admission answers


def arrival_times(rate: float, duration: float, seed: int) -> list[float]:
    """Poisson process: offsets (s) of the arrivals in ``[0, duration)``; exponential gaps of mean ``1/rate``."""
    if rate <= 0 or duration <= 0:
        raise ValueError(f"--rate and --duration must be > 0, got {rate} and {duration}")
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100 * (len(v) - 1)))))]


def _workload(args):
    """``(model_or_None, make_request(i) -> GenerateRequest)``."""
    from shared.proto import decoder_pb2

    if args.workload == "whisper":
        clip_dir = Path(args.clips)
        clips = sorted(clip_dir.glob("*.wav")) + sorted(clip_dir.glob("*.flac"))
        if not clips:
            raise ValueError(f"no .wav/.flac clips in {clip_dir}")
        payloads = [p.read_bytes() for p in clips]
        return None, lambda i: decoder_pb2.GenerateRequest(audio=payloads[i % len(payloads)])
    from encdec.bench.seq2seq import sampling_for
    from encdec.bench.seq2seq_checkpoints import DEFAULT_CACHE, SHAPES, build_checkpoint, source_ids

    if args.workload not in SHAPES:
        raise ValueError(f"unknown workload {args.workload!r}; use whisper or one of {', '.join(SHAPES)}")
    model_dir = build_checkpoint(args.workload, args.cache_dir or DEFAULT_CACHE)
    sources = source_ids(args.workload, 256, args.source_len, seed=args.seed)
    sampling = sampling_for(args.new_tokens)
    return str(model_dir), lambda i: decoder_pb2.GenerateRequest(
        input_ids=decoder_pb2.TokenIds(ids=sources[i % len(sources)]), sampling=sampling
    )


async def _drive(
    address: str,
    make_request,
    offsets: list[float],
    progress: bool,
    lone_requests: int,
    lone_gap_s: float,
) -> tuple[list[dict], float, float | None]:
    """``lone_requests`` lone requests, each after ``lone_gap_s`` seconds idle, then one request per offset
    (seconds): (per-request results, span s, median lone TTFT s or None)."""
    import grpc
    from tqdm import tqdm

    from shared.grpc_server import GRPC_OPTIONS
    from shared.proto import decoder_pb2_grpc

    bar = tqdm(total=len(offsets), desc="online requests", disable=not progress, leave=False)
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)

        async def one(i: int, at: float, t0: float, counted: bool = True) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            start = time.perf_counter()
            first, n, error = None, 0, None
            try:
                async for m in stub.Generate(make_request(i)):
                    if m.token_ids and first is None:
                        first = time.perf_counter()
                    n += len(m.token_ids)
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            end = time.perf_counter()
            bar.update(1 if counted else 0)
            return {
                "arrival_s": at,
                "start": start - t0,
                "end": end - t0,
                "tokens": n,
                "error": error,
                "ttft_s": None if first is None else first - start,
                "tpot_s": (end - first) / (n - 1) if first is not None and n > 1 else None,
            }

        async for _ in stub.Generate(make_request(0)):  # warm-up, not counted
            pass
        lone = []
        for i in range(lone_requests):  # one at a time on idle services: the TTFT nothing queues in front of
            await asyncio.sleep(lone_gap_s)  # idle first, as before an arrival of the run (not back to back)
            r = await one(i, 0.0, time.perf_counter(), counted=False)
            lone += [r["ttft_s"]] if r["ttft_s"] is not None else []
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, at, t0) for i, at in enumerate(offsets)))
        span = time.perf_counter() - t0
    bar.close()
    return list(results), span, statistics.median(lone) if lone else None


def summarize(
    workload: str, rate: float, duration: float, results: list[dict], lone_ttft_s: float | None = None
) -> dict:
    """One table row from per-request results and the lone requests' median TTFT (times in ms / s as the column
    names say)."""
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    span = max((r["end"] for r in ok), default=0.0) - min((r["arrival_s"] for r in results), default=0.0)

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000

    p99 = percentile(ttft, 99)
    return {
        "workload": workload,
        "rate req/s": rate,
        "duration s": duration,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "TTFT p50 ms": ms(percentile(ttft, 50)),
        "TTFT p99 ms": ms(p99),
        "lone TTFT ms": ms(lone_ttft_s),
        "p99 / lone": p99 / lone_ttft_s if p99 is not None and lone_ttft_s else None,
        "TPOT p50 ms": ms(percentile(tpot, 50)),
        "TPOT p99 ms": ms(percentile(tpot, 99)),
        "e2e mean s": statistics.fmean(r["end"] - r["start"] for r in ok) if ok else None,
        "req/s": len(ok) / span if span > 0 else None,
        "tokens/s": sum(r["tokens"] for r in ok) / span if span > 0 else None,
    }


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2"`` -> ``[0.5, 1.0, 2.0]``.

    Raises:
        ValueError: an entry is not a number > 0, or the list is empty.
    """
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers (requests/s), got {text!r}") from None
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise ValueError(f"--rates must list rates > 0 (requests/s), got {text!r}")
    return rates


def summarize_sweep(
    workload: str,
    rate: float,
    duration: float,
    results: list[dict],
    ttft_slo_s: float,
    lone_ttft_s: float | None = None,
) -> dict:
    """One rate-sweep row: ``summarize``'s columns plus refusals and goodput (TTFT within ``ttft_slo_s``)."""
    row = summarize(workload, rate, duration, results, lone_ttft_s)
    refused = sum(1 for r in results if r["error"] and r["error"].split(":", 1)[0] in REFUSAL_CODES)
    met = [r for r in results if r["error"] is None and r["ttft_s"] is not None and r["ttft_s"] <= ttft_slo_s]
    ok = [r for r in results if r["error"] is None]
    span = max((r["end"] for r in ok), default=0.0) - min((r["arrival_s"] for r in results), default=0.0)
    row.update(
        {
            "refused": refused,
            "TTFT SLO ms": ttft_slo_s * 1000,
            "met SLO %": 100.0 * len(met) / len(results) if results else None,
            "goodput req/s": len(met) / span if span > 0 else None,
        }
    )
    return row


def _sweep(args, model, make_request, progress: bool) -> tuple[list[dict], list[dict]]:
    """Runs every rate of ``--rates`` against one set of services: (rows, per-request results with their rate)."""
    rates = parse_rates(args.rates)
    if args.ttft_slo_ms <= 0:
        raise ValueError(f"--ttft-slo-ms must be > 0, got {args.ttft_slo_ms}")

    def drive_all(address: str) -> tuple[list[dict], list[dict]]:
        rows, requests = [], []
        for rate in rates:
            offsets = arrival_times(rate, args.duration, args.seed)
            if progress:
                print(f"[online sweep] {len(offsets)} arrivals at {rate} req/s", file=sys.stderr, flush=True)
            results, _, lone = asyncio.run(
                _drive(address, make_request, offsets, progress, args.lone_requests, args.lone_gap_s)
            )
            rows.append(summarize_sweep(args.workload, rate, args.duration, results, args.ttft_slo_ms / 1000, lone))
            requests += [{**r, "rate": rate} for r in results]
        return rows, requests

    if args.address:
        return drive_all(args.address)
    from encdec.launcher import Services

    flags = ["--num-threads", str(args.threads)]
    with Services(
        model=model,
        log_level="WARNING",
        extra_encoder_args=flags,
        extra_decoder_args=[*flags, "--max-num-seqs", str(args.max_num_seqs), "--encoder-cache", "0"],
    ) as svc:
        return drive_all(svc.decoder_address)


def run(args, progress: bool = True) -> dict:
    """Runs the online bench; returns the JSON payload (``rows`` with one row, or one per rate of ``--rates``;
    ``requests`` per request).

    Raises:
        ValueError: bad rate(s) / duration / workload / TTFT target.
    """
    if getattr(args, "rates", None):
        model, make_request = _workload(args)
        rows, requests = _sweep(args, model, make_request, progress)
        return {
            "bench": "online",
            "workload": args.workload,
            "rates": [row["rate req/s"] for row in rows],
            "duration": args.duration,
            "lone_requests": args.lone_requests,
            "lone_gap_s": args.lone_gap_s,
            "seed": args.seed,
            "threads": args.threads,
            "ttft_slo_ms": args.ttft_slo_ms,
            "cpu_count": os.cpu_count(),
            "columns": SWEEP_COLUMNS,
            "rows": rows,
            "requests": requests,
        }
    offsets = arrival_times(args.rate, args.duration, args.seed)
    model, make_request = _workload(args)
    if progress:
        print(
            f"[online {args.workload}] {len(offsets)} Poisson arrivals at {args.rate} req/s over {args.duration} s",
            file=sys.stderr,
            flush=True,
        )
    if args.address:
        results, _, lone = asyncio.run(
            _drive(args.address, make_request, offsets, progress, args.lone_requests, args.lone_gap_s)
        )
    else:
        from encdec.launcher import Services

        flags = ["--num-threads", str(args.threads)]
        with Services(
            model=model,
            log_level="WARNING",
            extra_encoder_args=flags,
            extra_decoder_args=[*flags, "--max-num-seqs", str(args.max_num_seqs), "--encoder-cache", "0"],
        ) as svc:  # repeated clips are encoded each time
            results, _, lone = asyncio.run(
                _drive(svc.decoder_address, make_request, offsets, progress, args.lone_requests, args.lone_gap_s)
            )
    row = summarize(args.workload, args.rate, args.duration, results, lone)
    return {
        "bench": "online",
        "workload": args.workload,
        "rate": args.rate,
        "duration": args.duration,
        "lone_requests": args.lone_requests,
        "lone_gap_s": args.lone_gap_s,
        "seed": args.seed,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "columns": COLUMNS,
        "rows": [row],
        "requests": results,
    }


def main(args) -> int:
    payload = run(args)
    print(f"Machine: {machine_line()}\n")
    print(markdown_table(payload["rows"], payload["columns"]))
    if args.json:
        write_json(args.json, payload)
    if getattr(args, "rates", None):  # past capacity refusals are expected; other failures are not
        return 0 if all(row["failed"] == row["refused"] for row in payload["rows"]) else 1
    return 0 if payload["rows"][0]["failed"] == 0 else 1
