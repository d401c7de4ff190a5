"""Voice activity detection for Whisper's ``vad_filter``: silero-vad speech regions and the time map back.

faster-whisper's ``vad_filter=True`` (``faster_whisper/vad.py`` and ``transcribe.py``): find speech with silero-vad,
transcribe only the speech regions concatenated, then map each segment time from the concatenated audio back to the
original audio (``SpeechTimestampsMap``). This module is that front and back end; the decoding in between is the
caller's. Option names and defaults are faster-whisper's ``VadOptions`` (which differ from silero-vad's own
defaults: 2 s of silence to close a region, 400 ms of padding, no minimum speech length).

The silero-vad model (the TorchScript ``silero_vad.jit`` shipped in the ``silero-vad`` wheel, CPU) is loaded once
per process and is stateful between its 512-sample windows, so every call holds one lock.
"""

from __future__ import annotations

import bisect
import math
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SAMPLE_RATE = 16000  # silero-vad and Whisper both take 16 kHz audio

_model = None
_model_lock = threading.Lock()


@dataclass(frozen=True)
class VadOptions:
    """Parameters of silero-vad's ``get_speech_timestamps``, with faster-whisper's ``VadOptions`` defaults.

    Attributes:
        threshold: speech probability (0, 1) at or above which a 32 ms window counts as speech.
        neg_threshold: probability below which a window inside speech counts as silence; None means silero's
            ``max(threshold - 0.15, 0.01)``. Must lie in [0, threshold].
        min_speech_duration_ms: regions this short or shorter (ms, >= 0) are dropped.
        max_speech_duration_s: longer regions (seconds, > 0, may be ``inf``) are split at their last silence of
            more than 98 ms, else cut hard.
        min_silence_duration_ms: silence (ms, >= 0) needed to close a region.
        speech_pad_ms: padding (ms, >= 0) added on each side of every region (halved between close regions).

    Raises:
        ValueError: a value out of its range.
    """

    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_duration_ms: int = 0
    max_speech_duration_s: float = float("inf")
    min_silence_duration_ms: int = 2000
    speech_pad_ms: int = 400

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"VAD threshold must be in (0, 1), got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 <= self.neg_threshold <= self.threshold:
            raise ValueError(f"VAD neg_threshold must be in [0, threshold={self.threshold}], got {self.neg_threshold}")
        if self.min_speech_duration_ms < 0:
            raise ValueError(f"VAD min_speech_duration_ms must be >= 0, got {self.min_speech_duration_ms}")
        if math.isnan(self.max_speech_duration_s) or self.max_speech_duration_s <= 0:
            raise ValueError(f"VAD max_speech_duration_s must be > 0 (or inf), got {self.max_speech_duration_s}")
        if self.min_silence_duration_ms < 0:
            raise ValueError(f"VAD min_silence_duration_ms must be >= 0, got {self.min_silence_duration_ms}")
        if self.speech_pad_ms < 0:
            raise ValueError(f"VAD speech_pad_ms must be >= 0, got {self.speech_pad_ms}")


def load_vad_model():
    """The process-wide silero-vad TorchScript model, loaded on the first call (call it at startup to warm up).

    Importing ``silero_vad`` calls ``torch.set_num_threads(1)`` (in ``silero_vad/model.py``); the caller's thread
    count is put back right after, so the rest of the process keeps its intra-op threads.
    """
    global _model
    with _model_lock:
        if _model is None:
            num_threads = torch.get_num_threads()
            try:
                with warnings.catch_warnings():
                    # importlib.resources.path and torch.jit.load deprecations, raised inside silero_vad
                    warnings.simplefilter("ignore", DeprecationWarning)
                    import silero_vad

                    _model = silero_vad.load_silero_vad(onnx=False)
            finally:
                torch.set_num_threads(num_threads)
        return _model


