"""Turn detection for realtime streams: silero-vad window by window, every live stream's windows in one batch.

silero-vad (the TorchScript model ``decoder_svc.whisper.vad.load_vad_model`` loads) is recurrent: each 512-sample
window's speech probability depends on a state carried from the previous window (``_state`` [2, B, 128] and
``_context`` [B, 64] inside the module). Each stream keeps its own state here (``StreamVad``), and
``VadBatcher`` runs the windows of every stream that has some pending as one batch per time step, setting the
module's state to the rows' states stacked and reading them back after: one window of 8 streams costs about what
one window of one stream does on a CPU.

The turn rules are silero's ``VADIterator`` with the OpenAI Realtime ``server_vad`` options: speech starts at the
first window whose probability reaches ``threshold``; it stops once the probability stayed under ``threshold -
0.15`` (silero's ``neg_threshold``) for ``silence_duration_ms``, at the first of those windows; the utterance's
audio starts ``prefix_padding_ms`` before its speech.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import torch

from decoder_svc.whisper import vad

WINDOW = vad.WINDOW  # 512 samples = 32 ms at 16 kHz
SAMPLE_RATE = vad.SAMPLE_RATE
PAUSE_MS = 200  # silence inside speech reported as a pause (the realtime session decodes its utterance at once)
NEG_THRESHOLD_GAP = 0.15  # silero VADIterator / get_speech_timestamps: neg_threshold = threshold - 0.15


@dataclass(frozen=True)
class TurnOptions:
    """OpenAI Realtime ``server_vad`` turn detection options (their defaults).

    Attributes:
        threshold: speech probability in (0, 1) at which speech starts.
        silence_duration_ms: silence that ends an utterance, ms (>= 32, one window).
        prefix_padding_ms: audio before the detected start kept in the utterance, ms (>= 0).

    Raises:
        ValueError: a value outside those ranges.
    """

    threshold: float = 0.5
    silence_duration_ms: int = 500
    prefix_padding_ms: int = 300

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"vad threshold must be in (0, 1), got {self.threshold}")
        if not 32 <= self.silence_duration_ms <= 10_000:
            raise ValueError(f"vad silence_duration_ms must be in [32, 10000], got {self.silence_duration_ms}")
        if not 0 <= self.prefix_padding_ms <= 5_000:
            raise ValueError(f"vad prefix_padding_ms must be in [0, 5000], got {self.prefix_padding_ms}")


@dataclass(frozen=True)
class Turn:
    """A speech boundary: ``kind`` "start", "pause" (``PAUSE_MS`` of silence inside speech: it may be ending) or
    "stop" at ``sample`` (stream samples, 16 kHz; a pause's and a stop's: where the silence starts), found once the
    VAD had heard up to ``heard_at``."""

    kind: str
    sample: int
    heard_at: int


class StreamVad:
    """One stream's VAD state and turn rules; ``windows`` takes its new samples, ``turns`` their probabilities."""

    def __init__(self, options: TurnOptions) -> None:
        self.options = options
        self.state = torch.zeros(2, 1, 128)
        self.context = torch.zeros(1, 64)
        self._pending = np.zeros(0, np.float32)
        self.position = 0  # stream samples consumed into windows
        self.speaking = False
        self.silence_from: int | None = None  # first window of the silence inside speech, while it lasts
        self._paused = False  # that silence was reported as a pause

    def windows(self, pcm: np.ndarray) -> np.ndarray:
        """``[k, 512]`` float32: the whole windows ``pcm`` completes (the rest waits for more)."""
        data = np.concatenate([self._pending, pcm]) if self._pending.size else pcm
        k = data.size // WINDOW
        self._pending = data[k * WINDOW :].copy()
        return data[: k * WINDOW].reshape(k, WINDOW)

    def turns(self, probabilities: list[float]) -> list[Turn]:
        """The boundaries the windows just run (in order) cross."""
        opts, found = self.options, []
        silence_samples = opts.silence_duration_ms * SAMPLE_RATE // 1000
        pause_samples = min(PAUSE_MS, opts.silence_duration_ms) * SAMPLE_RATE // 1000
        for p in probabilities:
            start = self.position
            self.position += WINDOW
            if p >= opts.threshold:
                self.silence_from = None
                if not self.speaking:
                    self.speaking = True
                    found.append(Turn("start", start, self.position))
            elif self.speaking and p < opts.threshold - NEG_THRESHOLD_GAP:
                if self.silence_from is None:
                    self.silence_from, self._paused = start, False
                silent = self.position - self.silence_from
                if silent >= silence_samples:
                    found.append(Turn("stop", self.silence_from, self.position))
                    self.speaking, self.silence_from = False, None
                elif silent >= pause_samples and not self._paused:
                    found.append(Turn("pause", self.silence_from, self.position))
                    self._paused = True
        return found


def run_batch(items: list[tuple[StreamVad, np.ndarray]]) -> list[list[float]]:
    """Each item's windows' probabilities, the items' t-th windows run as one batch (module docstring).
    Runs on a worker thread; holds the model's lock (the file VAD shares the module)."""
    results: list[list[float]] = [[] for _ in items]
    steps = max((len(w) for _, w in items), default=0)
    model = vad.load_vad_model()
    with vad._model_lock, torch.inference_mode():
        for t in range(steps):
            rows = [i for i, (_, w) in enumerate(items) if len(w) > t]
            model._state = torch.cat([items[i][0].state for i in rows], dim=1)
            model._context = torch.cat([items[i][0].context for i in rows], dim=0)
            model._last_batch_size, model._last_sr = len(rows), SAMPLE_RATE
            x = torch.from_numpy(np.stack([items[i][1][t] for i in rows]))  # [B, 512]
            probs = model(x, SAMPLE_RATE)[:, 0].tolist()
            states, contexts = model._state.split(1, dim=1), model._context.split(1, dim=0)
            for j, i in enumerate(rows):
                items[i][0].state, items[i][0].context = states[j].clone(), contexts[j].clone()
                results[i].append(probs[j])
        model.reset_states()  # the file VAD's next call starts clean (it resets too)
    return results


class VadBatcher:
    """The replica's realtime VAD: ``probabilities`` calls that wait together run as one ``run_batch``."""

    def __init__(self) -> None:
        self._waiting: list[tuple[StreamVad, np.ndarray, asyncio.Future]] = []
        self._task: asyncio.Task | None = None

    async def probabilities(self, stream: StreamVad, windows: np.ndarray) -> list[float]:
        """Speech probabilities of ``windows`` ([k, 512]) after ``stream``'s state (which moves on)."""
        if not len(windows):
            return []
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((stream, windows, future))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting, []
            try:
                results = await asyncio.to_thread(run_batch, [(s, w) for s, w, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every waiting stream gets the error
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, _, future), probs in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(probs)
