"""A ``TranscribeStream`` call's first message -> the stream's Whisper job and settings, validated."""

from __future__ import annotations

import numpy as np

from decoder_svc.realtime.realtime_session import RealtimeSettings
from decoder_svc.realtime.stream_audio import check_format
from decoder_svc.realtime.stream_vad import TurnOptions
from decoder_svc.session.inputs import RequestInput, encode_text
from decoder_svc.whisper.options import parse_whisper_options
from shared.errors import InvalidRequestError
from shared.proto import decoder_pb2


def parse_stream_config(
    config: decoder_pb2.RealtimeConfig, model, tokenizer, step_s: float
) -> tuple[RequestInput, RealtimeSettings]:
    """Validates ``config`` for ``model`` (a Whisper checkpoint).

    Returns:
        The request's input (its ``whisper`` job: language, task, prompt; the audio comes later) and settings.

    Raises:
        InvalidRequestError: a text model; an unknown language or task, one the model cannot do; a prompt too long;
            a sample rate outside 8000-48000 Hz, an unknown encoding; VAD options or step_ms out of range; word timestamps
            on a checkpoint without alignment heads.
    """
    if getattr(model, "input_modality", "audio") != "audio":
        raise InvalidRequestError("TranscribeStream takes audio: this decoder serves a text model; use Generate")
    rate, encoding = check_format(config.sample_rate, config.encoding)  # AudioError: INVALID_ARGUMENT
    turns = None
    vad = config.vad
    if not vad.disabled:
        try:
            turns = TurnOptions(
                threshold=vad.threshold if vad.HasField("threshold") else 0.5,
                silence_duration_ms=vad.silence_duration_ms if vad.HasField("silence_duration_ms") else 500,
                prefix_padding_ms=vad.prefix_padding_ms if vad.HasField("prefix_padding_ms") else 300,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
    options = decoder_pb2.WhisperOptions(
        language=config.language, task=config.task, prompt=config.prompt, timestamps=config.timestamps
    )
    job = parse_whisper_options(
        options,
        model.generation.specials,
        lambda text: encode_text(tokenizer, text, add_special_tokens=False),
        np.zeros(0, np.float32),
        decoder_pb2.SamplingParams(),
        model.config.num_mel_bins,
        "openai",
    )
    if config.HasField("step_ms"):
        least = round(step_s * 1000)
        if not least <= config.step_ms <= 10_000:
            raise InvalidRequestError(
                f"step_ms must be in [{least}, 10000] (this server re-decodes at most every {least} ms, "
                f"--realtime-step-ms), got {config.step_ms}"
            )
        step_s = config.step_ms / 1000
    settings = RealtimeSettings(
        sample_rate=rate,
        encoding=encoding,
        turns=turns,
        partials=config.partials if config.HasField("partials") else True,
        words=job.timestamps == "word",
        step_s=step_s,
    )
    return RequestInput(encoder_len=model.config.max_source_positions, pcm=job.pcm, whisper=job), settings
