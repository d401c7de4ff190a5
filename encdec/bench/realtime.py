"""``encdec bench realtime``: N realtime streams at once, fed at 1x real time; latency, real time held, WER.

For each N of ``--streams`` (default 1,2,4,8), N ``TranscribeStream`` calls run at once against our services,
stream i starting ``i x --stagger-s`` after the first, each fed its recording (``realtime_load``: the bundled
clips joined with pauses, and the quality corpus's ``pauses`` files where espeak-ng and sox can build it; stream i
takes recording ``i mod R``) in 100 ms chunks at 1x real time, half-closed at its end. Meanwhile one file
``Generate`` of the bundled ``sample.wav`` goes out every ``--file-every-s`` seconds, the files a realtime load
shares the services with. Per N (``realtime_load`` defines each score):

* final latency p50 / p99 over every utterance of every stream, and the utterances no final covered (missed);
  partial latency p50; the largest event lag; how many streams kept real time;
* WER of the streams' finals and of the same recordings sent as files through ``Generate``, against the
  references (``quality_metrics.corpus_wer``: jiwer after Whisper's English normalizer);
* the file requests' count, latency p50 and throughput (requests/s and audio seconds/s over the run).

Our services are driven by ``realtime_ours``; recordings and scores are ``realtime_load``'s. The anchor
(``realtime_fw``, left out by ``--skip-fw`` / ``--skip-ct2``): faster-whisper driving the same
LocalAgreement-2, N streams in one process on the same cores, scored the same way. The largest N within the
targets (``realtime_load.TARGETS``: final p50 <= 1 s, p99 <= 2 s, partial p50 <= 1.5 s, every stream in real
time) is reported, never enforced. Everything is printed under the machine line; ``--json`` keeps every stream's
scores and text, ``--plot`` draws the latencies against N.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path

from encdec.bench import realtime_load as rl
from encdec.bench.plot import save_figure
from encdec.bench.realtime_fw import run_streams
from encdec.bench.realtime_ours import REFUSED, run_ours

OURS, FW = "encdec-serve (gRPC)", "faster-whisper LocalAgreement-2 (1 process)"
COLUMNS = [
    "system",
    "streams",
    "utterances",
    "missed",
    "final p50 s",
    "final p99 s",
    "partial p50 s",
    "max lag s",
    "real time",
    "WER stream",
    "WER file",
    "file req",
    "file p50 s",
    "file req/s",
    "file audio s/s",
    "refused",
    "failed",
]
FILE_CLIP = "sample.wav"  # what the file requests send


def parse_streams(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``.

    Raises:
        ValueError: an entry that is not a whole number >= 1, or none.
    """
    try:
        ns = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise ValueError(f"--streams must be comma-separated whole numbers, got {text!r}") from None
    if not ns or min(ns) < 1:
        raise ValueError(f"--streams must list numbers >= 1, got {text!r}")
    return ns


def score(
    system: str,
    n: int,
    runs: list[rl.StreamRun],
    recs: list[rl.Recording],
    files: list[dict] | None = None,
    span_s: float | None = None,
    file_texts: dict[str, str] | None = None,
) -> tuple[dict, list[dict]]:
    """One table row of ``system`` at ``n`` streams (stream i fed ``recs[i mod len(recs)]``) and each stream's
    details; ``files``: the file requests of the run (over ``span_s`` seconds), ``file_texts``: each recording
    transcribed as a file (the WER comparison)."""
    from encdec.bench.quality_metrics import corpus_wer

    finals, partials, max_lag, kept, streams = [], [], [], 0, []
    for i, run in enumerate(runs):
        rec = recs[i % len(recs)]
        f = rl.final_latencies(run, rec.spans)
        p = rl.partial_latencies(run, rec.spans)
        lag = [x for _, x in rl.lags(run)]
        ok = rl.kept_realtime(run)
        finals += f
        partials += p
        max_lag += lag
        kept += ok
        streams.append(
            {"recording": rec.name, "final_latency_s": f, "partial_p50_s": rl.percentile(p, 50),
             "max_lag_s": max(lag, default=None), "kept_realtime": ok, "error": run.error, "text": run.text()}
        )  # fmt: skip
    got = [x for x in finals if x is not None]
    pairs = [(recs[i % len(recs)].reference, run.text(), "en") for i, run in enumerate(runs) if not run.error]
    row = {
        "system": system,
        "mode": f"{n} streams",
        "streams": n,
        "utterances": len(finals),
        "missed": len(finals) - len(got),
        "final p50 s": rl.percentile(got, 50),
        "final p99 s": rl.percentile(got, 99),
        "partial p50 s": rl.percentile(partials, 50),
        "max lag s": max(max_lag, default=None),
        "real time": f"{kept}/{n}",
        "WER stream": corpus_wer(pairs),
        "refused": sum(1 for r in runs if r.error.startswith(REFUSED)),
        "failed": sum(1 for r in runs if r.error and not r.error.startswith(REFUSED)),
    }
    if file_texts is not None:
        row["WER file"] = corpus_wer(
            [(recs[i % len(recs)].reference, file_texts[recs[i % len(recs)].name], "en") for i in range(n)]
        )
    if files is not None:
        ok = [f for f in files if not f["error"]]
        row.update(
            {
                "file req": f"{len(ok)}/{len(files)}",
                "file p50 s": rl.percentile([f["latency_s"] for f in ok], 50),
                "file req/s": len(ok) / span_s if span_s else None,
                "file audio s/s": sum(f["audio_s"] for f in ok) / span_s if span_s else None,
                "file errors": dict(Counter(f["error"].split(":", 1)[0] for f in files if f["error"])),
            }
        )
    row["holds"] = kept == n and row["missed"] == 0 and rl.meets_targets(row)  # kept: none refused or failed
    return row, streams


