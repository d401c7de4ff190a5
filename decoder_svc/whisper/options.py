"""A Whisper request's options, validated: ``WhisperOptions`` proto -> ``WhisperJob``.

Defaults are OpenAI's ``transcribe()`` / faster-whisper's (temperature
fallback 0.0 .. 1.0 in steps of 0.2, compression ratio 2.4, logprob -1.0,
no-speech 0.6, best_of 5, conditioning on the previous text until a window
is decoded above 0.5). Under ``"openai"`` decoding rules every request runs the
window loop (``decoder_svc.whisper.longform``) with its fallback, except one of
at most 30 s without timestamps that sets a token-level sampling option
(``TOKEN_LEVEL``): that one, and under ``"hf"`` rules any audio of at most 30 s
with no timestamps and no VAD, is short-form (one window, text streamed as
decoded, no fallback). The VAD runs here (the servicer parses on a worker
thread): ``vad_filter`` keeps the speech audio the encoder will see and the map
back to the original time; the VAD gate keeps the audio and gives the clips
to decode (``decoder_svc.whisper.clips``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from decoder_svc.whisper.clips import (
    DEFAULT_GATE_MIN_SILENCE_S,
    Clip,
    gate_clips,
    intersect_clips,
    parse_clip_timestamps,
)
from decoder_svc.whisper.quality import (
    DECODING_RULES,
    DEFAULT_BEST_OF,
    MAX_BEST_OF,
    PROMPT_RESET_ON_TEMPERATURE,
    FallbackRules,
)
from shared.errors import InvalidRequestError
from shared.models.whisper_features import log_mel_frames
from shared.models.whisper_specials import WhisperLanguageError, WhisperSpecials, language_code
from shared.proto import decoder_pb2

SAMPLE_RATE = 16_000
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # Whisper's 30 s input window
DEFAULT_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # openai-whisper transcribe() / HF long-form
MAX_TEMPERATURES = 16
MAX_PROMPT_CHARS = 4096
MAX_LANGUAGE_DETECTION_SEGMENTS = 20  # 10 minutes of windows
HOP_LENGTH = 160
TIMESTAMPS = {
    decoder_pb2.TIMESTAMP_GRANULARITY_NONE: "none",
    decoder_pb2.TIMESTAMP_GRANULARITY_SEGMENT: "segment",
    decoder_pb2.TIMESTAMP_GRANULARITY_WORD: "word",
}


@dataclass
class WhisperJob:
    """What the Whisper session needs of one request.

    Attributes:
        specials: the checkpoint's special tokens.
        language: ISO code, or None = detect on the first window.
        task: ``"transcribe"`` / ``"translate"``.
        prompt_ids: text tokens of the initial prompt (``" " + prompt.strip()``, HF ``get_prompt_ids``).
        timestamps: ``"none"`` / ``"segment"`` / ``"word"``.
        condition_on_previous_text: long-form: prompt each window with the previous text.
        rules: temperatures and thresholds (``decoder_svc.whisper.quality.FallbackRules``).
        pcm: ``[N]`` float32 16 kHz: the audio the model sees (the speech regions only with VAD).
        duration_s: the original audio's length in seconds.
        speech_map: VAD's map from ``pcm`` time to original time (``decoder_svc.whisper.vad.SpeechMap``), or None.
        features: ``[num_mel_bins, N // 160]`` log-mel of the whole ``pcm`` when it is over 30 s (HF long-form
            feeds each window its slice of these, ``whisper_features.window_features``), else None.
        token_stream: short-form: one window streamed token by token, no fallback (module docstring).
        clips: ``"openai"`` rules: the mel-frame ranges to decode (``clip_timestamps`` within the VAD gate), or
            None for all of ``pcm``.
        gate_regions: the VAD gate's speech regions (``(start, end)`` samples of ``pcm``), or None without the gate.
        hallucination_silence_threshold: seconds, or None (``decoder_svc.whisper.word_seek``).
        language_detection_segments, language_detection_threshold: faster-whisper's options: detection on up
            to that many 30 s windows of speech, the first whose top language is above the threshold deciding.
    """

    specials: WhisperSpecials
    language: str | None
    task: str
    prompt_ids: list[int]
    timestamps: str
    condition_on_previous_text: bool
    rules: FallbackRules
    pcm: np.ndarray
    duration_s: float
    speech_map: object | None = None
    features: np.ndarray | None = None
    token_stream: bool = False
    clips: list[Clip] | None = None
    gate_regions: list[tuple[int, int]] | None = None
    hallucination_silence_threshold: float | None = None
    language_detection_segments: int = 1
    language_detection_threshold: float = 0.5

    @property
    def long_form(self) -> bool:
        """Decoded by the window loop (``decoder_svc.whisper.longform``), not short-form."""
        return not self.token_stream

    @property
    def word_timing(self) -> bool:
        """Each accepted window's words are timed: asked for, or for ``hallucination_silence_threshold``."""
        return self.timestamps == "word" or self.hallucination_silence_threshold is not None

    def speech_span(self, start: float, end: float) -> tuple[float, float]:
        """A segment's ``[start, end]`` (seconds of ``pcm``) cut to the VAD gate's speech regions it overlaps.

        Whisper often times a segment's end at its window's end, which the gate pads past the speech
        (``clips.DEFAULT_GATE_PAD_S``), or its start at a window start before the speech: a segment that closes a
        clip would then reach up to ~0.8 s into the silence after it. The regions carry silero's own 400 ms padding
        (``vad.VadOptions.speech_pad_ms``), so what is cut is silence. Without the gate, or when the segment
        overlaps no region, the span is returned as it is; otherwise ``start <= end`` still holds.
        """
        regions = self.gate_regions
        if not regions or end <= start:
            return start, end
        a, b = start * SAMPLE_RATE, end * SAMPLE_RATE
        first = bisect.bisect_right(regions, a, key=lambda r: r[1])  # sorted and apart: the first ending after a
        last = bisect.bisect_left(regions, b, key=lambda r: r[0])  # the regions starting before b end at last - 1
        if first >= last:  # no region overlaps
            return start, end
        lo, hi = regions[first][0] / SAMPLE_RATE, regions[last - 1][1] / SAMPLE_RATE
        start = min(max(start, lo), hi)
        return start, max(min(end, hi), start)

    def original_time(self, t: float) -> float:
        """Seconds in ``pcm`` -> seconds in the original audio (identity without VAD), clipped to its length."""
        if self.speech_map is not None:
            t = self.speech_map.original_time(t)
        return min(max(t, 0.0), self.duration_s)


