"""Whisper long-form transcription of one request as a state machine the decoder service drives.

The sequential loop of openai-whisper's ``transcribe()`` (``whisper/transcribe.py``) and of HF transformers'
``WhisperGenerationMixin.generate`` (``models/whisper/generation_whisper.py``), which copied it, batch size 1,
without the model calls: the caller decodes each ``WindowPlan`` and reports the result. The two differ where
``FallbackRules.decoding_rules`` says (``decoder_svc.whisper.quality``); beside that, under ``"openai"`` rules:

* ``clips`` (``decoder_svc.whisper.clips``: ``clip_timestamps``, the VAD gate): only frames inside them are
  decoded; ``seek`` jumps to the next clip, a window ends at its clip's end.
* ``timestamps=False``: each window is decoded with ``<|notimestamps|>`` and moves ``seek`` by its whole length.
* segments with no text or no duration are dropped (openai-whisper clears them; they prompt nothing), and
  segment times end at the window's end (ours: a timestamp past a clip's end would reach into the silence).
* ``word_timestamps`` / ``hallucination_silence_threshold``: an accepted window waits for its words
  (``finish_window``), which move ``seek`` (``decoder_svc.whisper.word_seek``).

1. ``next_window()``: the window at ``seek`` (mel frames, 10 ms): ``min(total_frames - seek, 3000)`` frames,
   and its decoder prompt (``_prepare_decoder_input_ids``):
   * conditioned on previous text: ``<|startofprev|>`` + the last 223 (``max_target_positions // 2 - 1``)
     ids of all segments so far (timestamps included; of a segment closing on two timestamps the second
     is left out), with the initial prompt as the first "segment" ("first-segment"), or ``<|startofprev|>``
     + the whole initial prompt in front of that cut ("all-segments"); then ``<|startoftranscript|>`` ...
   * not conditioned (option off, nothing decoded yet, or the previous window was accepted at a
     temperature >= 0.5, ``"openai"``: last tried above ``prompt_reset_on_temperature``): ``<|startofprev|>``
     + the whole initial prompt if there is one, then the rest.
2. ``on_result(...)``: ``quality.judge``; RETRY re-plans the same window at the next temperature with the
   same prompt, SKIP moves ``seek`` past the window, ACCEPT adds ``segments.split_window``'s segments and
   moves ``seek`` by its advance. Done when ``seek >= total_frames`` (past the last clip).

``total_frames`` is ``num_samples // 160``, the frame count of HF's ``WhisperFeatureExtractor`` on the
unpadded audio (``truncation=False``). Audio of at most 30 s is one window of that length; HF instead
pads short audio's features to 3000 frames, which changes only the end time of a segment without
timestamps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from decoder_svc.whisper.clips import Clip, window_at
from decoder_svc.whisper.quality import FallbackRules, Judgement, Verdict, best_attempt, judge
from decoder_svc.whisper.segments import HOP_LENGTH, Segment, split_window, time_offset
from decoder_svc.whisper.word_seek import word_seek
from decoder_svc.whisper.word_timing import WordTiming
from shared.models.whisper_specials import WhisperSpecials

PROMPT_CONDITION_TYPES = ("first-segment", "all-segments")  # HF prompt_condition_type


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
        rules: temperatures, thresholds, the decoding rules.
        max_new_tokens: cap per window; None = up to ``max_target_positions`` ids with the prompt
            (HF's ``max_length`` 448).
        clips: ``"openai"`` rules: the frames to decode (``decoder_svc.whisper.clips``); None = all.
        word_timestamps: ``"openai"`` rules: accepted windows wait for ``finish_window``'s words.
        hallucination_silence_threshold: ``"openai"`` rules: seconds (``word_seek``); needs the words too.

    Raises:
        ValueError: timestamps False under ``"hf"`` rules, an unknown prompt_condition_type, "all-segments"
            without conditioning, max_new_tokens < 1, clips / word timing under ``"hf"`` rules, or a negative
            hallucination_silence_threshold.
    """

    language: str | None = "en"
    task: str = "transcribe"
    timestamps: bool = True
    condition_on_previous_text: bool = True
    initial_prompt_ids: tuple[int, ...] = ()
    prompt_condition_type: str = "first-segment"
    rules: FallbackRules = field(default_factory=FallbackRules)
    max_new_tokens: int | None = None
    clips: tuple[Clip, ...] | None = None
    word_timestamps: bool = False
    hallucination_silence_threshold: float | None = None

    def __post_init__(self) -> None:
        if not self.rules.openai:
            if not self.timestamps:
                raise ValueError("long-form decoding under HF's rules needs timestamps=True")
            if self.clips is not None or self.word_timestamps or self.hallucination_silence_threshold is not None:
                raise ValueError("clips and word timing of the loop are openai-whisper's: decoding_rules='openai'")
        if self.hallucination_silence_threshold is not None and not self.hallucination_silence_threshold >= 0:
            raise ValueError(
                f"hallucination_silence_threshold must be seconds >= 0, got {self.hallucination_silence_threshold}"
            )
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
    """What one ``on_result`` (or ``finish_window``) decided.

    Attributes:
        plan: the attempt it answers. judgement: verdict and quality numbers (``quality.Judgement``)
            of the attempt taken (an earlier one when ``rules.keep_best_attempt`` picked it).
        segments: the window's new segments (ACCEPT only; quality fields filled).
        seek_advance: mel frames ``seek`` moved by (0 on RETRY, and while ``needs_words``).
        generated, token_logprobs: the ids and logprobs of the attempt taken (its segments' source).
        needs_words: ACCEPT whose words ``finish_window`` must be given before the loop goes on.
        words: per segment its words (``finish_window``'s result), else None.
    """

    plan: WindowPlan
    judgement: Judgement
    segments: list[Segment]
    seek_advance: int
    generated: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    needs_words: bool = False
    words: list[list[WordTiming]] | None = None

    @property
    def verdict(self) -> Verdict:
        return self.judgement.verdict


