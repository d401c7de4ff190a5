"""A Whisper request's options, validated: ``WhisperOptions`` proto -> ``WhisperJob``.

Defaults are OpenAI's ``transcribe()`` / faster-whisper's (temperature
fallback 0.0 .. 1.0 in steps of 0.2, compression ratio 2.4, logprob -1.0,
no-speech 0.6, conditioning on the previous text). Short-form (one window,
text streamed as decoded) is audio of at most 30 s with no timestamps and no
VAD; anything else runs the long-form algorithm (``decoder_svc.whisper.longform``).
The VAD runs here (the servicer parses on a worker thread), so the job holds
the speech audio the encoder will see and the map back to the original time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from decoder_svc.whisper.quality import FallbackRules
from shared.errors import InvalidRequestError
from shared.models.whisper_features import log_mel_frames
from shared.models.whisper_specials import WhisperLanguageError, WhisperSpecials, language_code
from shared.proto import decoder_pb2

SAMPLE_RATE = 16_000
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # Whisper's 30 s input window
DEFAULT_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)  # openai-whisper transcribe() / HF long-form
MAX_TEMPERATURES = 16
MAX_PROMPT_CHARS = 4096
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

    @property
    def long_form(self) -> bool:
        return len(self.pcm) > WINDOW_SAMPLES or self.timestamps != "none" or self.speech_map is not None

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
) -> WhisperJob:
    """Validates ``pb`` for a checkpoint and builds the job (runs the VAD when asked).

    Args:
        pb: the request's ``whisper`` field (all defaults when unset).
        encode: text -> token ids with the checkpoint's tokenizer, no special tokens (the prompt's).
        pcm: ``[N]`` float32 16 kHz decoded audio.
        num_mel_bins: the checkpoint's log-mel bins (the whole clip's features are computed here).
        sampling: the request's sampling params: with no ``temperatures`` list, a ``temperature``
            above 0 is the only temperature tried (no fallback); long-form decoding refuses the
            token-level settings it cannot honour (``LONG_FORM_REFUSED``).

    Raises:
        InvalidRequestError: unknown language or task, a language / translate an English-only
            model cannot do, a temperature outside [0, 1], a threshold that is not finite,
            a prompt over ``MAX_PROMPT_CHARS`` characters, bad VAD options, a sampling setting
            long-form decoding does not take.
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
    rules = _fallback_rules(pb, sampling.temperature)
    prompt_ids: list[int] = []
    if pb.prompt.strip():
        if len(pb.prompt) > MAX_PROMPT_CHARS:
            raise InvalidRequestError(f"prompt is {len(pb.prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
        # HF keeps the last max_target_positions // 2 - 1 (223) ids of the previous text: so does every window.
        prompt_ids = specials.text_tokens(encode(" " + pb.prompt.strip()))[-(specials.max_target_positions // 2 - 1) :]
    duration_s = len(pcm) / SAMPLE_RATE
    speech_map = None
    if pb.vad_filter:
        from decoder_svc.whisper.vad import SpeechMap, VadOptions, speech_regions

        v = pb.vad
        try:
            vad = VadOptions(
                **{
                    name: getattr(v, name)
                    for name in ("threshold", "min_silence_duration_ms", "speech_pad_ms")
                    if v.HasField(name)
                }
            )
        except ValueError as exc:
            raise InvalidRequestError(f"vad: {exc}") from None
        speech_map = SpeechMap(speech_regions(pcm, vad), len(pcm))
        pcm = speech_map.speech_pcm(pcm)
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
    )
    if job.long_form:
        _check_long_form_sampling(sampling)
    return job


# Token-level sampling settings long-form decoding cannot honour: each window is decoded with Whisper's own rules
# (timestamps, fallback temperatures) and judged whole.
LONG_FORM_REFUSED = (
    "top_k",
    "top_p",
    "min_p",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "include_stop_str_in_output",
    "logprobs",
    "top_logprobs",
)
MAX_LANGUAGE_CHARS = 32  # the longest language name Whisper knows is 16 characters


def _check_long_form_sampling(sampling: decoder_pb2.SamplingParams) -> None:
    set_fields = [name for name in LONG_FORM_REFUSED if sampling.HasField(name)]
    set_fields += [name for name in ("stop", "stop_token_ids") if len(getattr(sampling, name))]
    if set_fields:
        raise InvalidRequestError(
            f"sampling.{set_fields[0]} is not supported with long-form Whisper decoding (audio over 30 s, "
            "timestamps or vad_filter): each window is decoded with Whisper's own rules; leave it unset"
        )


def _language_code(language: str) -> str | None:
    """An ISO code from a code or an English language name (``"German"`` -> ``"de"``), or None when empty."""
    language = language.strip()
    if len(language) > MAX_LANGUAGE_CHARS:
        raise InvalidRequestError(
            f"language is {len(language)} characters long; send an ISO 639-1 code ('en', 'de') or a language name"
        )
    return language_code(language) or None


def _fallback_rules(pb: decoder_pb2.WhisperOptions, sampling_temperature: float) -> FallbackRules:
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

    return FallbackRules(
        temperatures=temps,
        compression_ratio_threshold=threshold("compression_ratio_threshold", 2.4),
        logprob_threshold=threshold("logprob_threshold", -1.0),
        no_speech_threshold=threshold("no_speech_threshold", 0.6),
    )
