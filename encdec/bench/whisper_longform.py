"""``encdec bench whisper --long-form``: recordings of 2-5 minutes, ours vs HF long-form vs faster-whisper.

The recordings are built here, deterministically: the bundled clips (``--clips``, 16 kHz) in a seeded
random order each round, each followed by a pause of 0.5-2 s, until the next clip would pass the target
length (``clip_lengths``: 120, 180, 240, 300 s for 4 recordings), written as 16-bit WAV files that every
system reads. Systems (float32, ``--threads`` each; every anchor in a fresh process):

* HF transformers ``generate`` long-form (``generation_whisper.py``'s sequential algorithm: timestamps,
  temperature fallback 0.0 .. 1.0, compression ratio 2.4, logprob -1.0, no-speech 0.6, conditioned on the
  previous tokens, language "en"), one recording after another and all in one batch. HF sequential's
  transcripts are the reference of the ``WER vs HF`` column.
* faster-whisper ``WhisperModel.transcribe`` (the same algorithm and defaults, ``beam_size=1``) and
  ``BatchedInferencePipeline`` (VAD chunks decoded in batches), see ``faster_whisper_anchor``.
* our two services, every recording sent at once (``WhisperOptions(language="en", timestamps=SEGMENT)``).

WER: ``jiwer.wer`` over all recordings (one corpus) after ``normalize_text`` on both sides. Each system
runs once: a run of several minutes varies less than the 16-clip short-form runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
MIN_S, MAX_S = 120.0, 300.0  # shortest and longest recording
PAUSE_S = (0.5, 2.0)  # silence after each clip, drawn uniformly
SEED = 0
FW_BATCH_SIZE = 16  # BatchedInferencePipeline chunks per batch (its README's example)
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # openai-whisper transcribe() / HF long-form
HF, FW = "HF transformers fp32", "faster-whisper fp32"
FW_MODES = {  # faster_whisper_anchor system -> the row's mode
    "fw-sequential": "WhisperModel, file after file",
    "fw-batched": f"BatchedInferencePipeline batch {FW_BATCH_SIZE}, file after file",
}
TARGETS = {"fw-sequential": 1.5, "fw-batched": 1.0}  # our x realtime / faster-whisper's, reported only
COLUMNS = ["system", "mode", "clips", "audio s", "wall s", "x realtime", "x faster-whisper", "words", "WER vs HF"]


# ---- the recordings ------------------------------------------------------------------------------------------
def clip_lengths(count: int, max_s: float = MAX_S) -> list[float]:
    """Target seconds of ``count`` recordings: evenly from 120 to 300 s (120 alone for one), each capped at ``max_s``."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    steps = [0.0] if count == 1 else [i / (count - 1) for i in range(count)]
    return [min(MIN_S + (MAX_S - MIN_S) * s, max_s) for s in steps]


def build_recordings(clips: list[np.ndarray], lengths: list[float], seed: int = SEED) -> list[np.ndarray]:
    """Joins ``clips`` (``[N]`` float32, 16 kHz) into one recording per target length (seconds).

    Each round takes every clip once in a seeded random order, each followed by a 0.5-2 s pause; a
    recording ends before the clip that would pass its target (always at least one clip) and without
    its last pause, so no word is cut. Same ``seed``, same recordings.

    Raises:
        ValueError: no clips.
    """
    if not clips:
        raise ValueError("no clips to join")
    rng = np.random.default_rng(seed)

    def one(target: int) -> np.ndarray:
        parts, total = [], 0
        while True:
            for j in rng.permutation(len(clips)):
                if parts and total + len(clips[j]) > target:
                    return np.concatenate(parts[:-1])  # [samples] float32, the last pause left out
                pause = np.zeros(int(rng.uniform(*PAUSE_S) * SAMPLE_RATE), np.float32)
                parts += [clips[j].astype(np.float32), pause]
                total += len(clips[j]) + len(pause)

    return [one(int(s * SAMPLE_RATE)) for s in lengths]


# ---- scoring -------------------------------------------------------------------------------------------------
def normalize_text(text: str) -> str:
    """Lower case, apostrophes dropped, other punctuation as spaces, single spaces: what WER compares."""
    text = text.lower().replace("'", "").replace("\u2019", "")
    return " ".join(re.sub(r"[^\w\s]", " ", text).split())


def word_error_rate(references: list[str], hypotheses: list[str]) -> float | None:
    """``jiwer.wer`` of the hypotheses against the references as one corpus, both ``normalize_text``-ed;
    None when every reference is empty (no words to compare against)."""
    import jiwer

    refs, hyps = [normalize_text(t) for t in references], [normalize_text(t) for t in hypotheses]
    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r]
    if not pairs:
        return None
    return float(jiwer.wer([r for r, _ in pairs], [h for _, h in pairs]))


