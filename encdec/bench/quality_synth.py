"""Synthesis for the quality corpus (``encdec.bench.quality_corpus``): speech from espeak-ng + sox, noise, layouts.

Every sentence is spoken by ``espeak-ng -v VOICE -s SPEED`` (words per minute) and resampled to 16 kHz mono
16-bit by ``sox -G -D`` (gain just under clipping, no dither: the same bytes each time, as tests/data/speech),
then trimmed of espeak-ng's own leading and trailing silence. Pauses, silence gaps and noise are numpy arrays
drawn from the builder's seeded generator. All audio here is ``[N]`` float32 at ``SAMPLE_RATE``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np

from encdec.bench.quality_sentences import SENTENCES

SAMPLE_RATE = 16_000
BROWN_POLE = 0.995  # leaky integrator of the brown noise: 1/f^2 above ~12 Hz at 16 kHz
FAINT_FLOOR_DB = 45  # the faint-noise gap: brown noise this far under the speech power
NOISE_ONLY_DB = 20  # noise-only stretches: this far under the speech power
GAP_NOISE = {  # a gap's kind -> (noise, dB under the speech)
    "faint-noise": ("brown", FAINT_FLOOR_DB),
    "white-noise": ("white", NOISE_ONLY_DB),
    "brown-noise": ("brown", NOISE_ONLY_DB),
}


def speak(text: str, voice: str, speed: int, tmp: Path) -> np.ndarray:
    """``text`` spoken by espeak-ng in ``voice`` at ``speed`` words per minute, resampled by sox, trimmed.

    Raises:
        subprocess.CalledProcessError: espeak-ng or sox failed. RuntimeError: sox wrote another rate.
    """
    import soundfile as sf

    raw, out = tmp / "raw.wav", tmp / "out.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(raw), text], check=True, capture_output=True)
    resample = ["sox", "-G", "-D", str(raw), "-r", str(SAMPLE_RATE), "-c", "1", "-b", "16", str(out)]
    subprocess.run(resample, check=True, capture_output=True)
    pcm, rate = sf.read(str(out), dtype="float32")
    if rate != SAMPLE_RATE:
        raise RuntimeError(f"sox wrote {rate} Hz, expected {SAMPLE_RATE}")
    return trim(pcm)


def trim(pcm: np.ndarray, floor: float = 1e-3) -> np.ndarray:
    """``pcm`` without the samples under ``floor`` at either end: espeak-ng pads each utterance with silence,
    cut so that the pauses between sentences are exactly the drawn ones."""
    loud = np.flatnonzero(np.abs(pcm) > floor)
    return pcm[loud[0] : loud[-1] + 1] if len(loud) else pcm


def power(pcm: np.ndarray) -> float:
    """Mean square of ``pcm`` (float64 accumulation); 0 for an empty array."""
    return float(np.mean(pcm.astype(np.float64) ** 2)) if len(pcm) else 0.0


def noise(kind: str, n: int, rng: np.random.Generator, babble: np.ndarray | None = None) -> np.ndarray:
    """``[n]`` float32 noise of unit power: ``white`` (Gaussian), ``brown`` (white through a leaky integrator
    with pole ``BROWN_POLE``, DC removed) or ``babble`` (``babble`` looped from a random offset).

    Raises:
        ValueError: an unknown ``kind``, or ``babble`` without its recording.
    """
    if kind == "white":
        x = rng.standard_normal(n)
    elif kind == "brown":
        w = rng.standard_normal(n)
        x = np.empty(n)
        acc = 0.0
        for i, v in enumerate(w.tolist()):  # y[i] = pole * y[i-1] + w[i]; a plain loop: ~1 s per minute of audio
            acc = BROWN_POLE * acc + v
            x[i] = acc
        x -= x.mean()
    elif kind == "babble":
        if babble is None or not len(babble):
            raise ValueError("babble noise needs the babble recording")
        start = int(rng.integers(len(babble)))
        x = np.resize(np.roll(babble, -start), n).astype(np.float64)
    else:
        raise ValueError(f"unknown noise {kind!r}")
    p = power(x)
    return (x / np.sqrt(p) if p > 0 else x).astype(np.float32)


class Speaker:
    """Speaks sentences, cached per ``(voice, speed, text)``; shared by every subset of one build."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.spoken: dict[tuple[str, int, str], np.ndarray] = {}
        self._babble: np.ndarray | None = None

    def __call__(self, text: str, voice: str, speed: int) -> np.ndarray:
        key = (voice, speed, text)
        if key not in self.spoken:
            self.spoken[key] = speak(text, voice, speed, self.tmp)
        return self.spoken[key]

    def babble(self, voices) -> np.ndarray:
        """Six ``voices`` (``(voice, speed)``) reading six English sentences each at once, each at the same
        power: a crowd. Fixed sentences, no random draw, so it is the same whichever subset asks first."""
        if self._babble is None:
            tracks = []
            for k, (voice, speed) in enumerate(voices[:6]):
                texts = [SENTENCES["en"][(7 * k + j) % len(SENTENCES["en"])] for j in range(6)]
                track = np.concatenate([self(t, voice, speed) for t in texts])
                tracks.append(track / np.sqrt(power(track)))
            n = min(len(t) for t in tracks)
            self._babble = np.sum([t[:n] for t in tracks], axis=0).astype(np.float32)
        return self._babble


