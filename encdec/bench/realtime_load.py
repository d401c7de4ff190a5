"""``encdec bench realtime``'s workload and scores: recordings with known utterance ends, and stream latencies.

Plain numpy and Python, no services: the bench (``encdec.bench.realtime``) and its faster-whisper anchor
(``encdec.bench.realtime_fw``) build the same recordings and score their streams with the same functions.

**Recordings** (``Recording``): the bundled clips (``CLIP_TEXTS``) joined in a seeded random order with pauses of
``PAUSE_S`` seconds (longer than the server VAD's 500 ms, so each clip is an utterance), and where the quality
bench's corpus is at hand its ``pauses`` files (sentences with 0.3-5 s pauses), cut at the last sentence that
ends within the length asked for. Every recording knows the span of each utterance it holds (its speech,
without the clip's own leading and trailing silence: ``speech_span``) and that utterance's reference text.

**Scores** of one stream (``StreamRun``: its events with their receive times, and when each chunk was sent):

* final latency of an utterance: the arrival of the first final that covers its end (its ``end`` at least the
  utterance's end less ``COVER_TOL_S``, its ``start`` before that end) minus the wall time the chunk holding the
  utterance's last speech was sent; None when no final covers it (a miss).
* partial latency: at points every ``PARTIAL_EVERY_S`` of speech (from ``PARTIAL_SKIP_S`` into each
  utterance), the arrival of the first partial or final that covers the point (``end`` at least the point less
  ``COVER_TOL_S``) minus the send time of the point's chunk.
* lag: for every partial and final, its arrival minus the send time of the audio at its ``end``. A stream kept
  real time when the lag of its last quarter is at most ``LAG_GROWTH_S`` over that of its first quarter
  (medians) and its ``end`` came within ``END_WITHIN_S`` of the half-close; a server that falls behind shows a
  lag growing with the stream.
"""

from __future__ import annotations

import bisect
import re
import statistics
from dataclasses import dataclass, field

import numpy as np

SAMPLE_RATE = 16_000
CLIP_TEXTS = {  # the bundled clips' texts, as encdec/data/README.md lists them
    "sample.wav": "Good morning everyone. Today we will review the quarterly budget and decide which projects to fund.",
    "short.wav": "Please close the door behind you.",
    "meeting.wav": "Let us schedule the next meeting for Thursday at three o'clock.",
    "weather.wav": "The weather is sunny and warm, so we are going to the park this afternoon.",
    "numbers.wav": "My phone number is five five five, one two three four, and I live on Main Street.",
}
PAUSE_S = (1.0, 3.0)  # silence after each clip, drawn uniformly
LEAD_S = 0.5  # silence before the first clip
SILENCE_DB = -40.0  # 10 ms frames this far under the clip's loudest frame are silence (speech_span)
COVER_TOL_S = 0.3  # a text's end may fall this short of the audio position it covers (Whisper's word times)
PARTIAL_EVERY_S = 0.5
PARTIAL_SKIP_S = 0.5  # partial points start this far into an utterance (the first word needs some audio)
LAG_GROWTH_S = 1.0
END_WITHIN_S = 5.0
TARGETS = {"final_p50_s": 1.0, "final_p99_s": 2.0, "partial_p50_s": 1.5}  # issue 33's targets


@dataclass
class Recording:
    """One long recording fed to a stream.

    Attributes:
        name: ``clips-<i>`` or the corpus file's name. pcm: ``[N]`` float32 at 16 kHz.
        spans: ``(start_s, end_s)`` of each utterance's speech, in order. texts: each utterance's reference.
    """

    name: str
    pcm: np.ndarray
    spans: list[tuple[float, float]]
    texts: list[str]

    @property
    def seconds(self) -> float:
        return len(self.pcm) / SAMPLE_RATE

    @property
    def reference(self) -> str:
        return " ".join(self.texts)


def speech_span(pcm: np.ndarray, start: int = 0, end: int | None = None) -> tuple[float, float]:
    """``(start_s, end_s)`` of the speech in ``pcm[start:end]`` (seconds of ``pcm``): from the first to the last
    10 ms frame within ``SILENCE_DB`` of the loudest; the whole stretch when it is all silence."""
    end = len(pcm) if end is None else end
    frame = SAMPLE_RATE // 100
    n = (end - start) // frame
    if n == 0:
        return start / SAMPLE_RATE, end / SAMPLE_RATE
    frames = pcm[start : start + n * frame].reshape(n, frame).astype(np.float64)
    energy = (frames**2).mean(axis=1)  # [n]
    loud = np.nonzero(energy > energy.max() * 10 ** (SILENCE_DB / 10))[0]
    if energy.max() == 0 or len(loud) == 0:
        return start / SAMPLE_RATE, end / SAMPLE_RATE
    return float(start + loud[0] * frame) / SAMPLE_RATE, float(start + (loud[-1] + 1) * frame) / SAMPLE_RATE