class LongFormState:
    """The per-request long-form loop (see the module docstring).

    Args:
        specials: the checkpoint's special ids (prompt layout, timestamps, ``max_target_positions``).
        num_samples: the request's audio length, 16 kHz samples.
        options: see ``LongFormOptions``.
        decode: ids -> text with the checkpoint's tokenizer (text tokens only are passed); needed by
            ``"openai"`` rules (the compression ratio of the text, empty segments).

    Raises:
        ValueError: negative ``num_samples``; a prompt that leaves no room to generate; ``"openai"`` rules
            without ``decode``; ``WhisperLanguageError`` (a ValueError) for a language or task the checkpoint lacks.
    """

    def __init__(
        self,
        specials: WhisperSpecials,
        num_samples: int,
        options: LongFormOptions,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if options.rules.openai and decode is None:
            raise ValueError("openai decoding rules judge decoded text: pass decode")
        self.specials = specials
        self.options = options
        self.decode = decode
        self.num_samples = num_samples
        self.total_frames = num_samples // HOP_LENGTH
        self.clips: list[Clip] = list(options.clips) if options.clips is not None else [(0, self.total_frames)]
        self._clip = 0
        self.seek = self.clips[0][0] if self.clips else self.total_frames
        self.segments: list[Segment] = []  # accepted so far, in order
        self.results: list[WindowResult] = []  # every attempt, in order
        self.last_speech_end = 0.0  # end of the last timed word (word_seek)
        self._init_tokens = specials.decoder_prompt(options.language, options.task, timestamps=options.timestamps)
        prompt = list(options.initial_prompt_ids)
        if prompt and prompt[0] == specials.sot_prev:  # HF strips it from the prompt segment
            prompt = prompt[1:]
        self._prompt = prompt
        self._condition = options.condition_on_previous_text  # HF do_condition_on_prev_tokens
        self._attempt = 0
        self._tries: list[tuple[list[int], list[float], Judgement]] = []  # the pending window's attempts so far
        self._pending: WindowPlan | None = None
        self._awaiting: WindowResult | None = None  # accepted, waiting for finish_window's words
        keep, init = specials.max_target_positions // 2 - 1, len(self._init_tokens)
        if options.prompt_condition_type == "all-segments":
            longest = 1 + len(prompt) + keep + init
        else:
            longest = max(1 + len(prompt), 1 + keep) + init
        if longest >= specials.max_target_positions:
            raise ValueError(f"a prompt of up to {longest} ids leaves no room in {specials.max_target_positions}")
        self._next_clip()

    def _next_clip(self) -> None:
        """Moves ``seek`` into the current clip, or on to the next one (openai-whisper's clip loop)."""
        while self._clip < len(self.clips):
            start, end = self.clips[self._clip]
            self.seek = max(self.seek, start)
            if self.seek < min(end, self.total_frames):
                return
            self._clip += 1
        self.seek = max(self.seek, self.total_frames)

    @property
    def done(self) -> bool:
        return self.seek >= self.total_frames or self._clip >= len(self.clips)

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
            return sp.decoder_prompt(opts.language, opts.task, timestamps=opts.timestamps, previous=previous)
        if self._prompt:
            return [sp.sot_prev, *self._prompt, *self._init_tokens]
        return list(self._init_tokens)

    def next_window(self) -> WindowPlan | None:
        """The next decode to run (the same one again until ``on_result``), or None when done.

        Raises:
            RuntimeError: an accepted window still waits for ``finish_window``.
        """
        if self._awaiting is not None:
            raise RuntimeError("the accepted window waits for its words: call finish_window() first")
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
        num_frames, num_samples = window_at(self.seek, self.clips[self._clip][1], self.num_samples)
        start = self.seek * HOP_LENGTH
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

    def text(self, generated: Sequence[int]) -> str:
        """The decoded text of ``generated`` (text tokens only), stripped; "" without ``decode``."""
        return self.decode(self.specials.text_tokens(generated)).strip() if self.decode is not None else ""

    def on_result(
        self,
        generated: list[int],
        token_logprobs: list[float],
        no_speech_prob: float,
        heard_no_speech: bool = False,
        heard_speech: bool = False,
    ) -> WindowResult:
        """Takes the decode of the pending plan and moves the state on.

        Args:
            generated: ids after the prompt, the final ``<|endoftext|>`` included when produced.
            token_logprobs: one per generated id (see ``quality.avg_logprob``).
            no_speech_prob: ``<|nospeech|>`` probability at ``plan.sot_index`` (softmax of raw logits).
            heard_no_speech: a VAD found no speech in the window (``quality.judge``).
            heard_speech: a VAD heard speech in the window: it is not skipped as silence (``quality.judge``).

        Returns:
            The decision; ``next_window()`` then gives the next plan (after ``finish_window`` when the
            result ``needs_words``).

        Raises:
            RuntimeError: no pending plan (``next_window`` not called, or already done).
            ValueError: see ``quality.judge``; an accepted window that does not move ``seek``
                (only possible when the engine broke the timestamp rules; HF would loop forever).
        """
        plan = self._pending
        if plan is None:
            raise RuntimeError("on_result without a pending window: call next_window() first")
        rules = self.options.rules
        verdict = judge(
            generated,
            token_logprobs,
            no_speech_prob,
            plan.attempt,
            rules,
            self.specials.vocab_size,
            heard_no_speech,
            self.text(generated) if rules.openai else None,
            heard_speech,
        )
        segments: list[Segment] = []
        advance = 0
        self._tries.append((list(generated), list(token_logprobs), verdict))
        if verdict.verdict is Verdict.ACCEPT and verdict.needs_fallback and rules.keep_best_attempt:
            chosen = best_attempt([t[2] for t in self._tries], rules)
            generated, token_logprobs, best = self._tries[chosen]
            verdict = dataclasses.replace(best, verdict=Verdict.ACCEPT, needs_fallback=True)
        self._pending = None
        if verdict.verdict is Verdict.RETRY:
            self._attempt += 1
            result = WindowResult(plan, verdict, [], 0, list(generated), list(token_logprobs))
            self.results.append(result)
            return result
        self._tries = []
        self._attempt = 0
        if verdict.verdict is Verdict.SKIP:
            advance = plan.num_frames
            if not rules.openai:  # openai-whisper goes on to the next window before its prompt reset
                self._condition = self._conditions_after(plan, verdict)
        else:
            segments, advance = split_window(generated, self.specials, plan.seek, plan.num_frames)
            if advance <= 0:
                raise ValueError(f"window at frame {plan.seek} did not advance: {generated}")
            window_end = time_offset(plan.seek + plan.num_frames)
            for seg in segments:
                seg.temperature, seg.avg_logprob = verdict.temperature, verdict.avg_logprob
                seg.compression_ratio, seg.no_speech_prob = verdict.compression_ratio, verdict.no_speech_prob
                if rules.openai:  # past the window's audio lies padding (a clip's end): no segment reaches into it
                    seg.start, seg.end = min(seg.start, window_end), min(seg.end, window_end)
            if rules.openai and (
                self.options.word_timestamps or self.options.hallucination_silence_threshold is not None
            ):
                self._awaiting = WindowResult(
                    plan, verdict, segments, advance, list(generated), list(token_logprobs), needs_words=True
                )
                self.results.append(self._awaiting)
                return self._awaiting
            segments = self._commit(segments)
            self._condition = self._conditions_after(plan, verdict)
        self.seek += advance
        self._next_clip()
        result = WindowResult(plan, verdict, segments, advance, list(generated), list(token_logprobs))
        self.results.append(result)
        return result

    def _conditions_after(self, plan: WindowPlan, verdict: Judgement) -> bool:
        """Whether the next window is prompted with the text so far: HF looks at the taken attempt's
        temperature, openai-whisper / faster-whisper at the last one tried."""
        rules = self.options.rules
        hot = plan.temperature if rules.openai else verdict.temperature
        return self.options.condition_on_previous_text and rules.conditions_after(hot)

    def _commit(self, segments: list[Segment]) -> list[Segment]:
        """Adds an accepted window's segments; openai-whisper drops those with no text or no duration."""
        if self.options.rules.openai:
            segments = [s for s in segments if s.start != s.end and self.text(s.tokens)]
        self.segments += segments
        return segments

    def finish_window(self, words: list[list[WordTiming]]) -> WindowResult:
        """The words of the window ``on_result`` accepted with ``needs_words``: the next seek from them
        (``word_seek``), the window's segments kept (all, some, or none: hallucinations after silence).

        Args:
            words: per segment of that result, its words (seconds in the audio the model saw).

        Returns:
            The window's final result: its kept segments, their words, ``seek_advance``.

        Raises:
            RuntimeError: no window waits for its words.
            ValueError: not one word list per segment.
        """
        pending = self._awaiting
        if pending is None:
            raise RuntimeError("finish_window without an accepted window waiting for its words")
        if len(words) != len(pending.segments):
            raise ValueError(f"{len(words)} word lists for {len(pending.segments)} segments")
        plan = pending.plan
        tokens = [t for t in pending.generated if t != self.specials.eot]
        is_ts = [t >= self.specials.timestamp_begin for t in tokens]
        decision = word_seek(
            pending.segments,
            words,
            seek=plan.seek,
            num_frames=plan.num_frames,
            next_seek=plan.seek + pending.seek_advance,
            single_timestamp_ending=is_ts[-2:] == [False, True],
            content_frames=self.total_frames,
            last_speech_end=self.last_speech_end,
            threshold=self.options.hallucination_silence_threshold,
        )
        self._awaiting = None
        kept_segments, kept_words = [], []
        if not decision.drop_window:
            kept = pending.segments[: decision.keep]
            texts = {id(s) for s in self._commit(kept)}
            kept_segments = [s for s in kept if id(s) in texts]
            kept_words = [w for s, w in zip(kept, words[: decision.keep], strict=True) if id(s) in texts]
            self.last_speech_end = decision.last_speech_end
            self._condition = self._conditions_after(plan, pending.judgement)
        # a word clock that lands on or before the window start (a broken alignment) must still move on
        new_seek = decision.seek if decision.seek > plan.seek else plan.seek + pending.seek_advance
        advance = new_seek - plan.seek
        self.seek = new_seek
        self._next_clip()
        result = dataclasses.replace(pending, segments=kept_segments, seek_advance=advance, needs_words=False,
                                     words=kept_words)  # fmt: skip
        self.results[-1] = result
        return result
