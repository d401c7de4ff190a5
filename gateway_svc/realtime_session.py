"""A realtime session's settings: the ``session.update`` / ``transcription_session.update`` events of OpenAI's beta
shape (``session.input_audio_format``, ``session.input_audio_transcription``, ``session.turn_detection``), its GA
shape (``session.audio.input.{format, transcription, turn_detection}``) and vLLM's (``{"type": "session.update",
"model": ...}``) -> ``SessionConfig`` (``apply_update``) -> the stream's first message (``realtime_config``), and
back to the ``session`` object of ``session.created`` / ``session.updated`` (``session_object``). Pure functions.

Field names and defaults: https://platform.openai.com/docs/api-reference/realtime-client-events/session/update
(beta and GA) and vLLM's ``vllm/entrypoints/openai/realtime/protocol.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway_svc.realtime_events import EventError
from shared.proto import decoder_pb2

OPENAI_RATE = 24_000  # OpenAI's "pcm16" / "audio/pcm": 24 kHz mono s16le
VLLM_RATE = 16_000  # vLLM's realtime clients send 16 kHz PCM16 (its models' rate, not resampled there)
MIN_RATE, MAX_RATE = 8_000, 48_000  # what TranscribeStream resamples (RealtimeConfig.sample_rate)
# The decoder's server_vad defaults (RealtimeVad, OpenAI's): shown in session.created / session.updated.
VAD_DEFAULTS = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}


@dataclass(frozen=True)
class TurnDetection:
    """``server_vad`` settings; None = the decoder's default (``VAD_DEFAULTS``)."""

    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None


@dataclass(frozen=True)
class SessionConfig:
    """What a stream is opened with; every field is fixed while a stream runs.

    Attributes:
        model: the transcription model ("" = the query's ``model``, else the one speech model served).
        language: ISO code or English name; "" = detected (multilingual models).
        prompt: the first utterance's previous text.
        sample_rate: Hz of the client's PCM16 (resampled by the decoder).
        turn_detection: server VAD settings, or None: no VAD (an utterance ends at a commit).
    """

    model: str = ""
    language: str = ""
    prompt: str = ""
    sample_rate: int = OPENAI_RATE
    turn_detection: TurnDetection | None = TurnDetection()


def apply_update(config: SessionConfig, update: dict) -> tuple[SessionConfig, str]:
    """``config`` with a ``session.update`` / ``transcription_session.update`` applied, and the shape it came in:
    ``"beta"``, ``"ga"`` (``session.audio.input``) or ``"vllm"`` (no ``session`` object).

    Fields this gateway has no use for (``noise_reduction``, ``include``, ``instructions``...) are ignored.

    Raises:
        EventError: a field of the wrong type or out of range; an audio format other than PCM16
            (``unsupported_audio_format``); ``semantic_vad``.
    """
    session = update.get("session")
    if session is None:  # vLLM: {"type": "session.update", "model": ..., "language": ...}
        fields = _transcription(update, "")
        rate = update.get("input_audio_sample_rate")
        fields["sample_rate"] = VLLM_RATE if rate is None else _rate(rate, "input_audio_sample_rate")
        return dataclasses.replace(config, **fields), "vllm"
    _object(session, "session")
    fields: dict = {}
    shape = "beta"
    if "input_audio_format" in session:
        fields["sample_rate"] = _beta_format(session["input_audio_format"])
    if session.get("input_audio_transcription", {}) is None:
        fields.update(model="", language="", prompt="")
    else:
        fields.update(_transcription(session.get("input_audio_transcription", {}), "session.input_audio_transcription"))
    if "turn_detection" in session:
        fields["turn_detection"] = _turn_detection(session["turn_detection"], "session.turn_detection")
    audio_input = _object(_object(session.get("audio", {}), "session.audio").get("input", {}), "session.audio.input")
    if "audio" in session:
        shape = "ga"
        if "format" in audio_input:
            fields["sample_rate"] = _ga_format(audio_input["format"])
        if audio_input.get("transcription", {}) is None:
            fields.update(model="", language="", prompt="")
        else:
            fields.update(_transcription(audio_input.get("transcription", {}), "session.audio.input.transcription"))
        if "turn_detection" in audio_input:
            param = "session.audio.input.turn_detection"
            fields["turn_detection"] = _turn_detection(audio_input["turn_detection"], param)
    if session.get("input_audio_sample_rate") is not None:  # our extension, any shape
        fields["sample_rate"] = _rate(session["input_audio_sample_rate"], "session.input_audio_sample_rate")
    return dataclasses.replace(config, **fields), shape