def clip_recording(
    clips: dict[str, np.ndarray], seconds: float, seed: int, name: str = "clips", texts: dict[str, str] | None = None
) -> Recording:
    """The bundled clips (name -> ``[N]`` float32 16 kHz) in seeded random orders, round after round, each after
    a ``PAUSE_S`` pause (``LEAD_S`` before the first), until the next would pass ``seconds`` (at least one clip);
    1 s of silence closes it so the last utterance's end is heard. Same seed, same recording.

    Raises:
        ValueError: no clips, or a clip without a text in ``texts`` (default ``CLIP_TEXTS``).
    """
    texts = CLIP_TEXTS if texts is None else texts
    if not clips:
        raise ValueError("no clips to join")
    if missing := sorted(set(clips) - set(texts)):
        raise ValueError(f"no reference text for {missing}")
    rng = np.random.default_rng(seed)
    names = sorted(clips)
    parts = [np.zeros(int(LEAD_S * SAMPLE_RATE), np.float32)]
    total, spans, refs = len(parts[0]), [], []
    while True:
        for j in rng.permutation(len(names)):
            clip = clips[names[j]].astype(np.float32)
            if refs and total + len(clip) > seconds * SAMPLE_RATE:
                parts[-1] = np.zeros(SAMPLE_RATE, np.float32)  # the last pause: 1 s
                return Recording(name, np.concatenate(parts), spans, refs)
            s, e = speech_span(clip)
            spans.append((total / SAMPLE_RATE + s, total / SAMPLE_RATE + e))
            refs.append(texts[names[j]])
            pause = np.zeros(int(rng.uniform(*PAUSE_S) * SAMPLE_RATE), np.float32)
            parts += [clip, pause]
            total += len(clip) + len(pause)