def parse_whisper_options(
    pb: decoder_pb2.WhisperOptions,
    specials: WhisperSpecials,
    encode: Callable[[str], list[int]],
    pcm: np.ndarray,
    sampling: decoder_pb2.SamplingParams,
    num_mel_bins: int = 80,
    decoding_rules: str = "openai",
) -> WhisperJob:
    """Validates ``pb`` for a checkpoint and builds the job (runs the VAD when asked or gating).

    Args:
        pb: the request's ``whisper`` field (all defaults when unset).
        encode: text -> token ids with the checkpoint's tokenizer, no special tokens (the prompt's).
        pcm: ``[N]`` float32 16 kHz decoded audio.
        num_mel_bins: the checkpoint's log-mel bins (the whole clip's features are computed here).
        sampling: the request's sampling params: with no ``temperatures`` list, a ``temperature``
            above 0 is the only temperature tried (no fallback); long-form decoding refuses the
            token-level settings it cannot honour (``LONG_FORM_REFUSED``).
        decoding_rules: the decoder's default (``--decoding-rules``) when ``pb.decoding_rules`` is empty.

    Raises:
        InvalidRequestError: unknown language, task or decoding rules, a language / translate an English-only
            model cannot do, a temperature outside [0, 1], a threshold that is not finite, a probability
            (``no_speech_threshold``, ``language_detection_threshold``) outside [0, 1],
            a prompt over ``MAX_PROMPT_CHARS`` characters, bad VAD, clip or language-detection options,
            openai-only options under ``"hf"`` rules, a sampling setting long-form decoding does not take.
    """
    language = _language_code(pb.language)
    task = pb.task.strip().lower() or "transcribe"
    try:
        specials.check(language, task)
    except WhisperLanguageError as exc:
        raise InvalidRequestError(str(exc)) from None
    if language is None and not specials.multilingual:
        language = "en"
    if pb.timestamps not in TIMESTAMPS:
        raise InvalidRequestError(f"timestamps must be NONE, SEGMENT or WORD, got {pb.timestamps}")
    timestamps = TIMESTAMPS[pb.timestamps]
    if timestamps == "word" and not specials.alignment_heads:
        raise InvalidRequestError("word timestamps need the checkpoint's alignment_heads, which this model lacks")
    rules_name = pb.decoding_rules.strip().lower() or decoding_rules
    if rules_name not in DECODING_RULES:
        raise InvalidRequestError(
            f"decoding_rules must be one of {', '.join(DECODING_RULES)}, got {pb.decoding_rules!r}"
        )
    openai = rules_name == "openai"
    _check_openai_only(pb, openai)
    rules = _fallback_rules(pb, sampling.temperature, rules_name)
    prompt_ids: list[int] = []
    if pb.prompt.strip():
        if len(pb.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(f"prompt is {len(pb.prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
        # HF keeps the last max_target_positions // 2 - 1 (223) ids of the previous text: so does every window.
        prompt_ids = specials.text_tokens(encode(" " + pb.prompt.strip()))[-(specials.max_target_positions // 2 - 1) :]
    duration_s = len(pcm) / SAMPLE_RATE
    speech_map = None
    if pb.vad_filter:
        from decoder_svc.whisper.vad import SpeechMap, speech_regions

        speech_map = SpeechMap(speech_regions(pcm, _vad_options(pb)), len(pcm))
        pcm = speech_map.speech_pcm(pcm)
    short = len(pcm) <= WINDOW_SAMPLES and timestamps == "none" and speech_map is None
    token_stream = short and (not openai or _token_level(sampling))
    clips = regions = None
    if openai and not token_stream:
        clips, regions = _clips(pb, pcm, gate=speech_map is None)
    features = log_mel_frames(pcm, num_mel_bins) if len(pcm) > WINDOW_SAMPLES else None
    job = WhisperJob(
        features=features,
        specials=specials,
        language=language,
        task=task,
        prompt_ids=prompt_ids,
        timestamps=timestamps,
        condition_on_previous_text=pb.condition_on_previous_text if pb.HasField("condition_on_previous_text") else True,
        rules=rules,
        pcm=pcm,
        duration_s=duration_s,
        speech_map=speech_map,
        token_stream=token_stream,
        clips=clips,
        gate_regions=regions,
        hallucination_silence_threshold=_seconds(pb, "hallucination_silence_threshold", None),
        language_detection_segments=_detection_segments(pb),
        language_detection_threshold=_probability(pb, "language_detection_threshold", 0.5),
    )
    if job.long_form:
        _check_long_form_sampling(sampling)
    return job


# Options only openai-whisper's loop has; refused under "hf" rules (HF generate has no such thing).
OPENAI_ONLY = (
    "best_of",
    "prompt_reset_on_temperature",
    "hallucination_silence_threshold",
    "vad_gate",
    "vad_gate_min_silence_s",
    "language_detection_segments",
    "language_detection_threshold",
)


def _check_openai_only(pb: decoder_pb2.WhisperOptions, openai: bool) -> None:
    if openai:
        return
    set_fields = [name for name in OPENAI_ONLY if pb.HasField(name) and not (name == "vad_gate" and not pb.vad_gate)]
    if len(pb.clip_timestamps):
        set_fields.append("clip_timestamps")
    if set_fields:
        raise InvalidRequestError(
            f"{set_fields[0]} is an option of openai-whisper's decoding rules; this request has decoding_rules "
            "'hf': leave it unset or use decoding_rules 'openai'"
        )


def _vad_options(pb: decoder_pb2.WhisperOptions, **defaults):
    from decoder_svc.whisper.vad import VadOptions

    v = pb.vad
    try:
        return VadOptions(
            **{
                **defaults,
                **{
                    name: getattr(v, name)
                    for name in ("threshold", "min_silence_duration_ms", "speech_pad_ms")
                    if v.HasField(name)
                },
            }
        )
    except ValueError as exc:
        raise InvalidRequestError(f"vad: {exc}") from None


def warm_audio_front_end(num_mel_bins: int) -> None:
    """Loads what a Whisper request's options parsing first uses: silero-vad (the VAD gate, ``vad_filter``) and the
    long-form log-mel extractor (transformers' ``WhisperFeatureExtractor``, imported and built once). Called at the
    decoder's start; without it the first request of each kind pays for the loads."""
    from decoder_svc.whisper.vad import load_vad_model, speech_probabilities

    load_vad_model()
    speech_probabilities(np.zeros(SAMPLE_RATE, np.float32))  # the TorchScript model's first calls
    log_mel_frames(np.zeros(SAMPLE_RATE, np.float32), num_mel_bins)


def _clips(pb: decoder_pb2.WhisperOptions, pcm: np.ndarray, gate: bool):
    """The frames to decode, ``clip_timestamps`` within the VAD gate's clips (None = all of ``pcm``), and the
    gate's speech regions (None without the gate)."""
    total = len(pcm) // HOP_LENGTH
    clips = regions = None
    if len(pb.clip_timestamps):
        try:
            clips = parse_clip_timestamps(list(pb.clip_timestamps), total)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
    if gate and (pb.vad_gate if pb.HasField("vad_gate") else True) and len(pcm):
        from decoder_svc.whisper.vad import SILENCE_CHECK_MIN_SPEECH_MS, speech_regions

        min_silence = _seconds(pb, "vad_gate_min_silence_s", DEFAULT_GATE_MIN_SILENCE_S)
        # A region needs 250 ms of speech (silero's own default): clicks and breaths open no window.
        vad = _vad_options(pb, min_speech_duration_ms=SILENCE_CHECK_MIN_SPEECH_MS)
        regions = speech_regions(pcm, vad, batched=True)
        gated = gate_clips(regions, len(pcm), min_silence)
        clips = gated if clips is None else intersect_clips(clips, gated)
    return clips, regions


def _seconds(pb: decoder_pb2.WhisperOptions, name: str, default: float | None) -> float | None:
    if not pb.HasField(name):
        return default
    value = getattr(pb, name)
    if not (math.isfinite(value) and value >= 0):
        raise InvalidRequestError(f"{name} must be seconds >= 0, got {value}")
    return float(value)


def _probability(pb: decoder_pb2.WhisperOptions, name: str, default: float, kind: str = "a probability") -> float:
    """``pb.<name>``, a value in [0, 1] (a probability, or ``kind``), or ``default`` when unset.

    Raises:
        InvalidRequestError: NaN, infinite or outside [0, 1]; the message names the option and what it is.
    """
    if not pb.HasField(name):
        return default
    value = getattr(pb, name)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise InvalidRequestError(f"{name} must be in [0, 1] ({kind}), got {value:g}")
    return float(value)


def _detection_segments(pb: decoder_pb2.WhisperOptions) -> int:
    if not pb.HasField("language_detection_segments"):
        return 1
    n = pb.language_detection_segments
    if not 1 <= n <= MAX_LANGUAGE_DETECTION_SEGMENTS:
        raise InvalidRequestError(
            f"language_detection_segments must be in [1, {MAX_LANGUAGE_DETECTION_SEGMENTS}], got {n}"
        )
    return n


# Sampling settings that ask for control over each token: a short clip with one of them is decoded once and
# streamed token by token (no fallback can honour them), under either rules.
TOKEN_LEVEL = ("top_k", "top_p", "min_p", "min_tokens", "ignore_eos", "logprobs", "top_logprobs",
               "include_stop_str_in_output")  # fmt: skip


def _token_level(sampling: decoder_pb2.SamplingParams) -> bool:
    return any(sampling.HasField(name) for name in TOKEN_LEVEL) or bool(
        len(sampling.stop) or len(sampling.stop_token_ids)
    )


# Token-level sampling settings long-form decoding cannot honour: each window is decoded with Whisper's own rules
# (timestamps, fallback temperatures) and judged whole.
LONG_FORM_REFUSED = TOKEN_LEVEL
MAX_LANGUAGE_CHARS = 32  # the longest language name Whisper knows is 16 characters


def _check_long_form_sampling(sampling: decoder_pb2.SamplingParams) -> None:
    set_fields = [name for name in LONG_FORM_REFUSED if sampling.HasField(name)]
    set_fields += [name for name in ("stop", "stop_token_ids") if len(getattr(sampling, name))]
    if set_fields:
        raise InvalidRequestError(
            f"sampling.{set_fields[0]} is not supported with long-form Whisper decoding (audio over 30 s, "
            "timestamps or vad_filter): each window is decoded with Whisper's own rules and judged whole; "
            "leave it unset"
        )


def _language_code(language: str) -> str | None:
    """An ISO code from a code or an English language name (``"German"`` -> ``"de"``), or None when empty."""
    language = language.strip()
    if len(language) > MAX_LANGUAGE_CHARS:
        raise InvalidRequestError(
            f"language is {len(language)} characters long; send an ISO 639-1 code ('en', 'de') or a language name"
        )
    return language_code(language) or None


def _fallback_rules(pb: decoder_pb2.WhisperOptions, sampling_temperature: float, decoding_rules: str) -> FallbackRules:
    temps = tuple(float(t) for t in pb.temperatures)
    if len(temps) > MAX_TEMPERATURES:
        raise InvalidRequestError(f"temperatures has {len(temps)} entries; at most {MAX_TEMPERATURES} are allowed")
    if any(not (math.isfinite(t) and 0.0 <= t <= 1.0) for t in temps):
        raise InvalidRequestError(f"each temperature must be in [0, 1], got {list(temps)}")
    if not temps:
        temps = (sampling_temperature,) if sampling_temperature > 0 else DEFAULT_TEMPERATURES

    def threshold(name: str, default: float) -> float | None:
        if not pb.HasField(name):
            return default
        value = getattr(pb, name)
        if not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number, got {value}")
        return value

    best_of = pb.best_of if pb.HasField("best_of") else DEFAULT_BEST_OF
    if not 1 <= best_of <= MAX_BEST_OF:
        raise InvalidRequestError(f"best_of must be in [1, {MAX_BEST_OF}], got {best_of}")
    return FallbackRules(
        temperatures=temps,
        compression_ratio_threshold=threshold("compression_ratio_threshold", 2.4),
        logprob_threshold=threshold("logprob_threshold", -1.0),
        no_speech_threshold=_probability(pb, "no_speech_threshold", 0.6),
        decoding_rules=decoding_rules,
        best_of=best_of,
        prompt_reset_on_temperature=_probability(
            pb, "prompt_reset_on_temperature", PROMPT_RESET_ON_TEMPERATURE, "a sampling temperature"
        ),
    )
