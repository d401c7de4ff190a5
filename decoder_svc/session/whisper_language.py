"""Language detection of a Whisper request (``WhisperSession``'s part; see ``whisper_session``'s docstring).

Detection reads the language tokens' softmax at ``<|startoftranscript|>`` of the first window (or, under openai
rules, of up to ``language_detection_segments`` windows of speech: faster-whisper's ``detect_language``). Ours on
top, under openai rules: an uncertain detection is tried on the speech (``_confirm_language``).
"""

from __future__ import annotations

import logging

from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.whisper.clips import speech_windows
from decoder_svc.whisper.language import detect_language, language_probabilities
from decoder_svc.whisper.quality import judge
from decoder_svc.whisper.repetition import LoopStop
from decoder_svc.whisper.timestamp_rules import TimestampRules

log = logging.getLogger(__name__)

LANGUAGE_CANDIDATES = 4  # languages an uncertain detection tries on its first window (_confirm_language)


class LanguageDetection:
    """``WhisperSession``'s language detection; the session provides ``job``, ``params``, ``request_id``,
    ``_sessions``, ``_sequence``, ``_observe_tokens`` and ``_timestamps``, and reads ``language`` /
    ``language_probability`` after ``_detect_language``."""

    async def _detect_language(self) -> None:
        job, specials = self.job, self.job.specials
        params = SamplingParams(max_tokens=1, probe_position=0)
        if job.long_form and job.rules.openai:  # where the speech is: the windows the loop will decode
            windows = speech_windows(job.clips, len(job.pcm), job.language_detection_segments)
        else:
            windows = [(0, min(len(job.pcm), 30 * 16_000))]
        votes: dict[str, list[float]] = {}
        first: tuple[int, int, dict[str, float]] | None = None  # the first window and its language probabilities
        for start, num_samples in windows:
            logits = None
            async for item in self._sequence(start, num_samples, [specials.sot], params):
                if item.probe_logits is not None:
                    logits = item.probe_logits
            probs = language_probabilities(logits, specials)
            first = first or (start, num_samples, probs)
            if len(windows) == 1:
                self.language, self.language_probability = detect_language(logits, specials)
                break
            code = max(probs, key=probs.get)
            if probs[code] > job.language_detection_threshold:
                self.language, self.language_probability = code, probs[code]
                break
            votes.setdefault(code, []).append(probs[code])
        else:  # faster-whisper: no window was sure enough, the language most windows chose (its best probability)
            self.language = max(votes, key=lambda c: len(votes[c]))
            self.language_probability = max(votes[self.language])
        if self.language_probability < job.language_detection_threshold and job.long_form and job.rules.openai:
            await self._confirm_language(*first)

    async def _confirm_language(self, start: int, num_samples: int, probs: dict[str, float]) -> None:
        """An uncertain detection (under ``language_detection_threshold``, e.g. English under loud brown noise rated
        Welsh 0.19, English 0.19) is tried: the first window is decoded greedily in the detected language and, if
        that attempt fails the quality checks (``quality.judge``: a loop, the compression ratio, the average
        logprob), in the next likeliest languages of that window (those at least half as likely as the detected
        one, ``LANGUAGE_CANDIDATES`` in all); the first whose attempt passes is the language, else the detection
        stands. Ours (openai-whisper and faster-whisper take the argmax): a language the model cannot transcribe
        the speech in at temperature 0 loses to one it can. Costs up to ``LANGUAGE_CANDIDATES`` greedy window
        decodes (a looping one cut short, ``LoopStop``), only when the detection is uncertain; none with
        ``max_tokens`` (the request's token budget)."""
        if self.params.max_tokens is not None:
            return
        top = probs.get(self.language, 0.0)
        others = sorted((c for c in probs if c != self.language and probs[c] >= top / 2), key=probs.get, reverse=True)
        for code in [self.language, *others][:LANGUAGE_CANDIDATES]:
            if await self._window_passes(code, start, num_samples):
                self.language, self.language_probability = code, probs[code]
                return

    async def _window_passes(self, language: str, start: int, num_samples: int) -> bool:
        """Whether a greedy decode of the window ``[start, start + num_samples)`` in ``language``, prompted as the
        long-form loop's first window, needs no fallback (``quality.judge``; a no-speech skip not considered)."""
        job, specials, rules = self.job, self.job.specials, self.job.rules
        tokenizer = self._sessions.engine.tokenizer
        timestamps = self._timestamps
        prompt = specials.decoder_prompt(language, job.task, timestamps=timestamps, previous=job.prompt_ids)
        eot = specials.eot
        params = SamplingParams(
            logprobs=True,
            logprobs_before_warpers=True,
            probe_position=prompt.index(specials.sot),
            logits_rules=TimestampRules(specials, begin_index=len(prompt)) if timestamps else None,
            max_tokens=specials.max_target_positions - len(prompt),
            stop_criterion=LoopStop(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), lambda t: t < eot),
        )
        generated: list[int] = []
        logprobs: list[float] = []
        async for item in self._sequence(start, num_samples, prompt, params):
            generated += item.new_token_ids
            logprobs += [lp.logprob for lp in item.logprobs or ()]
            self._observe_tokens(len(item.new_token_ids))
        if not generated:
            return False
        text = tokenizer.decode(specials.text_tokens(generated), skip_special_tokens=True).strip()
        verdict = judge(generated, logprobs, 0.0, 0, rules, specials.vocab_size, text=text, heard_speech=True)
        log.debug("request %s language %s on the first window: %s", self.request_id, language, verdict)
        return not verdict.needs_fallback