# ---- the systems ---------------------------------------------------------------------------------------------
def hf_long_form(
    model_dir: str, threads: int, mode: str, files: list[str], detect_language: bool = False, segments: bool = False
) -> dict:
    """HF ``generate`` long-form on ``files`` (``sequential``: one call each; ``batched``: one call).

    The reference model is ``build_hf_whisper`` with the long-form settings of the openai/whisper-*
    generation configs (``prev_sot_token_id``, ``max_initial_timestamp_index`` 50, every language of the
    checkpoint in ``lang_to_id``). Features: ``WhisperFeatureExtractor(truncation=False, padding="longest")``
    with its attention mask (``padding="max_length"`` to 30 s where every file of the call is shorter:
    HF's short-form path takes exactly 3000 frames), inside the timing; sampling (temperatures > 0) seeded
    with 0. A multilingual checkpoint transcribes in English unless ``detect_language`` (then ``generate``
    detects each file's).

    Returns:
        ``{"wall_s": float, "texts": [str, ...]}``: each file's text tokens decoded; with ``segments`` also
        ``"files"``: per file ``{"text", "segments": [{"start", "end", "text"}]}`` (seconds; HF's
        ``return_segments=True``).
    """
    import torch
    from transformers import WhisperFeatureExtractor

    from decoder_svc.session.audio import decode_audio
    from encdec.bench.hf_whisper import build_hf_whisper
    from shared.models.whisper_features import load_tokenizer, log_mel_spectrogram, special_token_ids
    from shared.models.whisper_specials import MAX_INITIAL_TIMESTAMP_INDEX

    torch.set_num_threads(threads)
    model = build_hf_whisper(model_dir)
    ids, g = special_token_ids(model_dir), model.generation_config
    g.prev_sot_token_id = ids["<|startofprev|>"]
    g.max_initial_timestamp_index = MAX_INITIAL_TIMESTAMP_INDEX
    language = {}
    if g.is_multilingual:
        lang_ids = set(json.loads((Path(model_dir) / "config.json").read_text())["lang_ids"])
        g.lang_to_id = {name: i for name, i in ids.items() if i in lang_ids}
        g.task_to_id = {"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]}
        language = {} if detect_language else {"language": "en"}  # English-only checkpoints refuse one
        if detect_language:
            g.language = None  # build_hf_whisper's default "en" would otherwise apply
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    tokenizer, eot = load_tokenizer(model_dir), ids["<|endoftext|>"]
    audio = [decode_audio(Path(f).read_bytes()) for f in files]

    def text(tokens) -> str:
        return tokenizer.decode([t for t in tokens if t < eot])

    def transcribe(batch: list) -> list[dict]:
        # HF takes a batch whose longest file is under 30 s as short-form, which needs exactly 3000 frames
        short = max(len(a) for a in batch) <= 30 * SAMPLE_RATE
        x = extractor(
            batch,
            sampling_rate=SAMPLE_RATE,
            truncation=short,
            padding="max_length" if short else "longest",
            return_attention_mask=True,
            return_tensors="pt",
        )
        out = model.generate(
            x.input_features,  # [B, 80, frames]
            attention_mask=x.attention_mask,
            return_timestamps=True,
            condition_on_prev_tokens=True,
            temperature=TEMPERATURES,
            compression_ratio_threshold=2.4,
            logprob_threshold=-1.0,
            no_speech_threshold=0.6,
            return_segments=segments,
            **language,
        )
        if not segments:
            return [{"text": text(seq)} for seq in out.tolist()]
        return [
            {
                "text": text(seq),
                "segments": [
                    {"start": float(seg["start"]), "end": float(seg["end"]), "text": text(seg["tokens"].tolist())}
                    for seg in segs
                ],
            }
            for seq, segs in zip(out["sequences"].tolist(), out["segments"])
        ]

    with torch.inference_mode():
        model.generate(log_mel_spectrogram(audio[0][: 5 * SAMPLE_RATE])[None], **language)  # warm-up
        torch.manual_seed(0)
        start = time.perf_counter()
        per_file = [r for a in audio for r in transcribe([a])] if mode == "sequential" else transcribe(audio)
        wall = time.perf_counter() - start
    return {"wall_s": wall, "texts": [f["text"] for f in per_file], **({"files": per_file} if segments else {})}


def _run_hf(model_dir: str, threads: int, mode: str, files: list[str]) -> dict:
    """``hf_long_form`` in a subprocess; ``mode``: ``sequential`` or ``batched``, optionally followed by
    ``,detect`` (``detect_language``) and ``,segments``."""
    cmd = [sys.executable, "-m", "encdec.bench.whisper_longform", model_dir, str(threads), mode, *files]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


# ---- the bench -----------------------------------------------------------------------------------------------
def run(args, clip_files: list[str], run_ours_long_form) -> dict:
    """Builds the recordings, runs every system (``args``: ``encdec bench whisper``'s), returns
    ``{"audio_s", "lengths_s", "columns", "rows", "ours_cpu_s"}``. ``run_ours_long_form``: our services' run
    (``encdec.bench.whisper.run_ours_long_form``, passed in so the two modules do not import each other)."""
    from decoder_svc.session.audio import decode_audio
    from encdec.bench.faster_whisper_anchor import run_anchor
    from shared.models.registry import resolve_model

    model_dir = str(resolve_model(args.model)[1])
    clips = [decode_audio(Path(f).read_bytes()) for f in clip_files]
    recordings = build_recordings(clips, clip_lengths(args.long_form_clips, args.long_form_max_s))
    audio_s = sum(len(r) for r in recordings) / SAMPLE_RATE
    print(f"[long-form] {len(recordings)} recordings, {audio_s:.0f} s of audio", file=sys.stderr, flush=True)
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="encdec-longform-") as tmp:
        import soundfile as sf

        files = []
        for i, pcm in enumerate(recordings):
            files.append(os.path.join(tmp, f"recording{i}.wav"))
            sf.write(files[-1], pcm, SAMPLE_RATE, subtype="PCM_16")

        def record(system: str, mode: str, result: dict) -> None:
            results[system, mode] = result
            print(f"[long-form] {system}, {mode}: {result['wall_s']:.1f} s", file=sys.stderr, flush=True)

        for mode in ("sequential", "batched") if len(files) > 1 else ("sequential",):  # a batch of 1 = sequential
            record(HF, mode, _run_hf(model_dir, args.threads, mode, files))
        if args.skip_ct2 or importlib.util.find_spec("faster_whisper") is None:
            print(
                "[long-form] no faster-whisper rows (--skip-ct2, or not installed: the [bench] extra)", file=sys.stderr
            )
        else:
            for system, mode in FW_MODES.items():
                record(FW, mode, run_anchor(system, model_dir, "float32", args.threads, "-", FW_BATCH_SIZE, files))
        ours = run_ours_long_form(args.model, files, clip_files[0], args.threads, args.address)
        record("encdec-serve fp32 (2 services, gRPC)", f"{len(files)} at once", ours)
    truth = results[HF, "sequential"]["texts"]
    fw = results.get((FW, FW_MODES["fw-sequential"]))
    rows = [
        {
            "system": system,
            "mode": mode,
            "clips": len(r["texts"]),
            "audio s": audio_s,
            "wall s": r["wall_s"],
            "x realtime": audio_s / r["wall_s"],
            "x faster-whisper": None if fw is None else fw["wall_s"] / r["wall_s"],
            "words": sum(len(normalize_text(t).split()) for t in r["texts"]),
            "WER vs HF": word_error_rate(truth, r["texts"]),
        }
        for (system, mode), r in results.items()
    ]
    lengths = [len(r) / SAMPLE_RATE for r in recordings]
    return {"audio_s": audio_s, "lengths_s": lengths, "columns": COLUMNS, "rows": rows, "ours_cpu_s": ours.get("cpu_s")}