def split_sentences(text: str) -> list[str]:
    """``text`` cut after each ``.``, ``!`` or ``?`` followed by a space."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def corpus_recording(name: str, pcm: np.ndarray, reference: str, sentences: list, seconds: float) -> Recording:
    """A quality-corpus file (``CorpusFile``'s reference and sentence spans) as a recording of at most
    ``seconds``: cut 1 s after the last sentence that ends by ``seconds - 1`` (at least one sentence). Each
    sentence's span is trimmed to its speech (``speech_span``).

    Raises:
        ValueError: the reference does not split into as many sentences as the file has spans.
    """
    texts = split_sentences(reference)
    if len(texts) != len(sentences):
        raise ValueError(f"{name}: {len(texts)} sentences in the reference, {len(sentences)} spans")
    keep = max(1, sum(1 for _, e in sentences if e <= seconds - 1.0))
    cut = min(len(pcm), int((sentences[keep - 1][1] + 1.0) * SAMPLE_RATE))
    spans = [speech_span(pcm, round(s * SAMPLE_RATE), round(e * SAMPLE_RATE)) for s, e in sentences[:keep]]
    return Recording(name, pcm[:cut].astype(np.float32), spans, texts[:keep])


def recordings(count: int, clips_dir: str, corpus: str, seconds: float, seed: int) -> tuple[list[Recording], list[str]]:
    """``count`` recordings of at most ``seconds``: the quality corpus's ``pauses`` files alternating with
    recordings joined from the clips in ``clips_dir`` (``clips-<i>``, seed ``seed + i``); and notes on what was
    left out. ``corpus``: ``auto`` (built or reused in the cache when espeak-ng and sox are on PATH), ``none``, or
    the corpus folder.

    Raises:
        RuntimeError / subprocess.CalledProcessError: building the corpus failed (``quality_corpus``).
    """
    import shutil
    from pathlib import Path

    from decoder_svc.session.audio import decode_audio

    paths = sorted(p for p in Path(clips_dir).glob("*.wav") if p.name in CLIP_TEXTS)
    clips = {p.name: decode_audio(p.read_bytes()) for p in paths}
    files, notes = [], []
    if corpus == "auto" and not (shutil.which("espeak-ng") and shutil.which("sox")):
        notes.append("no corpus recordings: espeak-ng and sox are not on PATH (the bundled clips only)")
    elif corpus != "none":
        import soundfile as sf

        from encdec.bench.quality_corpus import build_corpus, load_corpus

        root = build_corpus(None if corpus == "auto" else Path(corpus), subsets=["pauses"])
        for f in load_corpus(root, ["pauses"]):
            pcm = sf.read(str(root / f"{f.name}.wav"), dtype="float32")[0]
            files.append(corpus_recording(f.name, pcm, f.reference, f.sentences, seconds))
    out = []
    for i in range(count):
        use_corpus = i % 2 == 0 and i // 2 < len(files)
        out.append(files[i // 2] if use_corpus else clip_recording(clips, seconds, seed + i, f"clips-{i}"))
    return out, notes


# ---- one stream's run and its scores -------------------------------------------------------------------------
@dataclass
class StreamRun:
    """What one stream did, on one clock (seconds).

    Attributes:
        events: ``(kind, received, start, end, text)`` in arrival order (``encdec.realtime_client`` kinds).
        sent_audio_s, sent_wall: chunk ends (stream seconds) and when each was sent, ascending.
        closed: when the client half-closed. error: the call's error ("" if none).
    """

    events: list[tuple[str, float, float, float, str]] = field(default_factory=list)
    sent_audio_s: list[float] = field(default_factory=list)
    sent_wall: list[float] = field(default_factory=list)
    closed: float | None = None
    error: str = ""

    def sent_at(self, position_s: float) -> float | None:
        """When the chunk holding ``position_s`` was sent (None past the last chunk)."""
        i = bisect.bisect_left(self.sent_audio_s, position_s - 1e-6)
        return self.sent_wall[i] if i < len(self.sent_wall) else None

    def text(self) -> str:
        """The finals' text, joined."""
        return "".join(t for kind, _, _, _, t in self.events if kind == "final")


def _first_covering(events, kinds: tuple[str, ...], position_s: float, before_s: float | None = None):
    """Arrival time of the first event of ``kinds`` whose end reaches ``position_s - COVER_TOL_S`` (and whose
    start is before ``before_s`` when given); None if none."""
    for kind, received, start, end, _ in events:
        if kind in kinds and end >= position_s - COVER_TOL_S and (before_s is None or start < before_s):
            return received
    return None


def final_latencies(run: StreamRun, spans: list[tuple[float, float]]) -> list[float | None]:
    """Per utterance: seconds from sending its last speech to the first final covering it (None: none did)."""
    out = []
    for _, end in spans:
        sent, got = run.sent_at(end), _first_covering(run.events, ("final",), end, before_s=end)
        out.append(None if sent is None or got is None else got - sent)
    return out


def partial_points(spans: list[tuple[float, float]]) -> list[float]:
    """The stream positions partial latency is measured at: every ``PARTIAL_EVERY_S`` of each utterance's speech
    from ``PARTIAL_SKIP_S`` in."""
    return [float(t) for s, e in spans for t in np.arange(s + PARTIAL_SKIP_S, e, PARTIAL_EVERY_S)]


def partial_latencies(run: StreamRun, spans: list[tuple[float, float]]) -> list[float]:
    """Seconds from sending each of ``partial_points`` to the first partial or final covering it (points no
    text ever covered are left out: ``final_latencies`` counts the misses)."""
    out = []
    for point in partial_points(spans):
        sent, got = run.sent_at(point), _first_covering(run.events, ("partial", "final"), point)
        if sent is not None and got is not None:
            out.append(got - sent)
    return out


def lags(run: StreamRun) -> list[tuple[float, float]]:
    """``(end, lag)`` of every partial and final: its arrival minus the send time of the audio at its end."""
    out = []
    for kind, received, _, end, _ in run.events:
        sent = run.sent_at(end) if kind in ("partial", "final") else None
        if sent is not None:
            out.append((end, received - sent))
    return out


def kept_realtime(run: StreamRun) -> bool:
    """Whether the stream's lag stayed level (module docstring) and its ``end`` came soon after the half-close."""
    ends = [received for kind, received, *_ in run.events if kind == "end"]
    if run.error or not ends or run.closed is None or ends[0] - run.closed > END_WITHIN_S:
        return False
    points = sorted(lags(run))
    if len(points) < 4:
        return True
    quarter = len(points) // 4
    first = statistics.median(lag for _, lag in points[:quarter])
    last = statistics.median(lag for _, lag in points[-quarter:])
    return last - first <= LAG_GROWTH_S


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in [0, 100]); None when empty."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100 * (len(v) - 1)))))]


def meets_targets(row: dict) -> bool:
    """Whether a row's final p50 / p99 and partial p50 are within ``TARGETS`` (a missing value fails)."""
    values = (row.get("final p50 s"), row.get("final p99 s"), row.get("partial p50 s"))
    return all(v is not None and v <= t for v, t in zip(values, TARGETS.values()))
