"""The anchor of ``encdec bench realtime``: faster-whisper driving LocalAgreement-2, N streams in one process.

ufal/whisper_streaming's ``OnlineASRProcessor`` (Machacek et al., 2023) with faster-whisper as its ASR, on one
``WhisperModel`` (CPU, float32, ``THREADS`` threads) shared by every stream, as a server without batching would
run it. Each stream's audio "arrives" at 1x real time from its start (``i x STAGGER_S`` after the first), in
100 ms chunks. Every ``STEP_S`` a stream's step runs: one ``model.transcribe`` of its buffer (greedy, temperature
0, word timestamps, the committed text before the buffer as ``initial_prompt``, its last 200 characters), its
words fed to the same ``LocalAgreement`` the decoder uses (``decoder_svc.realtime.agreement``); newly agreed words
are one final, the rest the partial. Steps run one at a time, the most overdue first: a stream the model cannot
keep up with gets fewer, longer steps and its lag grows. The buffer is trimmed as whisper_streaming's "segment"
policy does once it passes ``TRIM_S``: at the end of the last completed segment before the last final word, and
never kept past ``MAX_BUFFER_S``. When a stream's audio is all in, its pending words become final and it ends.

Usage: ``python -m encdec.bench.realtime_fw MODEL_DIR THREADS STEP_S STAGGER_S WAV...`` (one WAV per stream);
prints one JSON line: ``{"streams": [{"events", "sent_audio_s", "sent_wall", "closed"}]}``, the fields of
``realtime_load.StreamRun``, times in seconds on this process's clock.
"""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np

SAMPLE_RATE = 16_000
CHUNK_S = 0.1
TRIM_S = 15.0  # whisper_streaming's --buffer_trimming_sec default
MAX_BUFFER_S = 28.0  # under Whisper's 30 s window
PROMPT_CHARS = 200  # whisper_streaming's prompt length


class Stream:
    """One stream's buffer and agreement; ``t0``: when its audio starts arriving (``perf_counter``)."""

    def __init__(self, pcm: np.ndarray, t0: float) -> None:
        from decoder_svc.realtime.agreement import LocalAgreement

        self.pcm, self.t0 = pcm, t0
        self.seconds = len(pcm) / SAMPLE_RATE
        self.agreement = LocalAgreement()
        self.buffer_start = 0.0  # stream seconds
        self.events: list[tuple] = []
        self.done = False

    def available(self, now: float) -> float:
        """Stream seconds received by ``now``: whole chunks only."""
        return min(self.seconds, int(max(0.0, now - self.t0) / CHUNK_S + 1e-9) * CHUNK_S)

    def _prompt(self) -> str | None:
        text = "".join(w.text for w in self.agreement.final if w.end <= self.buffer_start)
        return text[-PROMPT_CHARS:] or None

    def step(self, model, now: float) -> None:
        """Re-decodes the buffer up to what has arrived; records the final and partial it yields."""
        from decoder_svc.realtime.agreement import TimedWord

        end = self.available(now)
        audio = self.pcm[int(self.buffer_start * SAMPLE_RATE) : int(end * SAMPLE_RATE)]
        offset = self.buffer_start
        words, segment_ends = [], []
        if len(audio) >= SAMPLE_RATE // 10:
            segments, _ = model.transcribe(
                audio,
                language="en",
                initial_prompt=self._prompt(),
                beam_size=1,
                temperature=0.0,
                word_timestamps=True,
                condition_on_previous_text=True,
                vad_filter=False,
            )
            for seg in segments:
                segment_ends.append(offset + seg.end)
                words += [TimedWord(w.word, offset + w.start, offset + w.end, w.probability) for w in seg.words or ()]
        last = end >= self.seconds
        final = self.agreement.insert(words)
        if last:
            final = final + self.agreement.flush()
        received = time.perf_counter()
        if final:
            self.events.append(("final", received, final[0].start, final[-1].end, "".join(w.text for w in final)))
        pending = self.agreement.pending
        if pending:
            text = "".join(w.text for w in pending)
            self.events.append(("partial", received, pending[0].start, pending[-1].end, text))
        if last:
            self.events.append(("end", received, 0.0, 0.0, ""))
            self.done = True
            return
        self._trim(segment_ends, end)

    def _trim(self, segment_ends: list[float], end: float) -> None:
        """whisper_streaming's ``chunk_completed_segment``: past ``TRIM_S``, cut at the end of the last segment
        but one that ends by the last final word; never keep more than ``MAX_BUFFER_S``."""
        if end - self.buffer_start > TRIM_S and self.agreement.final:
            committed = self.agreement.final_end
            ends = [e for e in segment_ends[:-1] if e <= committed]
            if ends:
                self.buffer_start = max(self.buffer_start, ends[-1])
        if end - self.buffer_start > MAX_BUFFER_S:
            self.buffer_start = max(self.agreement.final_end, end - MAX_BUFFER_S)

    def result(self) -> dict:
        """The ``StreamRun`` fields (chunks are "sent" as they arrive, at 1x real time)."""
        n = math.ceil(self.seconds / CHUNK_S - 1e-9)
        sent = [min(self.seconds, (i + 1) * CHUNK_S) for i in range(n)]
        return {
            "events": self.events,
            "sent_audio_s": sent,
            "sent_wall": [self.t0 + s for s in sent],
            "closed": self.t0 + self.seconds,
        }


