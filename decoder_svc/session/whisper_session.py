"""One Whisper request (n = 1, one beam) on this replica: language detection, short-form and long-form decoding.

``WhisperSession`` runs what ``decoder_svc.whisper.options.WhisperJob`` asks,
each step an ordinary engine sequence batched continuously beside every other
request's (the engine never knows a request is long-form):

- **Language detection** (no language given, multilingual model): a
  one-token sequence with prompt ``[<|startoftranscript|>]`` on the first
  window; the language is the argmax of the language tokens' softmax at that
  position (HF / openai-whisper ``detect_language``). Its cross-attention KV
  is kept (``add_request(keep_cross=True)``) and the transcription of that
  window reads it: no second Encode. Under openai rules the window is the
  first one of speech (the VAD gate's first clip), and with
  ``language_detection_segments`` > 1 up to that many windows are heard, the
  first whose top language passes ``language_detection_threshold`` deciding,
  else the language most windows chose (faster-whisper's ``detect_language``).
  A detection under that threshold is then tried on the speech: the first
  window decoded greedily in the likeliest languages until one passes the
  quality checks (``whisper_language``, ours).
- **Short-form, token-streamed** (HF rules: <= 30 s, no timestamps, no VAD;
  openai rules: the same with a token-level sampling setting): one window, prompt
  ``[<|startofprev|> prompt] <|sot|> <|lang|> <|task|> <|notimestamps|>``,
  text streamed as decoded (``--stream-interval``). The raw logits at
  ``<|startoftranscript|>`` (``SamplingParams.probe_position``) give
  ``no_speech_prob``; when it is over ``no_speech_threshold`` the text is held
  until the window ends and dropped if its average logprob is under
  ``logprob_threshold`` (HF's skip rule) or silero-vad hears no speech in it
  (``vad.has_speech``: Whisper says " you" over silence with a confident
  logprob, which HF keeps), so silence never streams a word.
  No temperature fallback here: the text streamed cannot be taken back.
- **The window loop** (everything else; ``decoder_svc.whisper.longform.LongFormState``):
  each window is decoded (with the timestamp rules, ``TimestampRules`` as the
  row's ``logits_rules``, unless it is one window without timestamps), judged
  (compression ratio, average logprob, no-speech; a greedy attempt whose text
  falls into a repetition loop is ended there, ``repetition.LoopStop``, when
  that already decides its verdict), decoded again at the next
  temperature over the same kept cross KV when it fails (under openai rules
  as ``best_of`` samples of one sequence group, n > 1, sharing that KV; the
  best by sum logprob / length judged), and once accepted its segments stream
  (and, with word timestamps or ``hallucination_silence_threshold``, the
  alignment heads' cross-attention over the kept KV gives its words,
  ``decoder_svc.whisper.word_timing``, which under openai rules also move the
  seek). A rejected attempt is never sent. The next window's Encode is sent as
  soon as its seek is known.

Abort, disconnect and failures end the request as any other
(``RequestSession._release``: the sequence and any kept cross blocks freed,
the Redis record ended once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.core.sequence import next_arrival_order
from decoder_svc.replicas.request_state import RequestState
from decoder_svc.session import convert
from decoder_svc.session.inputs import RequestInput
from decoder_svc.session.request_progress import StreamCoalescer
from decoder_svc.session.request_session import RequestSession
from decoder_svc.session.whisper_language import LanguageDetection
from decoder_svc.whisper import segment_output
from decoder_svc.whisper.language import no_speech_probability
from decoder_svc.whisper.longform import LongFormOptions, LongFormState
from decoder_svc.whisper.quality import Verdict, avg_logprob, rank_samples, text_passes
from decoder_svc.whisper.repetition import LoopStop
from decoder_svc.whisper.segments import split_window
from decoder_svc.whisper.timestamp_rules import TimestampRules
from decoder_svc.whisper.vad import has_speech
from shared.models.whisper_features import window_features
from shared.proto import decoder_pb2

log = logging.getLogger(__name__)

ENCODER_LEN = 1500  # cross-attention positions of one 30 s window
HOP_LENGTH = 160  # samples per log-mel frame
HEARD_SPEECH_S = 1.0  # the VAD gate's speech in a window that keeps it from the no-speech skip (quality.judge)


def window_seed(seed: int | None, seek: int, attempt: int) -> int:
    """The sampling seed of one window attempt: from the request's ``seed`` (0 when it gave none), the window's
    first frame and the attempt, so a fallback samples the same tokens whether the request runs alone or beside
    others, and every attempt draws other numbers (its ``n`` samples take ``seed + i``, ``sampler.sample_seed``)."""
    return ((seed or 0) + seek * 1_000_003 + attempt * 1_009) % 2**63


class RequestAborted(Exception):
    """The Abort RPC's output arrived: the request ends with "abort"."""


