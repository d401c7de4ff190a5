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
(MODE and REPEATS as above for ``ct2``; for the faster-whisper systems REPEATS is ``batch_size`` and MODE is
``-`` or a comma-separated list of ``FW_OPTIONS``: ``detect`` (the language detected by faster-whisper for a
multilingual checkpoint instead of English; an English-only one is always English), ``segments`` (each file's
segments back), ``words`` (``word_timestamps=True``, the words in the segments; implies ``segments``)).
Prints ``{"wall_s", "tokens"}`` (ct2) or ``{"wall_s", "texts", "segments"}``, plus ``"files"`` with
``segments`` / ``words``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

SYSTEMS = ("ct2", "fw-sequential", "fw-batched")
FW_OPTIONS = ("detect", "segments", "words")
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
    model_dir: str,
    compute_type: str,
    threads: int,
    batched: bool,
    batch_size: int,
    files: list[str],
    options: frozenset[str] = frozenset(),
) -> dict:
    """faster-whisper on ``files`` one after another (any length), greedy first attempt.

    Args:
        batched: ``BatchedInferencePipeline`` (VAD chunks, ``batch_size`` at a time) instead of ``WhisperModel``.
        options: of ``FW_OPTIONS`` (module docstring); none: English, texts only.

    Returns:
        ``{"wall_s": float, "texts": [str, ...], "segments": int}``: each file's segment texts joined (each
        carries its leading space), and the number of segments over all files. With ``segments`` / ``words``
        also ``"files"``: per file ``{"text", "language", "segments": [{"start", "end", "text"[, "words":
        [{"word", "start", "end"}]]}]}`` (seconds). Audio decoding is outside the timing (done before, as
        for HF); feature extraction, VAD and collecting the segments are inside.

    Raises:
        ImportError: faster-whisper is not installed (the ``[bench]`` extra). ValueError: an unknown option.
    """
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    if unknown := sorted(options - set(FW_OPTIONS)):
        raise ValueError(f"unknown option(s) {unknown}; choose from {', '.join(FW_OPTIONS)}")
    model = WhisperModel(model_dir, device="cpu", compute_type=compute_type, cpu_threads=threads)
    # English-only checkpoints are English either way (faster-whisper itself forces "en" for them).
    language = None if "detect" in options and model.model.is_multilingual else "en"
    word_timestamps = "words" in options
    audio = _audio(files)
    if batched:
        pipeline = BatchedInferencePipeline(model)

        def transcribe(pcm):
            return pipeline.transcribe(
                pcm, language=language, beam_size=1, batch_size=batch_size, word_timestamps=word_timestamps
            )
    else:

        def transcribe(pcm):
            return model.transcribe(
                pcm,
                language=language,
                beam_size=1,
                temperature=TEMPERATURES,
                compression_ratio_threshold=2.4,
                log_prob_threshold=-1.0,
                no_speech_threshold=0.6,
                condition_on_previous_text=True,
                without_timestamps=False,
                word_timestamps=word_timestamps,
                vad_filter=False,
            )

    list(transcribe(audio[0][: 5 * 16000])[0])  # warm-up: 5 s, one window; segments are a lazy generator
    start = time.perf_counter()
    per_file = []
    for pcm in audio:
        segments, info = transcribe(pcm)
        per_file.append((list(segments), info.language))
    wall = time.perf_counter() - start
    texts = ["".join(s.text for s in segs) for segs, _ in per_file]
    result = {"wall_s": wall, "texts": texts, "segments": sum(len(segs) for segs, _ in per_file)}
    if options & {"segments", "words"}:
        result["files"] = [
            {"text": text, "language": lang, "segments": [_segment(s) for s in segs]}
            for text, (segs, lang) in zip(texts, per_file)
        ]
    return result


def _segment(s) -> dict:
    """A faster-whisper ``Segment`` as JSON: start, end (seconds), text and, when timed, its words."""
    out = {"start": s.start, "end": s.end, "text": s.text}
    if s.words:
        out["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in s.words]
    return out


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
        options = frozenset() if mode == "-" else frozenset(o.strip() for o in mode.split(",") if o.strip())
        result = faster_whisper_long_form(
            model_dir, compute_type, int(threads), system == "fw-batched", int(repeats), files, options
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