class Layout:
    """Lays the recordings of one subset out, drawing from its own generator (``rng``)."""

    def __init__(self, speaker: Speaker, rng: np.random.Generator) -> None:
        self.speak, self.rng = speaker, rng

    def pool(self, language: str) -> list[str]:
        """``SENTENCES[language]`` in a fresh random order: one recording's draw without replacement (popped)."""
        return [SENTENCES[language][i] for i in self.rng.permutation(len(SENTENCES[language]))]

    def reading(self, language, voice, speed, pause_s, count=None, target_s=None, pool=None):
        """Sentences with pauses drawn uniformly from ``pause_s`` (seconds) between them: ``count`` sentences,
        or until the audio reaches ``target_s`` (the last sentence passes it). The sentences are popped from
        ``pool`` (default: a fresh ``self.pool(language)``), so a recording never repeats one.

        Returns:
            ``(pcm, texts, spans)``: ``[N]`` float32, the sentences, ``[start_s, end_s]`` of each.

        Raises:
            ValueError: the language has fewer sentences than the recording needs.
        """
        pool = self.pool(language) if pool is None else pool
        parts, texts, spans, t = [], [], [], 0
        while (count is not None and len(texts) < count) or (target_s is not None and t < target_s * SAMPLE_RATE):
            if not pool:
                raise ValueError(f"{len(texts)} {language} sentences are not enough for this recording")
            if texts:
                pause = np.zeros(int(self.rng.uniform(*pause_s) * SAMPLE_RATE), np.float32)
                parts.append(pause)
                t += len(pause)
            text = pool.pop()
            pcm = self.speak(text, voice, speed)
            spans.append([t / SAMPLE_RATE, (t + len(pcm)) / SAMPLE_RATE])
            parts.append(pcm)
            texts.append(text)
            t += len(pcm)
        return np.concatenate(parts), texts, spans

    def with_gaps(self, pieces: list, language: str, voice: str, speed: int):
        """Readings ``("speech", target_s)`` and stretches ``("gap", seconds, kind)``, in order.

        A gap's kind is ``silence`` (zeros) or a key of ``GAP_NOISE``: ``faint-noise`` (brown noise
        ``FAINT_FLOOR_DB`` under the power of the file's speech), ``white-noise`` / ``brown-noise``
        (``NOISE_ONLY_DB`` under it). Readings end on a sentence, so each gap starts and ends at speech.

        Returns:
            ``(pcm, texts, spans, gaps)``; ``gaps``: ``[start_s, end_s, kind]`` of each stretch.
        """
        pool = self.pool(language)  # one draw for the whole file: its readings never share a sentence
        readings = [
            self.reading(language, voice, speed, (0.4, 1.5), target_s=p[1], pool=pool)
            for p in pieces
            if p[0] == "speech"
        ]
        speech_power = power(np.concatenate([r[0] for r in readings]))
        parts, texts, spans, gaps, t = [], [], [], [], 0
        it = iter(readings)
        for piece in pieces:
            if piece[0] == "speech":
                pcm, ts, sp = next(it)
                spans += [[s + t / SAMPLE_RATE, e + t / SAMPLE_RATE] for s, e in sp]
                texts += ts
            else:
                n, kind = int(piece[1] * SAMPLE_RATE), piece[2]
                if kind == "silence":
                    pcm = np.zeros(n, np.float32)
                else:
                    color, db = GAP_NOISE[kind]
                    pcm = noise(color, n, self.rng) * np.float32(np.sqrt(speech_power / 10 ** (db / 10)))
                gaps.append([t / SAMPLE_RATE, (t + n) / SAMPLE_RATE, kind])
            parts.append(pcm)
            t += len(pcm)
        return np.concatenate(parts), texts, spans, gaps