def speech_regions(pcm: np.ndarray, options: VadOptions | None = None, batched: bool = False) -> list[tuple[int, int]]:
    """Speech regions of a 16 kHz clip, from silero-vad's ``get_speech_timestamps``.

    Args:
        pcm: [N] float32 mono samples at 16 kHz, nominally in [-1, 1].
        options: VAD parameters; None means ``VadOptions()`` (faster-whisper's defaults).
        batched: take the probabilities from ``speech_probabilities`` (about 5x faster; a region edge may move by
            a 32 ms window) and silero's ``get_speech_timestamps_from_probs``; False runs silero's own loop, window
            after window, as faster-whisper does (``vad_filter``).

    Returns:
        ``(start, end)`` sample ranges, half-open, sorted, non-overlapping, within [0, N]; empty for silence.

    Raises:
        ValueError: ``pcm`` is not one-dimensional.
    """
    options = options or VadOptions()
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim != 1:
        raise ValueError(f"VAD input must be 1-D mono samples, got shape {pcm.shape}")
    if pcm.size == 0:
        return []
    from silero_vad import get_speech_timestamps
    from silero_vad.utils_vad import get_speech_timestamps_from_probs

    settings = dict(
        threshold=options.threshold,
        neg_threshold=options.neg_threshold,
        sampling_rate=SAMPLE_RATE,
        min_speech_duration_ms=options.min_speech_duration_ms,
        max_speech_duration_s=options.max_speech_duration_s,
        min_silence_duration_ms=options.min_silence_duration_ms,
        speech_pad_ms=options.speech_pad_ms,
        # faster-whisper's split at max_speech_duration_s: at the last silence, not silero 6's longest one
        use_max_poss_sil_at_max_speech=False,
    )
    if batched:
        found = get_speech_timestamps_from_probs(speech_probabilities(pcm), audio_length_samples=len(pcm), **settings)
    else:
        model = load_vad_model()
        audio = torch.from_numpy(np.ascontiguousarray(pcm))  # [N]
        with _model_lock:  # the model carries its recurrent state and context between windows
            found = get_speech_timestamps(audio, model, **settings)
    return [(int(region["start"]), int(region["end"])) for region in found]


WINDOW = 512  # samples per silero-vad step at 16 kHz (32 ms)
CHUNK_WINDOWS = 64  # windows per independently run stretch (2.05 s)
WARMUP_WINDOWS = 32  # windows of the audio before a stretch run first, their outputs dropped (1.02 s)
MAX_BATCH = 256  # stretches side by side (8.7 min of audio): each model call's cost is mostly per call


