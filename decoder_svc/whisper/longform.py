"""Whisper long-form transcription of one request as a state machine the decoder service drives.

HF transformers' ``WhisperGenerationMixin.generate`` long-form loop (``models/whisper/generation_whisper.py``),
batch size 1, without the model calls: the caller decodes each ``WindowPlan`` and reports the result.

1. ``next_window()``: the window at ``seek`` (mel frames, 10 ms): ``min(total_frames - seek, 3000)`` frames,
   and its decoder prompt (``_prepare_decoder_input_ids``):
   * conditioned on previous text: ``<|startofprev|>`` + the last 223 (``max_target_positions // 2 - 1``)
     ids of all segments so far (timestamps included; of a segment closing on two timestamps the second
     is left out), with the initial prompt as the first "segment" ("first-segment"), or ``<|startofprev|>``
     + the whole initial prompt in front of that cut ("all-segments"); then ``<|startoftranscript|>`` ...
   * not conditioned (option off, nothing decoded yet, or the previous window was accepted at a
     temperature >= 0.5): ``<|startofprev|>`` + the whole initial prompt if there is one, then the rest.
2. ``on_result(...)``: ``quality.judge``; RETRY re-plans the same window at the next temperature with the
   same prompt, SKIP moves ``seek`` past the window, ACCEPT adds ``segments.split_window``'s segments and
   moves ``seek`` by its advance. Done when ``seek >= total_frames``.

``total_frames`` is ``num_samples // 160``, the frame count of HF's ``WhisperFeatureExtractor`` on the
unpadded audio (``truncation=False``). Audio of at most 30 s is one window of that length; HF instead
pads short audio's features to 3000 frames, which changes only the end time of a segment without
timestamps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from decoder_svc.whisper.quality import FallbackRules, Judgement, Verdict, best_attempt, judge
from decoder_svc.whisper.segments import HOP_LENGTH, N_FRAMES, Segment, split_window, time_offset
from shared.models.whisper_specials import WhisperSpecials

PROMPT_CONDITION_TYPES = ("first-segment", "all-segments")  # HF prompt_condition_type
LOW_TEMPERATURE = 0.5  # HF: the next window is conditioned only after an attempt at temperature < 0.5


@dataclass(frozen=True)
class LongFormOptions:
    """One request's long-form options (HF ``generate`` argument names in brackets).

    Attributes:
        language: ISO code for multilingual checkpoints; ignored by English-only ones.
        task: ``"transcribe"`` / ``"translate"``.
        timestamps: must be True: long-form decoding cuts windows at predicted timestamps.
        condition_on_previous_text: prompt each window with the previous text (condition_on_prev_tokens).
        initial_prompt_ids: text ids of an initial prompt, without ``<|startofprev|>`` (prompt_ids[1:]).
        prompt_condition_type: ``"first-segment"`` (the prompt counts as the first segment of the
            previous text, so it drops out of the 223-id cut as text accumulates) or ``"all-segments"``
            (every window is prompted with it whole; needs condition_on_previous_text).
        rules: temperatures and thresholds.
        max_new_tokens: cap per window; None = up to ``max_target_positions`` ids with the prompt
            (HF's ``max_length`` 448).

    Raises:
        ValueError: timestamps False, an unknown prompt_condition_type, "all-segments" without
            conditioning, or max_new_tokens < 1.
    """

    language: str | None = "en"
    task: str = "transcribe"
    timestamps: bool = True
    condition_on_previous_text: bool = True
    initial_prompt_ids: tuple[int, ...] = ()
    prompt_condition_type: str = "first-segment"
    rules: FallbackRules = field(default_factory=FallbackRules)
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.timestamps:
            raise ValueError("long-form decoding needs timestamps=True")
        if self.prompt_condition_type not in PROMPT_CONDITION_TYPES:
            raise ValueError(f"prompt_condition_type must be one of {PROMPT_CONDITION_TYPES}")
        if self.prompt_condition_type == "all-segments" and not self.condition_on_previous_text:
            raise ValueError("prompt_condition_type='all-segments' needs condition_on_previous_text=True")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class WindowPlan:
    """One decode the engine runs: a window of audio, a prompt, a temperature.

    Attributes:
        seek: first mel frame (10 ms) of the window. num_frames: its length in frames (<= 3000).
        start_sample: ``seek * 160``. num_samples: the PCM samples to decode (<= 480000 at 16 kHz),
            ``[start_sample, start_sample + num_samples)``, padded to 30 s by the feature extractor.
            The last window takes every remaining sample (up to 159 past its last whole frame).
            HF slices the full audio's features instead (``input_features[:, seek:seek + num_frames]``,
            zero-padded to 3000), which a caller that has them can do with ``seek`` / ``num_frames``.
            The two differ most in a short last window: zeros in the log-mel are not the log-mel of
            silent audio (on the test clip the last segment then ends at 68.64 s in HF, 64.88 s
            from PCM, the audio ending at 66.84 s; every other segment is the same).
        prompt_ids: the whole decoder prompt; the first generated token is at ``len(prompt_ids)``
            (the timestamp rules' ``begin_index``).
        temperature: 0.0 = greedy, else sample at it. attempt: index into ``rules.temperatures``.
        max_new_tokens: tokens the engine may generate after the prompt.
        sot_index: position of ``<|startoftranscript|>`` in the prompt, whose logits give
            ``no_speech_prob``. It is ``len(prompt_ids) - 1`` for English-only checkpoints (HF reads
            the first step's scores there; for multilingual ones it re-runs the decoder to read it).
    """

    seek: int
    num_frames: int
    start_sample: int
    num_samples: int
    prompt_ids: tuple[int, ...]
    temperature: float
    attempt: int
    max_new_tokens: int
    sot_index: int

    @property
    def time_offset(self) -> float:
        """Seconds of the window start (float64, HF's ``time_offset``)."""
        return time_offset(self.seek)


@dataclass(frozen=True)
class WindowResult:
    """What one ``on_result`` decided.

    Attributes:
        plan: the attempt it answers. judgement: verdict and quality numbers (``quality.Judgement``)
            of the attempt taken (an earlier one when ``rules.keep_best_attempt`` picked it).
        segments: the window's new segments (ACCEPT only; quality fields filled).
        seek_advance: mel frames ``seek`` moved by (0 on RETRY).
        generated, token_logprobs: the ids and logprobs of the attempt taken (its segments' source).
    """

    plan: WindowPlan
    judgement: Judgement
    segments: list[Segment]
    seek_advance: int
    generated: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        return self.judgement.verdict


class LongFormState:
    """The per-request long-form loop (see the module docstring).

    Args:
        specials: the checkpoint's special ids (prompt layout, timestamps, ``max_target_positions``).
        num_samples: the request's audio length, 16 kHz samples.
        options: see ``LongFormOptions``.

    Raises:
        ValueError: negative ``num_samples``; a prompt that leaves no room to generate;
            ``WhisperLanguageError`` (a ValueError) for a language or task the checkpoint lacks.
    """

    def __init__(self, specials: WhisperSpecials, num_samples: int, options: LongFormOptions) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.specials = specials
        self.options = options
        self.num_samples = num_samples
        self.total_frames = num_samples // HOP_LENGTH
        self.seek = 0
        self.segments: list[Segment] = []  # accepted so far, in order
        self.results: list[WindowResult] = []  # every attempt, in order
        self._init_tokens = specials.decoder_prompt(options.language, options.task, timestamps=True)
        prompt = list(options.initial_prompt_ids)
        if prompt and prompt[0] == specials.sot_prev:  # HF strips it from the prompt segment
            prompt = prompt[1:]
        self._prompt = prompt
        self._condition = options.condition_on_previous_text  # HF do_condition_on_prev_tokens
        self._attempt = 0
        self._tries: list[tuple[list[int], list[float], Judgement]] = []  # the pending window's attempts so far
        self._pending: WindowPlan | None = None
        keep, init = specials.max_target_positions // 2 - 1, len(self._init_tokens)
        if options.prompt_condition_type == "all-segments":
            longest = 1 + len(prompt) + keep + init
        else:
            longest = max(1 + len(prompt), 1 + keep) + init
        if longest >= specials.max_target_positions:
            raise ValueError(f"a prompt of up to {longest} ids leaves no room in {specials.max_target_positions}")

    @property
    def done(self) -> bool:
        return self.seek >= self.total_frames

    @property
    def tokens(self) -> list[int]:
        """Every accepted segment's ids in order (HF's returned ``sequences`` row)."""
        return [t for s in self.segments for t in s.tokens]

    def _previous(self) -> list[int]:
        history = [self._prompt] if self._prompt and self.options.prompt_condition_type == "first-segment" else []
        history += [s.tokens for s in self.segments]
        ts_begin = self.specials.timestamp_begin
        # a segment closing on two timestamps gives only the first (HF skip_ending_double_timestamps)
        return [t for h in history for t in (h[:-1] if len(h) > 2 and h[-2] >= ts_begin else h)]

    def _prompt_ids(self) -> list[int]:
        sp, opts = self.specials, self.options
        has_history = bool(self.segments) or (bool(self._prompt) and opts.prompt_condition_type == "first-segment")
        if self._condition and has_history:
            previous = self._previous()
            if self._prompt and opts.prompt_condition_type == "all-segments":
                keep = sp.max_target_positions // 2 - 1
                return [sp.sot_prev, *self._prompt, *previous[-keep:], *self._init_tokens]
            return sp.decoder_prompt(opts.language, opts.task, timestamps=True, previous=previous)
        if self._prompt:
            return [sp.sot_prev, *self._prompt, *self._init_tokens]
        return list(self._init_tokens)

    def next_window(self) -> WindowPlan | None:
        """The next decode to run (the same one again until ``on_result``), or None when done."""
        if self._pending is not None:
            return self._pending
        if self.done:
            return None
        prompt = self._prompt_ids()
        room = self.specials.max_target_positions - len(prompt)
        if self.options.max_new_tokens is not None:
            if self.options.max_new_tokens > room:  # HF _set_max_new_tokens_and_length raises too
                raise ValueError(f"max_new_tokens {self.options.max_new_tokens} + prompt {len(prompt)} > positions")
            room = self.options.max_new_tokens
        num_frames = min(self.total_frames - self.seek, N_FRAMES)
        start = self.seek * HOP_LENGTH
        last = self.seek + num_frames >= self.total_frames
        num_samples = min(self.num_samples - start if last else num_frames * HOP_LENGTH, N_FRAMES * HOP_LENGTH)
        self._pending = WindowPlan(
            seek=self.seek,
            num_frames=num_frames,
            start_sample=start,
            num_samples=num_samples,
            prompt_ids=tuple(prompt),
            temperature=self.options.rules.temperatures[self._attempt],
            attempt=self._attempt,
            max_new_tokens=room,
            sot_index=prompt.index(self.specials.sot),
        )
        return self._pending

    def on_result(
        self, generated: list[int], token_logprobs: list[float], no_speech_prob: float, heard_no_speech: bool = False
    ) -> WindowResult:
        """Takes the decode of the pending plan and moves the state on.

        Args:
            generated: ids after the prompt, the final ``<|endoftext|>`` included when produced.
            token_logprobs: one per generated id (see ``quality.avg_logprob``).
            no_speech_prob: ``<|nospeech|>`` probability at ``plan.sot_index`` (softmax of raw logits).
            heard_no_speech: a VAD found no speech in the window (``quality.judge``).

        Returns:
            The decision; ``next_window()`` then gives the next plan.

        Raises:
            RuntimeError: no pending plan (``next_window`` not called, or already done).
            ValueError: see ``quality.judge``; an accepted window that does not move ``seek``
                (only possible when the engine broke the timestamp rules; HF would loop forever).
        """
        plan = self._pending
        if plan is None:
            raise RuntimeError("on_result without a pending window: call next_window() first")
        verdict = judge(
            generated,
            token_logprobs,
            no_speech_prob,
            plan.attempt,
            self.options.rules,
            self.specials.vocab_size,
            heard_no_speech,
        )
        segments: list[Segment] = []
        advance = 0
        self._tries.append((list(generated), list(token_logprobs), verdict))
        if verdict.verdict is Verdict.ACCEPT and verdict.needs_fallback and self.options.rules.keep_best_attempt:
            chosen = best_attempt([t[2] for t in self._tries], self.options.rules)
            generated, token_logprobs, best = self._tries[chosen]
            verdict = dataclasses.replace(best, verdict=Verdict.ACCEPT, needs_fallback=True)
        if verdict.verdict is Verdict.RETRY:
            self._attempt += 1
        else:
            self._tries = []
            if verdict.verdict is Verdict.SKIP:
                advance = plan.num_frames
            else:
                segments, advance = split_window(generated, self.specials, plan.seek, plan.num_frames)
                if advance <= 0:
                    raise ValueError(f"window at frame {plan.seek} did not advance: {generated}")
                for s in segments:
                    s.temperature, s.avg_logprob = verdict.temperature, verdict.avg_logprob
                    s.compression_ratio, s.no_speech_prob = verdict.compression_ratio, verdict.no_speech_prob
                self.segments += segments
            self.seek += advance
            self._attempt = 0
            self._condition = self.options.condition_on_previous_text and verdict.temperature < LOW_TEMPERATURE
        self._pending = None
        result = WindowResult(plan, verdict, segments, advance, list(generated), list(token_logprobs))
        self.results.append(result)
        return result
