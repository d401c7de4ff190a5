"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations`` (multipart, as OpenAI's API) over the
speech decoder's Generate RPC.

What the decoder gives today: the transcript (English; the model's default language), its tokens and usage.
Options that need more (another language, a prompt, translation, segment or word timestamps and the formats built
on them, ``srt`` / ``vtt``) are refused with a 400 naming the option and what to send instead, never ignored.
``verbose_json`` carries ``task``, ``language``, ``duration`` and ``text`` (no ``segments``: no timestamps yet).

The upload is read once into the Generate request (the body limit: ``gateway_svc.upload``); its duration is read
from the file's header (soundfile), not by decoding it.
"""

from __future__ import annotations

import io
import math

import grpc
import soundfile
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.datastructures import UploadFile

from gateway_svc.backends import Backends
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import bad_request, from_rpc_error
from gateway_svc.route_support import backends, config, error_event, sse, stream_messages, unless_disconnected
from gateway_svc.schemas import MAX_MODEL_NAME_LEN
from shared.proto import decoder_pb2

router = APIRouter()

FIELDS = {
    "file",
    "model",
    "language",
    "prompt",
    "response_format",
    "temperature",
    "timestamp_granularities[]",
    "stream",
    "chunking_strategy",
    "include[]",
}
FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
NEED_TIMESTAMPS = ("srt", "vtt")
ENGLISH = ("", "en", "english")
ENDPOINTS = {"transcribe": "/v1/audio/transcriptions", "translate": "/v1/audio/translations"}
# Media types an audio upload may carry (OpenAI takes flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm).
AUDIO_TYPES = ("audio/", "video/mp4", "video/webm", "video/ogg", "application/ogg", "application/octet-stream")


def _one(form, name: str) -> str | None:
    values = form.getlist(name)
    if len(values) > 1:
        raise bad_request(f"{name} is given {len(values)} times; send it once", name)
    if values and not isinstance(values[0], str):
        raise bad_request(f"{name} must be a form field, not a file", name)
    return values[0] if values else None


def _bool(form, name: str) -> bool:
    value = (_one(form, name) or "false").strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value in ("true", "1")


async def parse_form(request: Request, task: str) -> dict:
    """The checked fields of an audio request's multipart body.

    Raises:
        GatewayError: 400 naming the field: no file, an empty file, not an audio media type, an unknown field,
            a value out of range, or an option the decoder cannot serve yet.
    """
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise bad_request(f"send multipart/form-data with a 'file' part, not {content_type or 'no content type'!r}")
    form = await request.form(max_files=1, max_fields=64)
    for name in form.keys():
        if name not in FIELDS:
            raise bad_request(f"unknown field {name!r}: not a parameter of this endpoint", name)
    upload = form.get("file")
    if upload is None:
        raise bad_request("missing required field 'file' (the audio file)", "file")
    if not isinstance(upload, UploadFile):
        raise bad_request("file must be a file part (filename and content), not a text field", "file")
    media = (upload.content_type or "").lower()
    if media and not media.startswith(AUDIO_TYPES):
        raise bad_request(f"file has media type {media!r}; send an audio file (WAV or FLAC)", "file")
    model = _one(form, "model")
    if not model:
        raise bad_request("missing required field 'model'", "model")
    if len(model) > MAX_MODEL_NAME_LEN:
        raise bad_request(f"model is {len(model)} characters; the limit is {MAX_MODEL_NAME_LEN}", "model")
    response_format = _one(form, "response_format") or "json"
    if response_format not in FORMATS:
        raise bad_request(
            f"response_format must be one of {', '.join(FORMATS)}; got {response_format!r}", "response_format"
        )
    if response_format in NEED_TIMESTAMPS:
        raise bad_request(
            f"response_format {response_format!r} needs segment timestamps, which this server does not produce yet; "
            "use json, text or verbose_json",
            "response_format",
        )
    if form.getlist("timestamp_granularities[]"):
        raise bad_request(
            "timestamp_granularities[] (segment / word timestamps) is not supported by this server yet; omit it",
            "timestamp_granularities[]",
        )
    language = (_one(form, "language") or "").strip().lower()
    if language not in ENGLISH:
        raise bad_request(
            f"language {language!r} is not supported: the speech models served here transcribe English; "
            "omit language or send 'en'",
            "language",
        )
    if (_one(form, "prompt") or "").strip():
        raise bad_request("prompt is not supported by this server yet; omit it", "prompt")
    if form.getlist("include[]"):
        raise bad_request("include[] (token logprobs of a transcription) is not supported; omit it", "include[]")
    if (_one(form, "chunking_strategy") or "auto") != "auto":
        raise bad_request("chunking_strategy: only 'auto' (30 s windows) is supported", "chunking_strategy")
    raw_temperature = _one(form, "temperature")
    try:
        temperature = float(raw_temperature) if raw_temperature not in (None, "") else 0.0
    except ValueError:
        raise bad_request(f"temperature must be a number, got {raw_temperature!r}", "temperature") from None
    if not 0.0 <= temperature <= 1.0 or math.isnan(temperature):
        raise bad_request(f"temperature must be in [0, 1], got {raw_temperature}", "temperature")
    if task == "translate":
        raise bad_request(
            "translation is not supported: the speech models served here transcribe only; use /v1/audio/transcriptions",
            "model",
        )
    data = await upload.read()
    await upload.close()
    if not data:
        raise bad_request("file is empty; send an audio file", "file")
    return {
        "model": model,
        "data": data,
        "response_format": response_format,
        "temperature": temperature,
        "stream": _bool(form, "stream"),
    }


def duration_s(data: bytes) -> float | None:
    """The audio's length in seconds from its header; None if soundfile cannot read it (the decoder decides)."""
    try:
        return float(soundfile.info(io.BytesIO(data)).duration)
    except Exception:  # noqa: BLE001 - any unreadable header: no duration, the decoder answers for the audio
        return None


async def _transcribe(request: Request, b: Backends, cfg: GatewayConfig, task: str):
    fields = await parse_form(request, task)
    backend = await b.lookup(fields["model"], ("audio",), ENDPOINTS[task])
    duration = duration_s(fields["data"])
    generate = decoder_pb2.GenerateRequest(
        model=b.wire_name(fields.pop("model")),
        audio=fields.pop("data"),
        sampling=decoder_pb2.SamplingParams(temperature=fields["temperature"]),
    )
    call = backend.decoder.Generate(generate, timeout=cfg.request_timeout_s)
    try:
        first = await unless_disconnected(request, call.read())
    except BaseException:
        call.cancel()
        raise
    if fields["stream"]:
        return sse(_events(call, first))
    text = (await unless_disconnected(request, _collect(call, first))).strip()
    if fields["response_format"] == "text":
        return PlainTextResponse(text)
    body: dict = {"text": text}
    if fields["response_format"] == "verbose_json":
        body = {"task": "transcribe", "language": "english", "duration": duration, "text": text}
    if duration is not None:
        body["usage"] = {"type": "duration", "seconds": math.ceil(duration)}
    return JSONResponse(body)


async def _collect(call, first) -> str:
    """The whole text of the stream (``first`` already read)."""
    try:
        return "".join([message.text async for message in stream_messages(call, first)])
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    finally:
        call.cancel()


async def _events(call, first):
    """OpenAI's streaming transcription events: ``transcript.text.delta`` per message with text, then
    ``transcript.text.done`` with the whole text and token usage."""
    parts = []
    try:
        async for message in stream_messages(call, first):
            delta = message.text if parts else message.text.lstrip()
            if delta:
                parts.append(delta)
                yield {"type": "transcript.text.delta", "delta": delta}
            if message.HasField("usage"):
                usage = message.usage
                tokens = {
                    "type": "tokens",
                    "input_tokens": usage.encoder_tokens,
                    "output_tokens": usage.completion_tokens,
                    "total_tokens": usage.encoder_tokens + usage.completion_tokens,
                }
                yield {"type": "transcript.text.done", "text": "".join(parts).rstrip(), "usage": tokens}
    except grpc.RpcError as exc:
        yield error_event(exc)
    finally:
        call.cancel()


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request, b: Backends = Depends(backends), cfg: GatewayConfig = Depends(config)):
    return await _transcribe(request, b, cfg, "transcribe")


@router.post("/v1/audio/translations")
async def translations(request: Request, b: Backends = Depends(backends), cfg: GatewayConfig = Depends(config)):
    return await _transcribe(request, b, cfg, "translate")
