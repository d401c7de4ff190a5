"""CTranslate2 ``Translator`` runs for ``encdec bench seq2seq``, in their own process.

Like ``faster_whisper_anchor`` (Whisper): CTranslate2 and torch each ship an OpenMP
runtime and CT2 slows next to multi-threaded torch (notes/facts.md), so the bench
runs this module as a subprocess. It reads one JSON job on stdin and prints one
JSON line.

Job: ``{"model_dir", "ct2_dir", "compute_type", "threads", "sources": [[id, ...]],
"new_tokens", "modes": ["sequential", "batched"], "repeats"}`` (batched: timed ``repeats`` times, the median
reported). The HF directory is
converted into ``ct2_dir`` with CTranslate2's own ``TransformersConverter``
when ``ct2_dir`` has no ``model.bin`` yet. Output:
``{"convert_s", "<mode>": {"wall_s", "tokens": [[id, ...]]}}``; token ids are
looked up in the converted model's ``shared_vocabulary.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def convert(model_dir: str, ct2_dir: str) -> float:
    """Converts (once) with ``ctranslate2.converters.TransformersConverter``; returns the seconds spent (0 if cached)."""
    if (Path(ct2_dir) / "model.bin").is_file():
        return 0.0
    import ctranslate2

    start = time.perf_counter()
    ctranslate2.converters.TransformersConverter(model_dir).convert(ct2_dir, force=True)
    return time.perf_counter() - start


def main() -> None:
    job = json.loads(sys.stdin.read())
    result: dict = {"convert_s": 0.0}
    # Convert in a child: the converter imports torch + transformers, which must not share this process's OpenMP.
    import subprocess

    if not (Path(job["ct2_dir"]) / "model.bin").is_file():
        code = f"from encdec.bench.ct2_translator_worker import convert; print(convert({job['model_dir']!r}, {job['ct2_dir']!r}))"
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
        result["convert_s"] = float(out.strip().splitlines()[-1])

    import ctranslate2

    from encdec.bench.table import median_run

    vocab = json.loads((Path(job["ct2_dir"]) / "shared_vocabulary.json").read_text())
    index = {t: i for i, t in enumerate(vocab)}
    translator = ctranslate2.Translator(
        job["ct2_dir"], device="cpu", compute_type=job["compute_type"], intra_threads=int(job["threads"])
    )
    n = int(job["new_tokens"])
    sources = [[vocab[i] for i in src] for src in job["sources"]]

    def run(batch: list[list[str]]) -> list[list[int]]:
        res = translator.translate_batch(
            batch, beam_size=1, min_decoding_length=n, max_decoding_length=n, max_batch_size=len(batch)
        )
        return [[index[t] for t in r.hypotheses[0]] for r in res]

    run(sources[:1])  # warm-up
    for mode in job["modes"]:
        runs = []
        for _ in range(max(int(job.get("repeats", 1)), 1) if mode == "batched" else 1):
            start = time.perf_counter()
            tokens = run(sources) if mode == "batched" else [run([s])[0] for s in sources]
            runs.append((time.perf_counter() - start, tokens))
        wall, tokens = median_run(runs)
        result[mode] = {"wall_s": wall, "tokens": tokens}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
