"""CTranslate2-backed Whisper anchors of ``encdec bench whisper``, each run in its own process.

CTranslate2 and torch each ship an OpenMP runtime and CTranslate2 decodes slower beside multi-threaded torch
(notes/facts.md; measured: docs/benchmarks.md), so the bench starts this module as a subprocess per system and
reads one JSON line back.

Three systems, on the CPU with ``THREADS`` intra-op threads and weights in COMPUTE_TYPE (``float32``, ``int8``):

* ``ct2``: short-form, ``ctranslate2.models.Whisper.generate`` greedily (``beam_size=1``, ``max_length=448``)
  from the decoder prompt of the checkpoint: ``<|startoftranscript|><|notimestamps|>`` English-only,
  ``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`` multilingual (as HF's ``language="en"``).
  MODE ``sequential`` (one clip per call) or ``batched`` (one call); the run of median wall time of REPEATS.
* ``fw-sequential``: long-form, faster-whisper's ``WhisperModel.transcribe`` file after file with OpenAI
  ``transcribe()``'s defaults except ``beam_size=1``: temperature fallback 0.0 .. 1.0, compression ratio
  2.4, logprob -1.0, no-speech 0.6, conditioned on the previous text, timestamps, no VAD.
* ``fw-batched``: long-form, ``BatchedInferencePipeline.transcribe`` file after file: silero-vad cuts each
  file into chunks of at most 30 s, which are decoded ``batch_size`` at a time without conditioning.

faster-whisper reads the CTranslate2 directory as the bench's other systems do: ``model.bin``, the
vocabulary and ``tokenizer.json``; without ``preprocessor_config.json`` it uses the 80-bin extractor.

Usage: ``python -m encdec.bench.faster_whisper_anchor SYSTEM MODEL_DIR COMPUTE_TYPE THREADS MODE REPEATS FILE...``
(MODE and REPEATS as above for ``ct2``; for the faster-whisper systems MODE is unused and REPEATS is
``batch_size``). Prints ``{"wall_s", "tokens"}`` (ct2) or ``{"wall_s", "texts", "segments"}``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

SYSTEMS = ("ct2", "fw-sequential", "fw-batched")
TEMPERATURES = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]  # openai-whisper transcribe() / faster-whisper defaults


def _audio(files: list[str]) -> list:
    from decoder_svc.session.audio import decode_audio

    return [decode_audio(Path(f).read_bytes()) for f in files]  # [N] float32 16 kHz each


def ct2_short_form(model_dir: str, compute_type: str, threads: int, mode: str, repeats: int, files: list[str]) -> dict:
    """CTranslate2 greedy short-form decoding of ``files`` (each at most 30 s).

    Returns:
        ``{"wall_s": float, "tokens": [[int, ...], ...]}``: generated ids per file (prompt excluded), of the run
        of median wall time.

    Raises:
        ValueError: an unknown ``mode``.
    """
    import ctranslate2
    import numpy as np

    from encdec.bench.table import median_run
    from shared.models.whisper_features import log_mel_spectrogram, special_token_ids

    if mode not in ("sequential", "batched"):
        raise ValueError(f"mode must be 'sequential' or 'batched', got {mode!r}")
    model = ctranslate2.models.Whisper(model_dir, device="cpu", compute_type=compute_type, intra_threads=threads)
    ids = special_token_ids(model_dir)
    language = ["<|en|>", "<|transcribe|>"] if model.is_multilingual else []
    prompt = [ids[n] for n in ("<|startoftranscript|>", *language, "<|notimestamps|>")]
    audio = _audio(files)

    def run(batch: list) -> list[list[int]]:
        feats = np.stack([log_mel_spectrogram(a).numpy() for a in batch])  # [B, 80, 3000]
        results = model.generate(
            ctranslate2.StorageView.from_array(feats), [prompt] * len(batch), beam_size=1, max_length=448
        )
        return [list(r.sequences_ids[0]) for r in results]

    run(audio[:1])  # warm-up
    runs = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        tokens = run(audio) if mode == "batched" else [run([a])[0] for a in audio]
        runs.append((time.perf_counter() - start, tokens))
    wall, tokens = median_run(runs)
    return {"wall_s": wall, "tokens": tokens}


def faster_whisper_long_form(
    model_dir: str, compute_type: str, threads: int, batched: bool, batch_size: int, files: list[str]
) -> dict:
    """faster-whisper on ``files`` one after another (any length), language English, greedy first attempt.

    Args:
        batched: ``BatchedInferencePipeline`` (VAD chunks, ``batch_size`` at a time) instead of ``WhisperModel``.

    Returns:
        ``{"wall_s": float, "texts": [str, ...], "segments": int}``: each file's segment texts joined (each
        carries its leading space), and the number of segments over all files. Audio decoding is outside the
        timing (done before, as for HF); feature extraction and VAD are inside.

    Raises:
        ImportError: faster-whisper is not installed (the ``[bench]`` extra).
    """
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    model = WhisperModel(model_dir, device="cpu", compute_type=compute_type, cpu_threads=threads)
    audio = _audio(files)
    if batched:
        pipeline = BatchedInferencePipeline(model)

        def transcribe(pcm):
            return pipeline.transcribe(pcm, language="en", beam_size=1, batch_size=batch_size)[0]
    else:

        def transcribe(pcm):
            segments, _ = model.transcribe(
                pcm,
                language="en",
                beam_size=1,
                temperature=TEMPERATURES,
                compression_ratio_threshold=2.4,
                log_prob_threshold=-1.0,
                no_speech_threshold=0.6,
                condition_on_previous_text=True,
                without_timestamps=False,
                vad_filter=False,
            )
            return segments

    list(transcribe(audio[0][: 5 * 16000]))  # warm-up: 5 s, one window; segments are a lazy generator
    start = time.perf_counter()
    per_file = [[s.text for s in transcribe(pcm)] for pcm in audio]
    wall = time.perf_counter() - start
    return {"wall_s": wall, "texts": ["".join(t) for t in per_file], "segments": sum(len(t) for t in per_file)}


def run_anchor(
    system: str, model_dir: str, compute_type: str, threads: int, mode: str, repeats: int, files: list[str]
) -> dict:
    """Runs this module as a subprocess (its own OpenMP runtime) and returns its JSON answer.

    Raises:
        subprocess.CalledProcessError: the worker failed (its stderr is in the exception).
    """
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "encdec.bench.faster_whisper_anchor",
        system,
        model_dir,
        compute_type,
        str(threads),
        mode,
        str(repeats),
        *files,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    system, model_dir, compute_type, threads, mode, repeats, *files = argv
    if system not in SYSTEMS:
        raise SystemExit(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    if system == "ct2":
        result = ct2_short_form(model_dir, compute_type, int(threads), mode, int(repeats), files)
    else:
        result = faster_whisper_long_form(
            model_dir, compute_type, int(threads), system == "fw-batched", int(repeats), files
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