def run(model_dir: str, threads: int, step_s: float, stagger_s: float, files: list[str]) -> dict:
    """Every file as a stream, at once (see the module docstring); ``{"streams": [...]}`` in file order."""
    import soundfile as sf
    from faster_whisper import WhisperModel

    model = WhisperModel(model_dir, device="cpu", compute_type="float32", cpu_threads=threads)
    pcms = [sf.read(f, dtype="float32")[0] for f in files]
    list(model.transcribe(pcms[0][: 2 * SAMPLE_RATE], language="en", beam_size=1, word_timestamps=True)[0])  # warm-up
    start = time.perf_counter() + 0.5
    streams = [Stream(pcm, start + i * stagger_s) for i, pcm in enumerate(pcms)]
    due = [s.t0 + step_s for s in streams]
    while not all(s.done for s in streams):
        i = min((j for j, s in enumerate(streams) if not s.done), key=lambda j: due[j])
        wait = due[i] - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        begun = time.perf_counter()
        streams[i].step(model, begun)
        due[i] = begun + step_s
    return {"streams": [s.result() for s in streams]}


def run_anchor(model_dir: str, threads: int, step_s: float, stagger_s: float, files: list[str]) -> dict:
    """``run`` in a subprocess (CTranslate2's OpenMP runtime apart from torch's, as ``faster_whisper_anchor``).

    Raises:
        subprocess.CalledProcessError: the worker failed (its stderr is in the exception).
    """
    import subprocess

    cmd = [sys.executable, "-m", "encdec.bench.realtime_fw", model_dir, str(threads), str(step_s), str(stagger_s)]
    out = subprocess.run([*cmd, *files], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_streams(recs, ns: list[int], model: str, threads: int, step_s: float, stagger_s: float) -> dict[int, list]:
    """The anchor at every N of ``ns`` (a process each; stream i fed ``recs[i mod R]``, ``realtime_load``
    recordings): ``{n: [StreamRun, ...]}``.

    Raises:
        subprocess.CalledProcessError: a worker failed.
    """
    import tempfile
    from pathlib import Path

    import soundfile as sf

    from encdec.bench.realtime_load import StreamRun
    from shared.models.registry import resolve_model

    model_dir = str(resolve_model(model)[1])
    out = {}
    with tempfile.TemporaryDirectory(prefix="encdec-realtime-") as tmp:
        paths = []
        for i, rec in enumerate(recs):
            paths.append(str(Path(tmp) / f"{i}.wav"))
            sf.write(paths[-1], rec.pcm, SAMPLE_RATE, subtype="PCM_16")
        for n in ns:
            print(f"[realtime] faster-whisper: {n} stream(s)", file=sys.stderr, flush=True)
            result = run_anchor(model_dir, threads, step_s, stagger_s, [paths[i % len(paths)] for i in range(n)])
            out[n] = [StreamRun(**s) for s in result["streams"]]
    return out


if __name__ == "__main__":
    _dir, _threads, _step, _stagger, *_files = sys.argv[1:]
    print(json.dumps(run(_dir, int(_threads), float(_step), float(_stagger), _files)))