def speech_probabilities(pcm: np.ndarray) -> list[float]:
    """silero-vad's speech probability of every 512-sample window of ``pcm`` (the last one zero-padded), as
    ``get_speech_timestamps`` computes them, but batched: the clip is cut into stretches of ``CHUNK_WINDOWS``
    windows run side by side (``MAX_BATCH`` at a time, one recurrent state each; a row's numbers depend on how many
    run beside it only by float rounding, under 1e-4: tests/decoder/test_whisper_vad.py), each after the
    ``WARMUP_WINDOWS`` windows before it, whose outputs are dropped, so its state has heard what precedes it.
    One window at a time costs about as much as 20 side by side on the CPU; the warm-up's 0.5 s covers the
    model's memory for most windows, not all: a window's probability can differ from the sequential run's by
    a lot where the model hesitates (most by under 0.01), so a region's edge may move by a window.

    Args:
        pcm: [N] float32 mono samples at 16 kHz.

    Returns:
        ``ceil(N / 512)`` probabilities in [0, 1].

    Raises:
        ValueError: ``pcm`` is not one-dimensional.
    """
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim != 1:
        raise ValueError(f"VAD input must be 1-D mono samples, got shape {pcm.shape}")
    n = -(-pcm.size // WINDOW)
    if n == 0:
        return []
    windows = np.zeros((n, WINDOW), np.float32)
    windows.reshape(-1)[: pcm.size] = pcm
    steps = WARMUP_WINDOWS + CHUNK_WINDOWS
    # row 0 runs windows [0, steps) from the reset state, exactly as the sequential run; every later row runs
    # [start - WARMUP_WINDOWS, start + CHUNK_WINDOWS) and keeps its last CHUNK_WINDOWS outputs
    starts = [0, *range(steps, n, CHUNK_WINDOWS)]
    windows = np.concatenate([windows, np.zeros((steps, WINDOW), np.float32)])  # the last row's tail: silence
    probs = np.zeros(n, np.float32)
    model = load_vad_model()
    with _model_lock, torch.inference_mode():  # the model carries its recurrent state and context between windows
        for b in range(0, len(starts), MAX_BATCH):
            group = starts[b : b + MAX_BATCH]
            rows = [0 if start == 0 else start - WARMUP_WINDOWS for start in group]
            x = torch.from_numpy(np.stack([windows[r : r + steps] for r in rows]))  # [B, steps, 512]
            model.reset_states()
            out = np.stack([model(x[:, t], SAMPLE_RATE)[:, 0].numpy() for t in range(steps)], axis=1)  # [B, steps]
            for i, start in enumerate(group):
                keep = steps if start == 0 else CHUNK_WINDOWS
                count = min(keep, n - start)
                probs[start : start + count] = out[i, steps - keep : steps - keep + count]
    return probs.tolist()


# A speech region shorter than this does not count as speech when confirming silence (silero-vad's own default).
SILENCE_CHECK_MIN_SPEECH_MS = 250


def has_speech(pcm: np.ndarray) -> bool:
    """Whether silero-vad hears any speech region of ``SILENCE_CHECK_MIN_SPEECH_MS`` or more in ``pcm``.

    The decoder asks this of a window the model itself rates as probably silent (``no_speech_prob``
    over its threshold) before it keeps that window's text: Whisper says " you" or "Thank you." over
    digital silence and low noise with a confident average logprob, which HF's skip rule keeps.

    Runs the batched probabilities (``speech_regions(batched=True)``): silero's own window-after-window loop cost
    several times more per 30 s window, once per window the model rates silent (tiny.en rates most windows so;
    measured: docs/benchmarks.md); a region's edge may move by one 32 ms window, which a yes / no over regions
    of 250 ms or more does not notice.

    Args:
        pcm: ``[N]`` float32 mono samples at 16 kHz.
    """
    return bool(speech_regions(pcm, VadOptions(min_speech_duration_ms=SILENCE_CHECK_MIN_SPEECH_MS), batched=True))


class SpeechMap:
    """The speech regions of a clip concatenated, and the map from times in that audio back to the original.

    faster-whisper's ``SpeechTimestampsMap``: a time in the concatenated audio belongs to the region whose end (in
    concatenated samples) lies after it, or to the last region past the end; it is shifted by the silence removed
    before that region. A time exactly at a region boundary goes to the next region, unless ``is_end`` is set
    (a segment's end), which keeps it in the region it closes. Times are not rounded (faster-whisper rounds to
    0.01 s).

    Args:
        regions: ``(start, end)`` sample ranges from ``speech_regions``; may be empty (pure silence).
        num_samples: N, the length of the original clip in samples.
        sample_rate: samples per second of the clip.

    Raises:
        ValueError: regions empty-length, unsorted, overlapping, or outside [0, num_samples].
    """

    def __init__(self, regions: Sequence[tuple[int, int]], num_samples: int, sample_rate: int = SAMPLE_RATE):
        self.regions = [(int(start), int(end)) for start, end in regions]
        self.num_samples = int(num_samples)
        self.sample_rate = sample_rate
        self._speech_ends: list[int] = []  # end of each region in concatenated samples
        self._silence_before: list[int] = []  # samples removed before each region
        previous_end = 0
        removed = 0
        for start, end in self.regions:
            if not previous_end <= start < end <= self.num_samples:
                raise ValueError(
                    f"speech regions must be sorted, non-overlapping and within [0, {self.num_samples}], "
                    f"got {self.regions}"
                )
            removed += start - previous_end
            previous_end = end
            self._speech_ends.append(end - removed)
            self._silence_before.append(removed)

    @property
    def num_speech_samples(self) -> int:
        """Length of the concatenated speech audio in samples (0 for pure silence)."""
        return self._speech_ends[-1] if self._speech_ends else 0

    def speech_pcm(self, pcm: np.ndarray) -> np.ndarray:
        """The regions of ``pcm`` ([N] samples) concatenated: [num_speech_samples], same dtype; empty if none.

        Raises:
            ValueError: ``pcm`` is not 1-D with ``num_samples`` samples.
        """
        if pcm.ndim != 1 or pcm.shape[0] != self.num_samples:
            raise ValueError(f"expected [{self.num_samples}] samples, got shape {pcm.shape}")
        if not self.regions:
            return np.zeros(0, dtype=pcm.dtype)
        return np.concatenate([pcm[start:end] for start, end in self.regions])

    def region_index(self, t: float, is_end: bool = False) -> int:
        """Index of the region a time ``t`` (seconds in the concatenated audio) falls in.

        Raises:
            ValueError: there are no regions.
        """
        if not self._speech_ends:
            raise ValueError("no speech regions: nothing to map")
        sample = int(t * self.sample_rate)
        if is_end:
            index = bisect.bisect_left(self._speech_ends, sample)
            if index < len(self._speech_ends) and self._speech_ends[index] == sample:
                return index
        return min(bisect.bisect_right(self._speech_ends, sample), len(self._speech_ends) - 1)

    def original_time(self, t: float, is_end: bool = False, region: int | None = None) -> float:
        """Seconds in the concatenated speech audio -> seconds in the original clip.

        Args:
            t: time in the concatenated audio, seconds (>= 0).
            is_end: ``t`` ends a segment: a time on a region boundary stays in the region it closes.
            region: the region to map in (faster-whisper passes the one of a word's midpoint for both its ends);
                None finds it from ``t``.

        Raises:
            ValueError: there are no regions.
        """
        if region is None:
            region = self.region_index(t, is_end)
        return self._silence_before[region] / self.sample_rate + t