class WhisperSession(LanguageDetection, RequestSession):
    """A Whisper request's session (see the module docstring); ``inp.whisper`` holds its job."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.job = self.progress.input.whisper
        self.kept_window: tuple[int, int] | None = None  # (first sample, samples) of the window whose cross KV is kept
        self.language: str | None = self.job.language
        self.language_probability = 1.0
        self.no_speech_prob = 0.0
        self.segments_sent = 0
        self.length_cut = False  # long-form: max_tokens ran out
        self.arrival_order = next_arrival_order()  # every window keeps the request's place (FCFS per request)

    async def _messages(self):
        """The request's messages (``RequestSession.run`` records its end): the last one carries usage,
        language, language_probability, duration and no_speech_prob; sets ``self.end``."""
        progress, job = self.progress, self.job
        final = decoder_pb2.GenerateResponse(request_id=self.request_id, finish_reason=decoder_pb2.FINISH_REASON_STOP)
        try:
            if len(job.pcm) and job.clips != []:  # the VAD gate may find no speech at all
                if self.language is None:
                    await self._detect_language()
                if job.long_form:
                    async for message in self._long_form():
                        yield message
                else:
                    async for message in self._short_form(final):
                        yield message
            else:  # the VAD (filter or gate) found no speech: nothing to decode
                self.no_speech_prob = 1.0
            if self.length_cut:
                final.finish_reason = decoder_pb2.FINISH_REASON_LENGTH
            reason = "stop" if final.finish_reason == decoder_pb2.FINISH_REASON_STOP else "length"
        except RequestAborted:
            final.finish_reason, reason = decoder_pb2.FINISH_REASON_ABORT, "abort"
        self._finish_message(final)
        state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        if state is RequestState.FINISHED and not self.decoding_recorded:  # nothing to decode (VAD: no speech)
            await self.record_progress(RequestState.DECODING)
            self.decoding_recorded = True
        self.end = (state, {"finish_reason": reason, **progress.usage()})
        yield final

    # -- the three kinds of sequence ------------------------------------------
    @property
    def _timestamps(self) -> bool:
        """Whether the window loop decodes with timestamps: always under HF rules; under openai rules unless the
        request is one window of at most 30 s that asked for none."""
        job = self.job
        return not job.rules.openai or job.timestamps != "none" or len(job.pcm) > 30 * 16_000

    async def _short_form(self, final: decoder_pb2.GenerateResponse):
        job, specials, sessions = self.job, self.job.specials, self._sessions
        prompt = specials.decoder_prompt(self.language, job.task, timestamps=False, previous=job.prompt_ids)
        user_logprobs = self.params.logprobs
        params = dataclasses.replace(
            self.params, probe_position=prompt.index(specials.sot), logprobs=True, logprobs_before_warpers=True
        )
        coalesce = StreamCoalescer(sessions.config.stream_interval)
        held: list[decoder_pb2.GenerateResponse] | None = None
        logprobs: list[float] = []
        rules = job.rules
        async for item in self._sequence(0, len(job.pcm), prompt, params):
            if item.probe_logits is not None:
                self.no_speech_prob = no_speech_probability(item.probe_logits, specials)
                if rules.no_speech_threshold is not None and rules.logprob_threshold is not None:
                    held = [] if self.no_speech_prob > rules.no_speech_threshold else None
            logprobs += [lp.logprob for lp in item.logprobs or ()]
            self._observe_tokens(len(item.new_token_ids))
            shown = item if user_logprobs else dataclasses.replace(item, logprobs=None)
            message = convert.generate_response(
                self.request_id, shown, item.text, item.finish_reason if item.finished else None, sessions.token_texts
            )
            if item.finished:
                if held is not None:  # the whole held window goes out in the final message, or nothing of it
                    silent = (logprobs and avg_logprob(logprobs) < rules.logprob_threshold) or not (
                        await asyncio.to_thread(has_speech, job.pcm)
                    )  # HF's skip rule, or the VAD hears no speech either
                    text = "" if silent else "".join(m.text for m in held) + message.text
                    for m in [] if silent else held:
                        final.MergeFrom(m)
                    final.MergeFrom(message)
                    final.text = text
                    if silent:
                        del final.token_ids[:]
                        del final.logprobs[:]
                else:
                    final.MergeFrom(message)
                    final.text = message.text
                held_out = coalesce.held.pop(0, None)
                if held_out is not None:  # what the coalescer held goes before the final message
                    yield held_out
                return
            if held is not None:
                held.append(message)
            elif (out := coalesce.add(message, len(item.new_token_ids), False)) is not None:
                yield out

    async def _long_form(self):
        job, specials, sessions = self.job, self.job.specials, self._sessions
        rules = job.rules
        tokenizer = sessions.engine.tokenizer
        timestamps = self._timestamps
        state = LongFormState(
            specials,
            len(job.pcm),
            LongFormOptions(
                language=self.language,
                task=job.task,
                timestamps=timestamps,
                condition_on_previous_text=job.condition_on_previous_text,
                initial_prompt_ids=tuple(job.prompt_ids),
                rules=rules,
                clips=None if job.clips is None else tuple(job.clips),
                word_timestamps=rules.openai and job.word_timing,
                hallucination_silence_threshold=job.hallucination_silence_threshold,
            ),
            decode=(lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if rules.openai else None,
        )
        first, budget = True, self.params.max_tokens  # max_tokens: over the whole request, every attempt counted
        while (plan := state.next_window()) is not None:
            prompt = list(plan.prompt_ids)
            max_new = plan.max_new_tokens
            if budget is not None:
                max_new = min(max_new, budget - self.progress.completion_tokens)
                if max_new < 1:
                    self.length_cut = True
                    return
            params = SamplingParams(
                temperature=plan.temperature,
                seed=window_seed(self.params.seed, plan.seek, plan.attempt),
                n=rules.samples_at(plan.temperature),
                logprobs=True,
                logprobs_before_warpers=True,
                probe_position=prompt.index(specials.sot),
                logits_rules=TimestampRules(specials, begin_index=len(prompt)) if timestamps else None,
                max_tokens=max_new,
                repetition_penalty=self.params.repetition_penalty,
                no_repeat_ngram_size=self.params.no_repeat_ngram_size,
                stop_criterion=self._loop_stop(plan, tokenizer) if rules.samples_at(plan.temperature) == 1 else None,
            )
            samples: dict[int, tuple[list[int], list[float]]] = {}
            probe = None
            async for item in self._sequence(plan.start_sample, plan.num_samples, prompt, params):
                generated, logprobs = samples.setdefault(item.index, ([], []))
                generated += item.new_token_ids
                logprobs += [lp.logprob for lp in item.logprobs or ()]
                if item.probe_logits is not None:
                    probe = item.probe_logits
                self._observe_tokens(len(item.new_token_ids))
            ordered = [samples.get(i, ([], [])) for i in range(params.n)]
            pick = 0
            if params.n > 1:  # openai rules' best_of: a sample that loops is never preferred (rank_samples)
                fine = [text_passes(state.text(ids), rules.compression_ratio_threshold) for ids, _ in ordered]
                pick = rank_samples(ordered, specials.eot, fine)
            generated, logprobs = ordered[pick]
            no_speech = no_speech_probability(probe, specials)
            if first:
                self.no_speech_prob, first = no_speech, False
            heard_no_speech = heard_speech = False
            if rules.no_speech_threshold is not None and no_speech > rules.no_speech_threshold:
                if job.gate_regions is not None:  # the gate's VAD: speech heard is never skipped as silence
                    heard = self._gate_speech_s(plan.start_sample, plan.num_samples)
                    heard_speech, heard_no_speech = heard >= HEARD_SPEECH_S, heard == 0.0
                else:
                    window_pcm = job.pcm[plan.start_sample : plan.start_sample + plan.num_samples]
                    heard_no_speech = not await asyncio.to_thread(has_speech, window_pcm)
            words = None
            if budget is not None and self.progress.completion_tokens >= budget:
                # max_tokens used up: this attempt's segments as they are (no retry), then "length"
                segments = split_window(generated, specials, plan.seek, plan.num_frames)[0]
                self.length_cut = True
            else:
                result = state.on_result(generated, logprobs, no_speech, heard_no_speech, heard_speech)
                j = result.judgement
                log.debug(
                    "request %s window %.2f s attempt %d (T=%.1f): %s (compression %.2f%s, avg logprob %.2f, "
                    "no_speech %.2f%s)",
                    self.request_id, plan.time_offset, plan.attempt, plan.temperature, j.verdict.value,
                    j.compression_ratio, ", loop" if j.repetition else "", j.avg_logprob, j.no_speech_prob,
                    ", VAD: no speech" if heard_no_speech else "",
                )  # fmt: skip
                if result.verdict is Verdict.RETRY:
                    continue  # decoded again at the next temperature, over the kept cross KV
                if result.needs_words:  # openai rules: the words move the seek (and may drop hallucinations)
                    timed = await self._words(plan, result.segments, result.generated, result.token_logprobs)
                    result = state.finish_window(timed)
                    words = result.words
                segments = list(result.segments)
                generated, logprobs = result.generated, result.token_logprobs  # the attempt taken
            if segments and job.timestamps == "word" and words is None:
                words = await self._words(plan, segments, generated, logprobs)
            messages = segment_output.segment_messages(
                self.request_id, job, tokenizer, segments, words if job.timestamps == "word" else None,
                self.segments_sent,
            )  # fmt: skip
            if messages.segments:
                self.segments_sent += len(messages.segments)
                messages.token_ids.extend(generated)
                yield messages
            if self.length_cut:
                return

    # -- plumbing -----------------------------------------------------------------
    async def _sequence(self, start: int, num_samples: int, prompt: list[int], params: SamplingParams):
        """Adds one sequence (``params.n`` samples) over the window ``[start, start + num_samples)`` and yields
        its outputs until every sample finished.

        The window's cross KV is kept after it (for a retry, the transcription after detection, word
        alignment); a sequence over another window first frees it and has the new window encoded.

        Raises:
            RequestAborted: the Abort RPC. ResourceExhaustedError: the window can never fit the KV pools.
            Exception: from the stream (the encoder failed, a failed step, the shutdown cut).
        """
        sessions, progress = self._sessions, self.progress
        reuse = self.kept_window == (start, num_samples)
        if not reuse:
            if self.kept_window is not None:
                await sessions.loop.call(sessions.engine.release_cross, self.request_id)
                self.kept_window = None
            window = RequestInput(ENCODER_LEN, pcm=self.job.pcm[start : start + num_samples])
            if self.job.features is not None:  # over 30 s: the window's slice of the whole clip's log-mel (HF)
                window.features = window_features(
                    self.job.features, start // HOP_LENGTH, min(num_samples // HOP_LENGTH, 3000)
                )
            if progress.encoder_tokens:  # a window was encoded before this one
                progress.window += 1
            progress.input = dataclasses.replace(progress.input, pcm=window.pcm, features=window.features)
            progress.encoder_tokens += ENCODER_LEN
        await self._add_sequence(
            ENCODER_LEN,
            params,
            prompt,
            None if reuse else progress.input,
            keep_cross=True,
            reuse_cross=reuse,
            arrival_order=self.arrival_order,
        )
        self.kept_window = (start, num_samples)
        progress.sample_completion.clear()
        finished: set[int] = set()
        while True:
            got = await self.stream.get()
            if isinstance(got, BaseException):
                raise got
            if got.error is not None:
                raise got.error
            if got.finish_reason == "abort":
                raise RequestAborted()
            if not self.decoding_recorded and self.encoding is None:  # an encoder-cache hit: no Encode of its own
                self.decoding_recorded = True
                await self.record_progress(RequestState.DECODING)
            progress.count(got)
            yield got
            if got.finished:
                finished.add(got.index)
            if len(finished) >= params.n:
                progress.base_prompt_tokens, progress.base_completion_tokens = (
                    progress.prompt_tokens,
                    progress.completion_tokens,
                )
                progress.sample_completion.clear()
                self.encoding = None
                return

    def _loop_stop(self, plan, tokenizer) -> LoopStop | None:
        """The attempt's ``LoopStop`` where a loop's verdict cannot depend on what the attempt decodes after it: openai
        rules (a loop fails the attempt, ``quality.judge``), a later temperature to retry at, and a no-speech skip
        either impossible or certain (no threshold, or the VAD gate heard speech in the window, or none), since
        only that skip reads the average logprob of the whole attempt. Else None: the attempt runs to its end."""
        job, rules = self.job, self.job.rules
        if not rules.openai or plan.attempt >= len(rules.temperatures) - 1:
            return None
        if rules.no_speech_threshold is not None:
            if job.gate_regions is None:
                return None
            heard = self._gate_speech_s(plan.start_sample, plan.num_samples)
            if 0.0 < heard < HEARD_SPEECH_S:
                return None
        eot = job.specials.eot
        return LoopStop(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), lambda t: t < eot)

    def _gate_speech_s(self, start: int, num_samples: int) -> float:
        """Seconds of the VAD gate's speech regions inside ``[start, start + num_samples)`` of the job's audio."""
        end = start + num_samples
        return sum(max(0, min(e, end) - max(s, start)) for s, e in self.job.gate_regions) / 16_000

    async def _words(self, plan, segments, generated, logprobs):
        """Word timings of an accepted window's segments, from its kept cross KV (off the engine thread)."""
        sessions = self._sessions
        cross_kv = await sessions.loop.call(sessions.engine.cross_kv, self.request_id)
        return await asyncio.to_thread(
            segment_output.window_words,
            sessions.engine.model,
            sessions.engine.tokenizer,
            self.job,
            plan,
            segments,
            generated,
            logprobs,
            cross_kv,
            self.language,
        )

    def _finish_message(self, final: decoder_pb2.GenerateResponse) -> None:
        progress = self.progress
        convert.add_usage(final, progress.usage(), progress.encoder_tokens, self.applied)
        final.language = self.language or ""
        # 1 when given; the detection's softmax when detected; 0 when nothing was decoded to detect it on (VAD).
        final.language_probability = self.language_probability if self.language is not None else 0.0
        final.duration = self.job.duration_s
        final.no_speech_prob = self.no_speech_prob
