"""``encdec bench quality``: transcript quality of ours vs faster-whisper vs HF on a synthetic corpus.

Builds (or reuses) the espeak-ng corpus (``quality_corpus``: clean clips, pauses, long readings, silence
gaps, noise, noise-only stretches, German / Spanish / French), runs every system of ``quality_systems`` on
the chosen subsets with the same weights (float32, ``--threads`` each), scores each file
(``quality_metrics``: WER after Whisper's normalizers, words in gaps, repetition loops) and prints, under
the machine line, one table of system x subset, one of timings (the longest file alone, with segment and
word timestamps; every file: ours at once, anchors file after file) and a line per subset saying whether
ours' WER is at most faster-whisper sequential's and its loops and words in gaps are zero (reported, never
enforced). ``--json`` keeps every file's hypothesis and scores, to diff runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

from encdec.bench.quality_corpus import SEED, SUBSETS, build_corpus, corpus_key, load_corpus
from encdec.bench.quality_systems import CT2_SYSTEMS, NAMES, SYSTEMS

ENGLISH_SUBSETS = tuple(s for s in SUBSETS if not s.startswith("lang-"))


def multilingual(model_dir: Path) -> bool:
    """Whether the CTranslate2 checkpoint is multilingual: its vocabulary has 51865 entries or more
    (openai/whisper; HF's ``is_multilingual``), English-only ones 51864."""
    from shared.models.whisper_specials import MULTILINGUAL_MIN_VOCAB

    if (model_dir / "vocabulary.json").exists():
        size = len(json.loads((model_dir / "vocabulary.json").read_text()))
    else:
        size = len((model_dir / "vocabulary.txt").read_text().splitlines())
    return size >= MULTILINGUAL_MIN_VOCAB


def _csv(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def choose(args, is_multilingual: bool) -> tuple[list[str], list[str], list[str]]:
    """``(subsets, systems, notes)`` from ``--subsets`` / ``--systems`` / ``--skip-ct2`` / ``--skip-hf``.

    Raises:
        ValueError: an unknown subset or system, or a ``lang-*`` subset for an English-only model.
    """
    subsets = _csv(args.subsets) or list(SUBSETS if is_multilingual else ENGLISH_SUBSETS)
    if unknown := [s for s in subsets if s not in SUBSETS]:
        raise ValueError(f"unknown subset(s) {unknown}; choose from {', '.join(SUBSETS)}")
    if not is_multilingual and (other := [s for s in subsets if s not in ENGLISH_SUBSETS]):
        raise ValueError(f"{args.model} is English-only: no {', '.join(other)}")
    systems = _csv(args.systems) or list(SYSTEMS)
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise ValueError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    notes = []
    if args.skip_ct2 or importlib.util.find_spec("faster_whisper") is None:
        if any(s in CT2_SYSTEMS for s in systems):
            notes.append("no faster-whisper systems (--skip-ct2, or not installed: the [bench] extra)")
        systems = [s for s in systems if s not in CT2_SYSTEMS]
    if args.skip_hf and "hf" in systems:
        systems.remove("hf")
    return [s for s in SUBSETS if s in subsets], [s for s in SYSTEMS if s in systems], notes


def _run_system(system: str, args, model_dir: str, paths: dict[str, str], alone: str, warmup: str) -> dict:
    from encdec.bench import quality_systems as qs

    if system == "ours":
        return qs.run_ours(args.model, paths, alone, warmup, args.threads, args.address, args.ours_options)
    if system == "hf":
        return qs.run_hf(model_dir, paths, args.threads)
    return qs.run_faster_whisper(system, model_dir, paths, args.threads, alone if system == "fw-sequential" else None)


def run(args) -> dict:
    """The whole bench (``args``: ``encdec bench quality``'s); the JSON payload, ``{"columns", "rows",
    "tables", "notes", ...}`` as ``encdec bench all`` renders it.

    Raises:
        ValueError: see ``choose``; a negative ``corpus_seed``. RuntimeError: espeak-ng or sox missing
            (``build_corpus``).
    """
    if args.corpus_seed is not None and args.corpus_seed < 0:
        raise ValueError(f"--corpus-seed must be an integer >= 0, got {args.corpus_seed}")
    from encdec.bench.machine import machine_info
    from encdec.bench.quality_report import COLUMNS, TIMING_COLUMNS, quality_rows, timing_rows, verdicts
    from shared.models.registry import resolve_model

    model_dir = resolve_model(args.model)[1]
    subsets, systems, notes = choose(args, multilingual(Path(model_dir)))
    seed = SEED if args.corpus_seed is None else args.corpus_seed
    root = build_corpus(args.corpus_dir, seed=seed, subsets=[*subsets, "long"])  # long-1: the file timed alone
    corpus, everything = load_corpus(root, subsets), load_corpus(root)
    alone, warmup = max(everything, key=lambda f: f.seconds), min(everything, key=lambda f: f.seconds)
    paths = {f.name: str(root / f"{f.name}.wav") for f in corpus}
    audio_s = sum(f.seconds for f in corpus)
    print(
        f"[quality] {len(corpus)} files, {audio_s:.0f} s of audio ({', '.join(subsets)}); corpus {root}",
        file=sys.stderr,
        flush=True,
    )
    runs, failed = {}, {}
    for system in systems:
        try:
            wavs = str(root / f"{alone.name}.wav"), str(root / f"{warmup.name}.wav")
            runs[system] = _run_system(system, args, str(model_dir), paths, *wavs)
        except Exception as exc:  # noqa: BLE001 - a failing system must not lose the others' results
            stderr = getattr(exc, "stderr", None) or ""  # an anchor process's own error
            failed[system] = f"{type(exc).__name__}: {exc} {stderr[-1500:]}".strip()
            print(f"[quality] {system} failed: {failed[system]}", file=sys.stderr, flush=True)
            continue
        print(f"[quality] {NAMES[system]}: {runs[system]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    rows, per_file = quality_rows(corpus, runs)
    if retries := sum(f.get("retries", 0) for f in runs.get("ours", {}).get("files", {}).values()):
        notes.append(
            f"ours: {retries} sends refused by the decoder's admission control (RESOURCE_EXHAUSTED) and sent "
            "again after a backoff; the all-files wall time includes the waits"
        )
    return {
        "bench": "quality",
        "machine": machine_info(),
        "model": args.model,
        "threads": args.threads,
        "subsets": subsets,
        "corpus": {"root": str(root), "key": corpus_key(seed), "seed": seed, "audio_s": audio_s, "alone": alone.name},
        "columns": COLUMNS,
        "rows": rows,
        "tables": [{"title": "timings", "columns": TIMING_COLUMNS, "rows": timing_rows(corpus, alone, runs)}],
        "notes": notes + (verdicts(rows) if "ours" in runs else []) + [f"{s}: failed: {e}" for s, e in failed.items()],
        "failed": failed,
        "systems": {s: {"name": NAMES[s], **r} for s, r in runs.items()},
        "per_file": per_file,
        "files": [asdict(f) for f in corpus],
    }


def main(args) -> int:
    """``encdec bench quality``: prints the machine line and the tables; 1 when a system failed, 2 on bad
    arguments."""
    from encdec.bench.machine import machine_info, machine_line
    from encdec.bench.quality_report import render
    from encdec.bench.table import write_json

    print(f"Machine: {machine_line(machine_info())}; model {args.model}; {args.threads} threads per system\n")
    try:
        result = run(args)
    except ValueError as exc:
        print(f"encdec bench quality: {exc}", file=sys.stderr)
        return 2
    print(render(result))
    if args.json:
        write_json(args.json, result)
    return 1 if result["failed"] else 0