def largest_holding(rows: list[dict], system: str) -> int | None:
    """The largest N whose row of ``system`` meets the targets with every stream in real time (None: none)."""
    held = [r["streams"] for r in rows if r["system"] == system and r["holds"]]
    return max(held, default=None)


def run(args) -> dict:
    """The whole bench; the JSON payload (``columns``, ``rows``, ``notes``, ``streams`` per row, ...).

    Raises:
        ValueError: bad ``--streams`` / ``--duration-s``.
    """
    from encdec.bench.machine import machine_info

    ns = parse_streams(args.streams)
    if args.duration_s < 10:
        raise ValueError(f"--duration-s must be at least 10, got {args.duration_s}")
    recs, notes = rl.recordings(max(ns), args.clips, args.corpus, args.duration_s, args.seed)
    print(
        f"[realtime] {len(recs)} recordings ({', '.join(f'{r.name} {r.seconds:.0f} s' for r in recs)})",
        file=sys.stderr,
        flush=True,
    )
    ours = run_ours(recs, ns, args, (Path(args.clips) / FILE_CLIP).read_bytes())
    rows, details = [], []
    for n, r in ours["per_n"].items():
        row, streams = score(OURS, n, r["runs"], recs, r["files"], r["span_s"], ours["file_texts"])
        rows.append(row)
        details.append(streams)
    step_s = ours["step_s"] or 1.0
    if args.skip_fw or getattr(args, "skip_ct2", False) or importlib.util.find_spec("faster_whisper") is None:
        notes.append("faster-whisper anchor: optional, skipped (--skip-fw / --skip-ct2, or not installed)")
    else:
        try:
            for n, runs in run_streams(recs, ns, args.model, args.threads, step_s, args.stagger_s).items():
                row, streams = score(FW, n, runs, recs)
                rows.append(row)
                details.append(streams)
        except Exception as exc:  # noqa: BLE001 - the anchor failing must not lose our rows
            stderr = getattr(exc, "stderr", None) or ""
            notes.append(f"faster-whisper anchor failed: {type(exc).__name__}: {exc} {stderr[-1500:]}".strip())
    targets = ", ".join(f"{k.replace('_', ' ')} <= {v}" for k, v in rl.TARGETS.items())
    for system in (OURS, FW):
        if any(r["system"] == system for r in rows):
            best = largest_holding(rows, system)
            notes.append(
                f"{system}: largest N holding real time ({targets}, every stream in real time, none missed): "
                + (str(best) if best is not None else "none of " + args.streams)
            )
    files = f"a file Generate ({FILE_CLIP}) every {args.file_every_s:g} s" if args.file_every_s else "no file requests"
    notes.append(f"server step {step_s:g} s; streams start {args.stagger_s:g} s apart; {files} during ours")
    return {
        "bench": "realtime",
        "machine": machine_info(),
        "model": args.model,
        "threads": args.threads,
        "streams": ns,
        "recordings": [
            {"name": r.name, "seconds": r.seconds, "reference": r.reference, "spans": r.spans} for r in recs
        ],
        "columns": COLUMNS,
        "rows": rows,
        "notes": notes,
        "per_stream": details,
    }


def plot(payload: dict, path: str) -> Path:
    """Final p50 / p99 and partial p50 latency against N, a line each per system, the targets dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for system, style in ((OURS, "-"), (FW, "--")):
        rows = [r for r in payload["rows"] if r["system"] == system]
        for metric, color in (("final p50 s", "tab:blue"), ("final p99 s", "tab:red"), ("partial p50 s", "tab:green")):
            pts = [(r["streams"], r[metric]) for r in rows if r.get(metric) is not None]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{system}: {metric}")
    for value in sorted(set(rl.TARGETS.values())):
        ax.axhline(value, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # the anchor's seconds of lag beside ours' fractions of one
    ax.set_xlabel("concurrent streams (N)")
    ax.set_ylabel("seconds")
    ax.set_title(f"realtime: latency against N ({payload['model']})")
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(args) -> int:
    """``encdec bench realtime``: the machine line, the table, the notes; 1 when a stream failed (other than
    refused), 2 on bad arguments."""
    from encdec.bench.machine import machine_info, machine_line
    from encdec.bench.table import markdown_table, write_json

    print(f"Machine: {machine_line(machine_info())}; model {args.model}; {args.threads} threads per service\n")
    try:
        payload = run(args)
    except ValueError as exc:
        print(f"encdec bench realtime: {exc}", file=sys.stderr)
        return 2
    print(markdown_table(payload["rows"], payload["columns"]))
    print("\n" + "\n".join(payload["notes"]))
    if args.json:
        write_json(args.json, payload)
    if args.plot:
        print(f"plot: {plot(payload, args.plot)}", file=sys.stderr)
    return 1 if any(r["failed"] for r in payload["rows"]) else 0  # refusals past capacity are a result
