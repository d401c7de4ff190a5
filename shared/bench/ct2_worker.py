"""CTranslate2 Whisper runs for the bench, in their own process.

CTranslate2 and torch each ship an OpenMP runtime; in one process with
multi-threaded torch, CT2 decoding runs up to ~50% slower (notes/facts.md), so
the bench calls this module as a subprocess and reads one JSON line back.

Usage: ``python -m shared.bench.ct2_worker MODEL_DIR COMPUTE_TYPE MODE THREADS FILE...``
(MODE ``sequential`` or ``batched``).
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> None:
    import ctranslate2
    import numpy as np

    from shared.audio import decode_audio
    from shared.models.whisper_features import log_mel_spectrogram

    model_dir, compute_type, mode, threads, *files = argv
    model = ctranslate2.models.Whisper(model_dir, device="cpu", compute_type=compute_type, intra_threads=int(threads))
    audio = [decode_audio(open(f, "rb").read()) for f in files]
    prompt = [50257, 50362]

    def run(batch: list) -> list[list[int]]:
        feats = np.stack([log_mel_spectrogram(a).numpy() for a in batch])  # [B, 80, 3000]
        results = model.generate(ctranslate2.StorageView.from_array(feats), [prompt] * len(batch), beam_size=1, max_length=448)
        return [list(r.sequences_ids[0]) for r in results]

    run(audio[:1])  # warm-up
    start = time.perf_counter()
    if mode == "batched":
        tokens = run(audio)
    else:
        tokens = [run([a])[0] for a in audio]
    print(json.dumps({"wall_s": time.perf_counter() - start, "tokens": tokens}))


if __name__ == "__main__":
    main(sys.argv[1:])
