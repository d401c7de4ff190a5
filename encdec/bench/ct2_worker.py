"""CTranslate2 Whisper runs for the bench, in their own process.

CTranslate2 and torch each ship an OpenMP runtime; in one process with
multi-threaded torch, CT2 decoding runs slower (notes/facts.md; measured:
docs/benchmarks.md, Measurements formerly in docstrings), so
the bench calls this module as a subprocess and reads one JSON line back.

Usage: ``python -m encdec.bench.ct2_worker MODEL_DIR COMPUTE_TYPE MODE THREADS REPEATS FILE...``
(MODE ``sequential`` or ``batched``; the run of median wall time of REPEATS timed runs is printed).
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> None:
    import ctranslate2
    import numpy as np

    from decoder_svc.audio import decode_audio
    from encdec.bench.table import median_run
    from shared.models.whisper_features import log_mel_spectrogram

    model_dir, compute_type, mode, threads, repeats, *files = argv
    model = ctranslate2.models.Whisper(model_dir, device="cpu", compute_type=compute_type, intra_threads=int(threads))
    audio = [decode_audio(open(f, "rb").read()) for f in files]
    prompt = [50257, 50362]

    def run(batch: list) -> list[list[int]]:
        feats = np.stack([log_mel_spectrogram(a).numpy() for a in batch])  # [B, 80, 3000]
        results = model.generate(
            ctranslate2.StorageView.from_array(feats), [prompt] * len(batch), beam_size=1, max_length=448
        )
        return [list(r.sequences_ids[0]) for r in results]

    run(audio[:1])  # warm-up
    runs = []
    for _ in range(max(int(repeats), 1)):
        start = time.perf_counter()
        tokens = run(audio) if mode == "batched" else [run([a])[0] for a in audio]
        runs.append((time.perf_counter() - start, tokens))
    wall, tokens = median_run(runs)
    print(json.dumps({"wall_s": wall, "tokens": tokens}))


if __name__ == "__main__":
    main(sys.argv[1:])