def changed_fields(old: SessionConfig, new: SessionConfig) -> list[str]:
    """The fields of ``new`` that differ from ``old``."""
    return [f.name for f in dataclasses.fields(SessionConfig) if getattr(old, f.name) != getattr(new, f.name)]


def realtime_config(
    config: SessionConfig, *, model: str, language: str, partials: bool, request_id: str = ""
) -> decoder_pb2.RealtimeConfig:
    """The first message of the stream: ``config`` with the decoder's name for the model, an ISO language and the
    stream's request id (its Redis record: ``GetRequest``)."""
    if config.turn_detection is None:
        vad = decoder_pb2.RealtimeVad(disabled=True)
    else:
        given = dataclasses.asdict(config.turn_detection)
        vad = decoder_pb2.RealtimeVad(**{k: v for k, v in given.items() if v is not None})
    return decoder_pb2.RealtimeConfig(
        model=model,
        request_id=request_id,
        language=language,
        prompt=config.prompt,
        sample_rate=config.sample_rate,
        encoding="pcm_s16le",
        vad=vad,
        partials=partials,
    )


def session_object(config: SessionConfig, session_id: str) -> dict:
    """The ``session`` of ``session.created`` / ``session.updated``, in the beta and the GA shape at once (each
    client reads its own fields)."""
    transcription = {"model": config.model or None, "language": config.language or None, "prompt": config.prompt}
    turn = None
    if config.turn_detection is not None:
        given = {k: v for k, v in dataclasses.asdict(config.turn_detection).items() if v is not None}
        turn = {"type": "server_vad", **VAD_DEFAULTS, **given}
    return {
        "id": session_id,
        "object": "realtime.transcription_session",
        "type": "transcription",
        "input_audio_format": "pcm16",
        "input_audio_sample_rate": config.sample_rate,
        "input_audio_transcription": transcription,
        "turn_detection": turn,
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": config.sample_rate},
                "transcription": transcription,
                "turn_detection": turn,
            }
        },
    }


# -- field checks ------------------------------------------------------------------------------------------


def _object(value, param: str) -> dict:
    if not isinstance(value, dict):
        raise EventError(f"{param} must be an object", param)
    return value


def _rate(value, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_RATE <= value <= MAX_RATE:
        raise EventError(f"{param} must be an integer sample rate in [{MIN_RATE}, {MAX_RATE}] Hz, got {value!r}", param)
    return value


def _unsupported(name: str, param: str) -> EventError:
    return EventError(
        f"audio format {name!r} is not supported: send PCM16 (mono, little-endian; 'pcm16' / 'audio/pcm')",
        param,
        "unsupported_audio_format",
    )


def _beta_format(value) -> int:
    param = "session.input_audio_format"
    if value == "pcm16":
        return OPENAI_RATE
    raise _unsupported(str(value), param)


def _ga_format(value) -> int:
    param = "session.audio.input.format"
    if isinstance(value, str):  # the beta name where GA takes an object
        return _beta_format(value)
    kind = _object(value, param).get("type", "audio/pcm")
    if kind != "audio/pcm":
        raise _unsupported(str(kind), param + ".type")
    return OPENAI_RATE if value.get("rate") is None else _rate(value["rate"], param + ".rate")


def _transcription(value, param: str) -> dict:
    """``model`` / ``language`` / ``prompt`` given in a transcription object (or vLLM's update)."""
    prefix = f"{param}." if param else ""
    out = {}
    for name in ("model", "language", "prompt"):
        if _object(value, param or "event").get(name) is None:
            continue
        if not isinstance(value[name], str):
            raise EventError(f"{prefix}{name} must be a string", prefix + name)
        out[name] = value[name].strip() if name != "prompt" else value[name]
    return out


def _turn_detection(value, param: str) -> TurnDetection | None:
    if value is None:
        return None
    _object(value, param)
    kind = value.get("type", "server_vad")
    if kind != "server_vad":
        raise EventError(f"{param}.type {kind!r} is not supported: use 'server_vad', or null for none", f"{param}.type")
    fields = {}
    for name, low, high, integer in (
        ("threshold", 0.0, 1.0, False),
        ("prefix_padding_ms", 0, 10_000, True),
        ("silence_duration_ms", 0, 10_000, True),
    ):
        given = value.get(name)
        if given is None:
            continue
        number = isinstance(given, int) if integer else isinstance(given, int | float)
        if isinstance(given, bool) or not number or not low <= given <= high:
            what = "an integer" if integer else "a number"
            raise EventError(f"{param}.{name} must be {what} in [{low}, {high}], got {given!r}", f"{param}.{name}")
        fields[name] = given
    return TurnDetection(**fields)
