"""One realtime stream (``TranscribeStream``): audio in, partial and final text out, on this replica.

The stream is one request (one id, one Redis record) whose re-decodes are ordinary engine sequences, batched
continuously beside every other request's, one sequence at a time:

- **Input** (``_read``, a task of its own): each audio chunk becomes 16 kHz float32 (``stream_audio``), is kept
  (``StreamAudio``, the current utterance and some padding only) and runs through the stream's VAD
  (``stream_vad``, batched with the other streams'); its speech starts and stops, the client's commit / clear and
  the half-close go to the session's inbox in order.
- **Utterances**: speech start opens one (``speech_started``), its audio starting ``prefix_padding_ms`` earlier;
  without VAD the first audio after the previous utterance opens one. While it runs, every ``step_s`` of stream
  audio its buffer, at most 30 s, is encoded and decoded with timestamps (prompt: the stream's initial
  prompt and its finals before the buffer, as previous text; greedy), and the hypothesis's words, timed from the
  alignment heads' cross-attention (``decoder_svc.whisper.word_timing``), go to LocalAgreement-2
  (``agreement``): what two consecutive hypotheses agree on is sent as a final segment, the rest as the partial.
  A buffer past ``TRIM_S`` moves its start to the last final word's end (whisper_streaming's buffer trimming);
  one near 30 s with nothing agreed makes its hypothesis final. A decode whose words all lie in the context
  (the model transcribed the earlier speech and ended there) is run again without it, and so is the rest of
  that utterance.
- **Utterance end** (VAD silence, commit, half-close): the buffer is decoded once more up to the speech's end
  (unless the last step already heard all of it: once the VAD hears ``stream_vad.PAUSE_MS`` of silence inside
  speech, a step runs at once, so when the silence lasts ``silence_duration_ms`` its last decode is done already), with openai-whisper's fallback (compression ratio 2.4, average
  logprob -1.0 at temperatures 0, 0.2, 0.4, 0.6), and everything not yet final becomes final; ``utterance_done``
  carries its whole text and the cross KV is freed, so an idle stream holds no KV blocks.
- A window the model rates as no speech (``no_speech_prob`` over 0.6 with an average logprob under -1.0,
  openai-whisper's skip rule, or in which silero-vad hears no speech either) gives no words, so silence is never
  transcribed.

The stream's sequences run one priority level more urgent than its ``priority`` (file requests of the same
priority wait behind its steps: a stream that falls behind real time is worse than a file that waits).
Abort, disconnect, a bad chunk and the shutdown end it as any request (``RequestSession.run``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.core.sequence import next_arrival_order
from decoder_svc.realtime.agreement import LocalAgreement, TimedWord
from decoder_svc.realtime.stream_audio import SAMPLE_RATE, ChunkDecoder, StreamAudio
from decoder_svc.realtime.stream_vad import StreamVad, TurnOptions, VadBatcher
from decoder_svc.replicas.request_state import RequestState
from decoder_svc.session.whisper_session import RequestAborted, WhisperSession
from decoder_svc.whisper.language import detect_language, no_speech_probability
from decoder_svc.whisper.longform import WindowPlan
from decoder_svc.whisper.quality import avg_logprob, text_passes
from decoder_svc.whisper.segments import split_window
from decoder_svc.whisper.timestamp_rules import TimestampRules
from decoder_svc.whisper.vad import has_speech
from shared.errors import InvalidRequestError
from shared.proto import decoder_pb2

log = logging.getLogger(__name__)

MAX_BUFFER_S = 30.0  # Whisper's window: the most audio one decode hears
TRIM_S = 15.0  # a buffer longer than this starts again after its last final word (whisper_streaming's default)
FORCE_S = MAX_BUFFER_S - 2.0  # a buffer this long with nothing agreed makes its hypothesis final
FORCE_KEEP_S = 1.0  # ... but for the words in its last second
MAX_AHEAD_S = 30.0  # audio read ahead of what the session has taken in: beyond it reading waits (backpressure)
DETECT_MIN_S = 2.0  # multilingual streams without a language: steps wait until the utterance has this much audio
CONTEXT_S = 8.0  # audio before an utterance's speech its decodes also hear (earlier speech, final already)
KEEP_FINAL_WORDS = 400  # final words kept for the prompt (its last PROMPT_CHARS characters) and the checks
END_PAD_S = 0.3  # audio after the speech's end kept in the utterance's last decode
MIN_UTTERANCE_S = 0.2  # speech shorter than this (a click) is not decoded
FINAL_TEMPERATURES = (0.0, 0.2, 0.4, 0.6)  # the utterance-end decode's fallback (openai-whisper's, cut short)
COMPRESSION_RATIO_THRESHOLD = 2.4  # openai-whisper transcribe()
LOGPROB_THRESHOLD = -1.0
NO_SPEECH_THRESHOLD = 0.6
TOKENS_PER_S = 8  # a step's token cap: 8 per second of buffer, + 16 (speech runs about 3-4; a loop stops early)
PROMPT_CHARS = 1000  # finals' text kept for the prompt (the prompt itself keeps its last 223 tokens)
EMA = 0.3  # weight of the newest step in the decode-time average admission reads


@dataclass(frozen=True)
class RealtimeSettings:
    """A stream's settings from its ``RealtimeConfig``.

    Attributes:
        sample_rate, encoding: the chunks' format (``stream_audio.check_format``).
        turns: VAD turn options, or None (no VAD: utterances end at commit / half-close).
        partials: send partial text. words: finals carry their words (timestamps WORD).
        step_s: seconds between re-decodes (``--realtime-step-ms``).
    """

    sample_rate: int
    encoding: str
    turns: TurnOptions | None
    partials: bool
    words: bool
    step_s: float


@dataclass
class _Hypothesis:
    words: list[TimedWord]
    avg_logprob: float
    no_speech_prob: float
    temperature: float
    upto: int  # stream sample where the decoded audio ends


_END = object()  # the half-close


class RealtimeSession(WhisperSession):
    """A ``TranscribeStream`` call's session (module docstring); ``bind`` gives it its input before ``run``."""

    def bind(self, settings: RealtimeSettings, requests, vad_batcher: VadBatcher, on_step=None) -> None:
        """``requests``: the call's messages after its config (an async iterator); ``on_step``: called with each
        step's decode time, seconds (the replica's admission, ``stream_admission``)."""
        self.settings = settings
        self._on_step = on_step
        self._requests = requests
        self._vad_batcher = vad_batcher
        self.chunks = ChunkDecoder(settings.sample_rate, settings.encoding)
        self.vad = StreamVad(settings.turns) if settings.turns is not None else None
        self.audio = StreamAudio()
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.caught_up = asyncio.Event()  # the session took in more audio (the reader's backpressure)
        self.utterance = -1  # index of the current / last utterance
        self.open = False  # an utterance is running
        self.buffer_start = 0  # stream sample where its decode buffer starts
        self.speech_end: int | None = None  # where the VAD heard its speech stop
        self.agreement = LocalAgreement()  # the stream's: finals of every utterance, the running one's partial
        self.last: _Hypothesis | None = None
        self.next_step = 0  # stream sample at which the running utterance's next step is due
        self.stop_heard_at = 0  # where the VAD was when it found the speech's stop
        self.first_final = 0  # the running utterance's first word in agreement.final
        self.floor = 0  # stream sample before which no audio is heard again (a clear)
        self.utterance_start = 0
        self.utterances = 0
        self.finals = 0
        self.partial_sent = ""
        self.speech_start = 0
        self.heard_to = 0  # stream sample up to which the session has taken the audio in (its inbox order)
        self.step_time_s = 0.0  # moving average of a step's decode time (admission reads it)
        self.priority = self.priority - 1

    # -- the stream -----------------------------------------------------------------
    async def _messages(self):
        yield self._event(
            started=decoder_pb2.RealtimeStarted(
                model=self._sessions.config.model, step_s=self.settings.step_s, max_buffer_s=MAX_BUFFER_S
            )
        )
        reader = asyncio.create_task(self._read())
        watch: asyncio.Task | None = None  # the engine stream while no sequence runs (abort, shutdown)
        get: asyncio.Task | None = None
        try:
            while True:
                get = get or asyncio.create_task(self.inbox.get())
                watch = watch or asyncio.create_task(self.stream.get())
                done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if watch in done:
                    self._on_engine_item(watch.result())
                    watch = None
                    continue
                watch.cancel()  # a sequence may be about to read the engine stream itself
                watch = None
                item, get = get.result(), None
                async for message in self._on_input(item):
                    yield message
                if item is _END:
                    break
            reason = "stop"
        except RequestAborted:  # the Abort RPC: the stream ends now, with what is final
            reason = "abort"
        finally:
            for task in (reader, watch, get):
                if task is not None:
                    task.cancel()
        yield self._end_message()
        state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        if state is RequestState.FINISHED and not self.decoding_recorded:  # no audio, or no speech: nothing decoded
            await self.record_progress(RequestState.DECODING)
            self.decoding_recorded = True
        self.end = (state, {"finish_reason": reason, **self._progress_fields()})

    def _progress_fields(self) -> dict:
        """What the stream's record shows while it runs (written with each re-decode's DECODING) and at its end."""
        chunks = getattr(self, "chunks", None)  # bound right after the session opens
        audio_bytes = chunks.bytes_received if chunks is not None else 0
        return {**self.progress.usage(), "audio_bytes": audio_bytes, "finals": getattr(self, "finals", 0)}

    def _end_message(self) -> decoder_pb2.TranscribeStreamResponse:
        return self._event(
            end=decoder_pb2.RealtimeEnd(
                usage=decoder_pb2.Usage(encoder_tokens=self.progress.encoder_tokens, **self.progress.usage()),
                audio_s=self.audio.end / SAMPLE_RATE,
                finals=self.finals,
                utterances=self.utterances,
                language=self.language or "",
            )
        )

    def _on_engine_item(self, item) -> None:
        """Something came on the engine stream while no sequence ran."""
        if isinstance(item, BaseException):
            if self._sessions.cutting or not isinstance(item, Exception):
                raise item
            log.debug("stream %s: a step failed while none of its sequences ran: %s", self.request_id, item)
        elif item.finish_reason == "abort":
            raise RequestAborted()

    # -- input -----------------------------------------------------------------------
    async def _read(self) -> None:
        """Reads the call's messages into the inbox: ("audio", n), ("start" / "stop", sample), ("commit",),
        ("clear",), then ``_END``; an exception (bad message or chunk) ends the stream with it."""
        try:
            async for message in self._requests:
                kind = message.WhichOneof("message")
                if kind == "audio":
                    await self._take(self.chunks.feed(message.audio))
                elif kind == "control":
                    if message.control == decoder_pb2.REALTIME_CONTROL_COMMIT:
                        self.inbox.put_nowait(("commit",))
                    elif message.control == decoder_pb2.REALTIME_CONTROL_CLEAR:
                        self.inbox.put_nowait(("clear",))
                    else:
                        raise InvalidRequestError(f"control must be COMMIT or CLEAR, got {message.control}")
                elif kind == "config":
                    raise InvalidRequestError("config is the stream's first message only; send audio or control")
                else:
                    raise InvalidRequestError("a TranscribeStream message must set audio or control")
            await self._take(self.chunks.flush())
            self.inbox.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - ends the stream with that status
            self.inbox.put_nowait(exc)

    async def _take(self, pcm: np.ndarray) -> None:
        # Backpressure: a client sending faster than the stream is decoded (a file fed unpaced, an overloaded
        # decoder, a client not reading its events) waits here, and gRPC's flow control holds its sends.
        while self.audio.end - self.heard_to > MAX_AHEAD_S * SAMPLE_RATE:
            self.caught_up.clear()
            await self.caught_up.wait()
        self.audio.append(pcm)
        if self.vad is not None:
            probabilities = await self._vad_batcher.probabilities(self.vad, self.vad.windows(pcm))
            for turn in self.vad.turns(probabilities):
                self.inbox.put_nowait((turn.kind, turn.sample, turn.heard_at))
        if pcm.size:  # its end, and where the VAD had got to: no speech can start before that any more
            self.inbox.put_nowait(
                ("audio", self.audio.end, pcm.size, self.vad.position if self.vad else self.audio.end)
            )

    async def _on_input(self, item):
        if isinstance(item, BaseException):
            raise item
        if item is _END:
            if self.open:
                async for message in self._finish():
                    yield message
            return
        kind = item[0]
        if kind == "audio":
            _, end, size, heard = item
            self.heard_to = end
            self.caught_up.set()
            if self.vad is None and not self.open:
                self._begin(end - size)
            elif not self.open:  # between utterances: the next one's prefix padding and context
                self.audio.drop_before(
                    max(min(end, heard) - max(self._padding(), int(CONTEXT_S * SAMPLE_RATE)), self.floor)
                )
            # A step every step_s of stream audio (the same steps however fast the audio comes: a stream's text
            # depends on its audio alone), and at once when the buffer nears 30 s.
            if self.open and (end >= self.next_step or (end - self.buffer_start) / SAMPLE_RATE >= FORCE_S):
                async for message in self._step(end):
                    yield message
        elif kind == "pause":  # the speech may be ending: its last decode now, not after silence_duration_ms
            if self.open and (self.last is None or self.last.upto < item[1]):
                async for message in self._step(item[2]):
                    yield message
        elif kind == "start":
            if not self.open:
                self._begin(max(item[1] - self._padding(), self.audio.start), item[1])
                yield self._event(speech_started=decoder_pb2.SpeechBoundary(audio_s=item[1] / SAMPLE_RATE))
        elif kind == "stop":
            if self.open:
                self.speech_end, self.stop_heard_at = item[1], item[2]
                yield self._event(speech_stopped=decoder_pb2.SpeechBoundary(audio_s=item[1] / SAMPLE_RATE))
                async for message in self._finish():
                    yield message
        elif kind == "commit":
            if self.open:
                async for message in self._finish():
                    yield message
        elif kind == "clear":
            if self.open:
                self.agreement.pending = []
                self.floor = self.heard_to  # what was cleared is not heard again, as context either
                async for message in self._close():
                    yield message

    # -- utterances ----------------------------------------------------------------
    def _padding(self) -> int:
        """Samples of prefix padding before an utterance's speech."""
        return (self.settings.turns.prefix_padding_ms if self.settings.turns else 0) * SAMPLE_RATE // 1000

    def _step_samples(self) -> int:
        return int(self.settings.step_s * SAMPLE_RATE)

    def _begin(self, start: int, speech_start: int | None = None) -> None:
        self.utterance += 1
        self.open, self.speech_end, self.last = True, None, None
        self.utterance_start = self.speech_start = start
        if speech_start is not None:
            self.speech_start = speech_start
        # The buffer starts up to CONTEXT_S earlier (audio of earlier utterances, all final, or silence): Whisper
        # hears a sentence better after the speech before it; the words heard there are context only.
        self.buffer_start = max(self.audio.start, self.floor, start - int(CONTEXT_S * SAMPLE_RATE))
        self.agreement.floor = start / SAMPLE_RATE
        self.first_final = len(self.agreement.final)
        self.partial_sent = ""
        self.next_step = self.speech_start + self._step_samples()  # the first step: one step into the speech

    async def _step(self, upto: int):
        """One re-decode of the running utterance's ``[buffer_start, upto)``: finals agreed, the partial."""
        started = time.monotonic()
        self.next_step = upto + self._step_samples()
        hypothesis = await self._decode(upto, final=False)
        elapsed = time.monotonic() - started
        self.step_time_s = elapsed if not self.step_time_s else (1 - EMA) * self.step_time_s + EMA * elapsed
        if self._on_step is not None and hypothesis is not None:  # a decode ran (not a wait for the language)
            self._on_step(elapsed)
        if hypothesis is None:
            return
        made_final = self.agreement.insert(hypothesis.words)
        if not made_final and (upto - self.buffer_start) / SAMPLE_RATE >= FORCE_S:
            # Nothing agreed in a buffer near 30 s, which no later step can hear whole: its words are final, but for
            # those in its last second (maybe cut off), which the next buffer, starting after the finals, hears again.
            keep = [w for w in self.agreement.pending if w.end > upto / SAMPLE_RATE - FORCE_KEEP_S]
            made_final = self.agreement.finalize(len(self.agreement.pending) - len(keep))
        if made_final:
            yield self._final(made_final, hypothesis)
        self._trim()
        if self.settings.partials:
            pending = self.agreement.pending
            text = "".join(w.text for w in pending)
            if text != self.partial_sent:
                self.partial_sent = text
                start = pending[0].start if pending else self.agreement.final_end
                end = pending[-1].end if pending else start
                yield self._event(partial=decoder_pb2.PartialText(text=text, start=start, end=end))

    async def _finish(self):
        """The utterance ended: its last decode (unless the last step heard all its speech), every word final."""
        end = self.heard_to  # commit / half-close: the audio before it
        if self.speech_end is not None:  # the VAD's stop: the speech and some of the silence it heard after
            end = min(self.stop_heard_at, self.speech_end + int(END_PAD_S * SAMPLE_RATE))
        speech_s = ((self.speech_end or end) - self.speech_start) / SAMPLE_RATE
        words: list[TimedWord] = []
        last = self.last
        if speech_s >= MIN_UTTERANCE_S:
            heard_all = last is not None and self.speech_end is not None and last.upto >= self.speech_end
            if not heard_all and end > self.buffer_start:
                last = await self._decode(end, final=True)
                words = self.agreement.flush(last.words if last is not None else [])
            else:
                words = self.agreement.flush()
        if words:
            yield self._final(words, last)
        async for message in self._close():
            yield message

    async def _close(self):
        """Ends the utterance: ``utterance_done`` (when it had any speech), its cross KV freed."""
        self.open = False
        words = self.agreement.final[self.first_final :]
        text = "".join(w.text for w in words)
        self.utterances += 1
        yield self._event(
            utterance_done=decoder_pb2.UtteranceDone(
                text=text.strip(),
                start=words[0].start if words else self.utterance_start / SAMPLE_RATE,
                end=words[-1].end if words else (self.speech_end or self.heard_to) / SAMPLE_RATE,
                language=self.language or "",
            )
        )
        if self.partial_sent and self.settings.partials:  # the partial is gone: every word of it is final now
            self.partial_sent = ""
        self.agreement.forget(KEEP_FINAL_WORDS)
        if self.kept_window is not None:
            sessions = self._sessions
            await sessions.loop.call(sessions.engine.release_cross, self.request_id)
            self.kept_window = None

    def _trim(self) -> None:
        """Whisper_streaming's buffer trimming: a buffer over ``TRIM_S`` restarts at its last final word's end."""
        if (self.heard_to - self.buffer_start) / SAMPLE_RATE > TRIM_S and self.agreement.final:
            cut = int(self.agreement.final_end * SAMPLE_RATE)
            if cut > self.buffer_start:
                self.buffer_start = cut
                self.audio.drop_before(cut)

    def _final(self, words: list[TimedWord], hypothesis: _Hypothesis | None):
        segment = decoder_pb2.Segment(
            id=self.finals,
            start=words[0].start,
            end=words[-1].end,
            text="".join(w.text for w in words),
            avg_logprob=hypothesis.avg_logprob if hypothesis else 0.0,
            no_speech_prob=hypothesis.no_speech_prob if hypothesis else 0.0,
            temperature=hypothesis.temperature if hypothesis else 0.0,
        )
        if self.settings.words:
            for w in words:
                segment.words.add(word=w.text, start=w.start, end=w.end, probability=w.probability)
        self.finals += 1
        return self._event(final=segment)

    def _event(self, **event) -> decoder_pb2.TranscribeStreamResponse:
        return decoder_pb2.TranscribeStreamResponse(
            request_id=self.request_id, utterance=max(self.utterance, 0), **event
        )

    # -- decoding --------------------------------------------------------------------
    def _previous_ids(self) -> list[int]:
        """The prompt's previous text: the initial prompt, then the finals before the buffer."""
        before = [w for w in self.agreement.final if w.end * SAMPLE_RATE <= self.buffer_start + 1]
        text = "".join(w.text for w in before)[-PROMPT_CHARS:]
        ids = list(self.job.prompt_ids)
        if text.strip():
            tokenizer = self._sessions.engine.tokenizer
            ids += self.job.specials.text_tokens(tokenizer.encode(text, add_special_tokens=False))
        return ids

    async def _decode(self, upto: int, final: bool) -> _Hypothesis | None:
        """Decodes ``[buffer_start, upto)``: greedy for a step; with fallback for an utterance's end.
        None: a multilingual stream's language is not known yet (too little audio to detect it)."""
        job, specials = self.job, self.job.specials
        start = max(self.buffer_start, upto - int(MAX_BUFFER_S * SAMPLE_RATE))
        pcm = self.audio.slice(start, upto)
        if not pcm.size:
            return None
        if self.kept_window is not None:  # the previous step's cross KV: freed before this one's is reserved
            await self._sessions.loop.call(self._sessions.engine.release_cross, self.request_id)
            self.kept_window = None
        job.pcm = pcm
        # Each decode queues (encoder, engine) as a new arrival, so the streams' steps take turns.
        self.arrival_order, self.arrival_s = next_arrival_order(), time.time()
        if self.language is None:
            if not final and pcm.size < DETECT_MIN_S * SAMPLE_RATE:
                return None
            logits = None
            async for item in self._sequence(
                0, pcm.size, [specials.sot], SamplingParams(max_tokens=1, probe_position=0)
            ):
                if item.probe_logits is not None:
                    logits = item.probe_logits
            self.language, self.language_probability = detect_language(logits, specials)
        prompt = specials.decoder_prompt(self.language, job.task, timestamps=True, previous=self._previous_ids())
        max_new = min(specials.max_target_positions - len(prompt), int(TOKENS_PER_S * pcm.size / SAMPLE_RATE) + 16)
        num_frames = max(1, min(pcm.size // 160, 3000))
        best = None
        for attempt, temperature in enumerate(FINAL_TEMPERATURES if final else (0.0,)):
            params = SamplingParams(
                temperature=temperature,
                seed=attempt,
                logprobs=True,
                logprobs_before_warpers=True,
                probe_position=prompt.index(specials.sot),
                logits_rules=TimestampRules(specials, begin_index=len(prompt)),
                max_tokens=max(1, max_new),
            )
            generated: list[int] = []
            logprobs: list[float] = []
            probe = None
            async for item in self._sequence(0, pcm.size, prompt, params):
                generated += item.new_token_ids
                logprobs += [lp.logprob for lp in item.logprobs or ()]
                if item.probe_logits is not None:
                    probe = item.probe_logits
                self._observe_tokens(len(item.new_token_ids))
            no_speech = no_speech_probability(probe, specials)
            mean = avg_logprob(logprobs) if logprobs else 0.0
            # openai-whisper's silence skip; or silero-vad hears no speech either (Whisper says " you" over silence
            # with a confident logprob, which openai-whisper keeps: the file path's rule, whisper_session)
            if no_speech > NO_SPEECH_THRESHOLD and (
                mean < LOGPROB_THRESHOLD or not await asyncio.to_thread(has_speech, pcm)
            ):
                return _Hypothesis([], mean, no_speech, temperature, upto)
            tokenizer = self._sessions.engine.tokenizer
            text = tokenizer.decode(specials.text_tokens(generated), skip_special_tokens=True)
            passes = text_passes(text, COMPRESSION_RATIO_THRESHOLD) and mean >= LOGPROB_THRESHOLD
            if passes or best is None or mean > best[1]:
                best = (generated, mean, no_speech, temperature, logprobs)
            if passes:
                break
        generated, mean, no_speech, temperature, logprobs = best
        if not final and not passes:
            return None  # a step that loops says nothing; the next one (or the utterance's end) decodes again
        words = await self._timed_words(start, pcm.size, num_frames, prompt, generated, logprobs, temperature)
        if start < self.utterance_start and not any(w.end > self.agreement.floor for w in words):
            # The model transcribed the context and ended there (whisper-base does, the new speech unheard): the
            # utterance is decoded without its context from now on.
            self.buffer_start = max(self.buffer_start, self.utterance_start)
            return await self._decode(upto, final)
        hypothesis = _Hypothesis(words, mean, no_speech, temperature, upto)
        self.last = hypothesis
        return hypothesis

    async def _timed_words(self, start, num_samples, num_frames, prompt, generated, logprobs, temperature):
        """The hypothesis's words in stream seconds (the alignment heads over the window's kept cross KV)."""
        specials = self.job.specials
        segments = split_window(generated, specials, 0, num_frames)[0]
        if not segments:
            return []
        plan = WindowPlan(
            0, num_frames, 0, num_samples, tuple(prompt), temperature, 0, len(generated), prompt.index(specials.sot)
        )
        offset = start / SAMPLE_RATE
        if not specials.alignment_heads:  # no alignment heads: each segment's time shared out by characters
            tokenizer = self._sessions.engine.tokenizer
            return [
                w
                for seg in segments
                for w in _spread_words(
                    tokenizer.decode(specials.text_tokens(seg.tokens), skip_special_tokens=True),
                    offset + seg.start,
                    offset + seg.end,
                )
            ]
        per_segment = await self._words(plan, segments, generated[: len(logprobs)], logprobs)
        return [TimedWord(w.word, offset + w.start, offset + w.end, w.probability) for ws in per_segment for w in ws]


def _spread_words(text: str, start: float, end: float) -> list[TimedWord]:
    """A segment's words with its time shared out in proportion to their characters."""
    words = [" " + w for w in text.split()]
    total = sum(len(w) for w in words) or 1
    out, t = [], start
    for w in words:
        d = (end - start) * len(w) / total
        out.append(TimedWord(w, t, t + d))
        t += d
    return out
