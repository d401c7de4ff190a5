"""``encdec bench quality``'s tables: scores per system and subset, timings, and ours against faster-whisper.

Scores (``quality_metrics``) are computed per file and summed per subset: WER = the subset's errors over
its reference words (what ``jiwer`` gives for the subset as one corpus), words in gaps (subsets whose files
have gaps only), repetition loops; an ``all`` row per system covers every chosen file.
"""

from __future__ import annotations

from encdec.bench.quality_corpus import CorpusFile
from encdec.bench.quality_metrics import repetition_loops, wer_counts, words_in_gaps
from encdec.bench.quality_systems import NAMES
from encdec.bench.table import format_number, markdown_table

COLUMNS = ["system", "subset", "files", "audio s", "WER", "words in gaps", "loops", "failed"]
TIMING_COLUMNS = [
    "system",
    "all files",
    "audio s",
    "wall s",
    "x realtime",
    "alone s (segment)",
    "alone s (word)",
    "alone x realtime",
]


def score_file(meta: CorpusFile, hyp: dict) -> dict:
    """One file's scores: ``errors`` and ``ref_words`` (WER's parts), ``words_in_gaps`` (None without gaps),
    ``loops`` (``repetition_loops``' list), ``error`` (the request's, or None)."""
    errors, ref_words = wer_counts([(meta.reference, hyp["text"], meta.language)])
    return {
        "name": meta.name,
        "subset": meta.subset,
        "errors": errors,
        "ref_words": ref_words,
        "words_in_gaps": words_in_gaps(hyp["segments"], meta.gaps, meta.language) if meta.gaps else None,
        "loops": repetition_loops(hyp["text"], meta.reference, meta.language),
        "error": hyp.get("error"),
    }


def _row(system: str, subset: str, files: list[CorpusFile], scores: list[dict]) -> dict:
    ref_words = sum(s["ref_words"] for s in scores)
    gaps = [s["words_in_gaps"] for s in scores if s["words_in_gaps"] is not None]
    return {
        "system": NAMES.get(system, system),
        "subset": subset,
        "files": len(files),
        "audio s": sum(f.seconds for f in files),
        "WER": sum(s["errors"] for s in scores) / ref_words if ref_words else None,
        "words in gaps": sum(gaps) if gaps else None,
        "loops": sum(len(s["loops"]) for s in scores),
        "failed": sum(s["error"] is not None for s in scores),
    }


def quality_rows(corpus: list[CorpusFile], runs: dict[str, dict]) -> tuple[list[dict], dict[str, list[dict]]]:
    """Rows (``COLUMNS``) per system and subset, then ``all``; and every file's scores per system.

    Args:
        corpus: the chosen files. runs: system -> its runner's result (``quality_systems``).
    """
    subsets = list(dict.fromkeys(f.subset for f in corpus))
    rows, per_file = [], {}
    for system, run in runs.items():
        scores = [score_file(f, run["files"][f.name]) for f in corpus]
        per_file[system] = scores
        for subset in subsets:
            pick = [i for i, f in enumerate(corpus) if f.subset == subset]
            rows.append(_row(system, subset, [corpus[i] for i in pick], [scores[i] for i in pick]))
        if len(subsets) > 1:
            rows.append(_row(system, "all", corpus, scores))
    return rows, per_file


def timing_rows(corpus: list[CorpusFile], alone: CorpusFile, runs: dict[str, dict]) -> list[dict]:
    """Rows (``TIMING_COLUMNS``): every chosen file (ours all at once, anchors file after file), and the
    longest file alone with segment / word timestamps where measured; x realtime = audio s / wall s."""
    audio_s = sum(f.seconds for f in corpus)
    rows = []
    for system, run in runs.items():
        times = {k: v["wall_s"] for k, v in run.get("alone", {}).items()}
        rows.append(
            {
                "system": NAMES.get(system, system),
                "all files": f"{len(corpus)} at once" if system == "ours" else f"{len(corpus)}, file after file",
                "audio s": audio_s,
                "wall s": run["wall_s"],
                "x realtime": audio_s / run["wall_s"],
                "alone s (segment)": times.get("segment"),
                "alone s (word)": times.get("word"),
                "alone x realtime": alone.seconds / times["segment"] if times.get("segment") else None,
            }
        )
    return rows


def verdicts(rows: list[dict]) -> list[str]:
    """Per subset: ours' WER at most faster-whisper sequential's, loops zero, words in gaps zero
    (reported, never enforced)."""
    by = {(r["system"], r["subset"]): r for r in rows}
    ours_name, fw_name = NAMES["ours"], NAMES["fw-sequential"]
    lines = []
    for subset in dict.fromkeys(r["subset"] for r in rows if r["system"] == ours_name and r["subset"] != "all"):
        ours, fw = by[ours_name, subset], by.get((fw_name, subset))
        wer = "-" if ours["WER"] is None else format_number(ours["WER"])
        if fw is None or fw["WER"] is None or ours["WER"] is None:
            against = f"WER {wer} (no faster-whisper sequential WER)"
        else:
            ok = "yes" if ours["WER"] <= fw["WER"] else "NO"
            against = f"WER {wer} <= faster-whisper sequential {format_number(fw['WER'])}: {ok}"
        line = f"{subset}: ours {against}; loops {ours['loops']} == 0: {'yes' if ours['loops'] == 0 else 'NO'}"
        if ours["words in gaps"] is not None:
            line += f"; words in gaps {ours['words in gaps']} == 0: {'yes' if ours['words in gaps'] == 0 else 'NO'}"
        lines.append(line)
    return lines


def render(result: dict) -> str:
    """The quality table, the timing table, then the notes (verdict lines, systems left out or failed)."""
    parts = [markdown_table(result["rows"], result["columns"]), ""]
    for table in result.get("tables", []):
        parts += [f"{table['title']}:", "", markdown_table(table["rows"], table["columns"]), ""]
    return "\n".join(parts + result.get("notes", []))
