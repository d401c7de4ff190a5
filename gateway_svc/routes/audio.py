"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations`` (multipart, as OpenAI's API) over the
speech decoder's Generate RPC, its ``WhisperOptions`` filled from the form.

OpenAI's fields map onto ``WhisperOptions``: ``language`` (ISO code, or OpenAI-style name "german"), ``prompt``,
``temperature`` (0 = the automatic fallback 0.0 .. 1.0; above 0: that temperature only), the endpoint's task
(translations: "translate", language optional), and the timestamps the format needs: ``verbose_json`` / ``srt`` /
``vtt`` ask for segments, ``timestamp_granularities[]`` "word" (``verbose_json`` only, as OpenAI) for words too.
The bodies are OpenAI's: ``verbose_json`` ``{task, language (its English name), duration, text, segments, words,
usage}``, ``srt`` / ``vtt`` as text (``shared.subtitles``). What the model cannot do (a language or translation on
an English-only model) is the decoder's INVALID_ARGUMENT, answered as a 400 naming the field.

The decoder reads every audio and video format FFmpeg does (``decoder_svc.session.audio``); the gateway never
decodes. The upload (spooled by Starlette, to disk past 1 MB; the body limit: ``gateway_svc.upload``) is read once,
straight into the serialized Generate request (``generate_wire``), so the gateway holds one copy of the audio per
request (two for the instant gRPC's ``bytes`` is made), not the read bytes, protobuf's copy and its serialization;
and only until gRPC has sent it (``OneShot``), not for the whole call: a queued or long transcription holds its
spooled file on disk, closed, and no audio in memory. The duration reported is the decoder's.
"""

from __future__ import annotations

import asyncio
import functools
import math

import grpc
import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from starlette.datastructures import UploadFile

from gateway_svc.backends import Backends
from gateway_svc.config import GatewayConfig
from gateway_svc.errors import GatewayError, bad_request, building_request, from_rpc_error
from gateway_svc.route_support import backends, config, json_response, sse, stream_messages, unless_disconnected
from gateway_svc.schemas import MAX_MODEL_NAME_LEN
from gateway_svc.upload import read_form
from shared.models.whisper_specials import language_code
from shared.proto import decoder_pb2
from shared.subtitles import to_srt, to_vtt

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
TIMED_FORMATS = ("srt", "verbose_json", "vtt")  # answered from segments: long-form decoding with timestamps
GRANULARITIES = ("segment", "word")
ENDPOINTS = {"transcribe": "/v1/audio/transcriptions", "translate": "/v1/audio/translations"}
# Media types an audio upload may carry (OpenAI takes flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav, webm; the decoder
# reads any audio or video container FFmpeg does, and judges the bytes, whatever the type says).
AUDIO_TYPES = ("audio/", "video/", "application/ogg", "application/x-matroska", "application/octet-stream")


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
    """The checked fields of an audio request's multipart body, its options as ``WhisperOptions`` (``task``:
    "transcribe" or "translate", the endpoint's).

    Raises:
        GatewayError: 400 naming the field: no file, an empty file, not an audio media type, an unknown field,
            a value out of range, timestamp_granularities[] without verbose_json, stream with a timed format;
            400 for a malformed body or one cut before its closing boundary (``upload.read_form``).
    """
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise bad_request(f"send multipart/form-data with a 'file' part, not {content_type or 'no content type'!r}")
    form = await read_form(request, max_files=1, max_fields=64)
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
        raise bad_request(
            f"file has media type {media!r}; send an audio or video file (flac, mp3, mp4, mpeg, mpga, m4a, ogg, "
            "opus, wav, webm...)",
            "file",
        )
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
    granularities = set(form.getlist("timestamp_granularities[]"))
    if granularities - set(GRANULARITIES):
        bad = sorted(str(g) for g in granularities - set(GRANULARITIES))
        raise bad_request(
            f"timestamp_granularities[] takes segment and/or word, got {', '.join(bad)}", "timestamp_granularities[]"
        )
    if granularities and response_format != "verbose_json":
        raise bad_request(
            f"timestamp_granularities[] needs response_format verbose_json (got {response_format!r})",
            "timestamp_granularities[]",
        )
    stream = _bool(form, "stream")
    if stream and response_format in TIMED_FORMATS:
        raise bad_request(
            f"stream answers transcript.text.delta events: it takes response_format json or text, not "
            f"{response_format!r}",
            "stream",
        )
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
    if "word" in granularities:
        timestamps = decoder_pb2.TIMESTAMP_GRANULARITY_WORD
    elif response_format in TIMED_FORMATS:
        timestamps = decoder_pb2.TIMESTAMP_GRANULARITY_SEGMENT
    else:
        timestamps = decoder_pb2.TIMESTAMP_GRANULARITY_NONE
    language = (_one(form, "language") or "").strip().lower()
    if language or response_format == "verbose_json":
        await asyncio.to_thread(_languages)  # its first call imports HF's table (~1.4 s): off the event loop
    with building_request("prompt"):
        whisper = decoder_pb2.WhisperOptions(
            language=language_code(language),  # a name ("German") as its code, as the decoder would read it
            task=task,
            prompt=_one(form, "prompt") or "",
            timestamps=timestamps,
        )
    size = await asyncio.to_thread(_size, upload)
    if not size:
        await upload.close()
        raise bad_request("file is empty; send an audio file", "file")
    return {
        "model": model,
        "upload": upload,
        "size": size,
        "response_format": response_format,
        # OpenAI's 0 = automatic fallback: no temperatures list and sampling 0 (the decoder's fallback list);
        # above 0 the decoder decodes at that temperature only.
        "temperature": temperature,
        "whisper": whisper,
        "segments": response_format in TIMED_FORMATS and (not granularities or "segment" in granularities),
        "words": "word" in granularities,
        "stream": stream,
    }


@functools.cache
def _languages() -> dict[str, str]:
    """Whisper's languages (HF ``tokenization_whisper``): ISO code -> English name."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return LANGUAGES


def language_name(code: str) -> str:
    """OpenAI's ``verbose_json`` ``language``: the English name ("english") of an ISO code (the code if unknown)."""
    return _languages().get(code, code)


# Which form field a decoder INVALID_ARGUMENT is about, by the words of its message (decoder_svc.whisper.options).
_PARAM_WORDS = (
    ("translate", "model"),
    ("language", "language"),
    ("prompt", "prompt"),
    ("temperature", "temperature"),
    ("timestamps", "timestamp_granularities[]"),
    ("audio", "file"),
)


def whisper_error(exc: grpc.RpcError) -> GatewayError:
    """``from_rpc_error`` with the field a 400 is about named in ``param`` (OpenAI's error body)."""
    err = from_rpc_error(exc)
    if err.status == 400 and err.param is None:
        message = err.message.lower()
        if message.startswith("audio"):  # the decoder's audio errors all start so (decoder_svc.session.audio_limits)
            err.param = "file"
        else:
            err.param = next((param for word, param in _PARAM_WORDS if word in message), None)
    return err


def _size(upload: UploadFile) -> int:
    """The upload's length in bytes (its spooled file's end)."""
    return upload.file.seek(0, 2)


# Generate's wire name, and the tag of GenerateRequest's ``audio`` (field 3, length-delimited) in the protobuf
# wire format (https://protobuf.dev/programming-guides/encoding/).
GENERATE_METHOD = "/encdec.v1.DecoderService/Generate"
_AUDIO_TAG = bytes([(decoder_pb2.GenerateRequest.AUDIO_FIELD_NUMBER << 3) | 2])


def generate_wire(head: decoder_pb2.GenerateRequest, upload: UploadFile, size: int) -> bytes:
    """``head`` serialized with the upload as its ``audio``: the bytes ``GenerateRequest(audio=..., **head)``
    serializes to (a parser takes fields in any order), read from the spooled file into place instead of into
    bytes, a message and its serialization.

    Args:
        head: the request without its audio.
        upload: the multipart file part; read from its start.
        size: its length in bytes.
    """
    prefix = head.SerializeToString() + _AUDIO_TAG + _varint(size)
    wire = bytearray(len(prefix) + size)
    wire[: len(prefix)] = prefix
    upload.file.seek(0)
    view = memoryview(wire)[len(prefix) :]
    while view:  # readinto may return short counts
        got = upload.file.readinto(view)
        if not got:
            raise bad_request("the upload ended early; send the file again", "file")
        view = view[got:]
    return bytes(wire)  # gRPC sends bytes only; the bytearray is freed on return


class OneShot:
    """A serialized request that gRPC takes once (its ``request_serializer`` is ``OneShot.take``).

    A grpc.aio call keeps its request object for its whole life (``UnaryStreamCall._request``), and a unary
    request's bytes until the server's first answer; so Generate is called as a stream of this one request
    (the same HTTP/2 frames), whose serialization lives only until it is sent.
    """

    __slots__ = ("wire",)

    def __init__(self, wire: bytes) -> None:
        self.wire = wire

    def take(self) -> bytes:
        wire, self.wire = self.wire, b""
        return wire


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


async def _transcribe(request: Request, b: Backends, cfg: GatewayConfig, task: str):
    fields = await parse_form(request, task)
    upload = fields.pop("upload")
    try:
        backend = await b.lookup(fields["model"], ("audio",), ENDPOINTS[task])
        head = decoder_pb2.GenerateRequest(
            model=b.wire_name(fields.pop("model")),
            sampling=decoder_pb2.SamplingParams(temperature=fields["temperature"]),
            whisper=fields["whisper"],
        )
        wire = await asyncio.to_thread(generate_wire, head, upload, fields.pop("size"))
    finally:
        await upload.close()
    generate = backend.channel.stream_stream(
        GENERATE_METHOD, request_serializer=OneShot.take, response_deserializer=decoder_pb2.GenerateResponse.FromString
    )
    call = generate(iter([OneShot(wire)]), timeout=cfg.request_timeout_s)
    del wire  # gRPC's write takes it out of the OneShot; freed once sent
    try:
        first = await unless_disconnected(request, call.read())
    except grpc.RpcError as exc:  # refused before any output: the 400 names the field
        call.cancel()
        raise whisper_error(exc) from None
    except BaseException:
        call.cancel()
        raise
    if fields["stream"]:
        return sse(_events(call, first))
    messages = await unless_disconnected(request, _collect(call, first))
    text = "".join(m.text for m in messages).strip()
    segments = [s for m in messages for s in m.segments]
    last = messages[-1] if messages else decoder_pb2.GenerateResponse()  # the final one: language, duration
    duration = last.duration if last.duration > 0 else None  # the decoder's: the audio's length in seconds
    response_format = fields["response_format"]
    if response_format == "text":
        return PlainTextResponse(text)
    if response_format in ("srt", "vtt"):
        return PlainTextResponse(to_srt(segments) if response_format == "srt" else to_vtt(segments))
    body: dict = {"text": text}
    if response_format == "verbose_json":
        language = last.language or fields["whisper"].language or "en"
        body = {"task": task, "language": language_name(language), "duration": duration, "text": text}
        if fields["segments"]:
            body["segments"] = [_segment(s) for s in segments]
        if fields["words"]:
            body["words"] = [
                {"word": w.word.strip(), "start": np.float32(w.start), "end": np.float32(w.end)}
                for s in segments
                for w in s.words
            ]
    if duration is not None:
        body["usage"] = {"type": "duration", "seconds": math.ceil(duration)}
    return json_response(body)


def _segment(s: decoder_pb2.Segment) -> dict:
    """One ``verbose_json`` segment (OpenAI's fields; float32 values written as their shortest decimal)."""
    return {
        "id": s.id,
        "seek": s.seek,
        "start": np.float32(s.start),
        "end": np.float32(s.end),
        "text": s.text,
        "tokens": list(s.tokens),
        "temperature": np.float32(s.temperature),
        "avg_logprob": np.float32(s.avg_logprob),
        "compression_ratio": np.float32(s.compression_ratio),
        "no_speech_prob": np.float32(s.no_speech_prob),
    }


async def _collect(call, first) -> list[decoder_pb2.GenerateResponse]:
    """Every message of the stream (``first`` already read)."""
    try:
        return [message async for message in stream_messages(call, first)]
    except grpc.RpcError as exc:
        raise whisper_error(exc) from None
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
        yield whisper_error(exc).body()
    finally:
        call.cancel()


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request, b: Backends = Depends(backends), cfg: GatewayConfig = Depends(config)):
    return await _transcribe(request, b, cfg, "transcribe")


@router.post("/v1/audio/translations")
async def translations(request: Request, b: Backends = Depends(backends), cfg: GatewayConfig = Depends(config)):
    return await _transcribe(request, b, cfg, "translate")