def render(result: dict) -> str:
    """The table, then ours against the targets (reported, never enforced): x realtime at
    least 1.5x faster-whisper sequential's and 1.0x BatchedInferencePipeline's, WER vs HF no worse than theirs;
    and our services' CPU seconds (where the time went)."""
    from encdec.bench.table import format_number, markdown_table

    rows = {(r["system"], r["mode"]): r for r in result["rows"]}
    ours = next(r for r in result["rows"] if r["system"].startswith("encdec-serve"))
    lines = [markdown_table(result["rows"], result["columns"]), ""]
    for system, target in TARGETS.items():
        mode = FW_MODES[system]
        fw = rows.get((FW, mode))
        if fw is None:
            continue
        wer = [("-" if w is None else format_number(w)) for w in (ours["WER vs HF"], fw["WER vs HF"])]
        lines.append(
            f"ours vs faster-whisper {mode}: {format_number(fw['wall s'] / ours['wall s'])}x "
            f"(target >= {target}x), WER {wer[0]} vs {wer[1]}"
        )
    if result.get("ours_cpu_s"):
        cpu = result["ours_cpu_s"]
        lines.append(
            f"ours: encoder {cpu['encoder']:.1f} CPU-s, decoder {cpu['decoder']:.1f} CPU-s "
            f"in {ours['wall s']:.1f} s wall"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    _dir, _threads, _mode, *_files = sys.argv[1:]
    _mode, *_options = _mode.split(",")
    print(json.dumps(hf_long_form(_dir, int(_threads), _mode, _files, "detect" in _options, "segments" in _options)))
