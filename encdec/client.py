"""Client side of ``encdec transcribe``: stream transcripts over gRPC, and write them as text, JSON or subtitles."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from shared.grpc_server import GRPC_OPTIONS
from shared.proto import decoder_pb2, decoder_pb2_grpc
from shared.subtitles import to_srt, to_vtt
from shared.tls import ClientSecurity

SUFFIXES = {"text": ".txt", "json": ".json", "srt": ".srt", "vtt": ".vtt"}


@dataclass
class Transcript:
    """The outcome of one file: text, token ids, finish reason, usage, wall seconds, and on a
    "stop" the matched stop string or stop token id (as text; "" for other finish reasons).

    Whisper's extras (``GenerateResponse``): ``segments`` (``decoder_pb2.Segment``, with their words; empty in
    short-form), the language used (ISO code; given or detected) and its detection probability, the audio's
    length in seconds, the first window's no-speech probability.
    """

    path: str
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    completion_tokens: int
    seconds: float
    stop_reason: str = ""
    segments: list = field(default_factory=list)
    language: str = ""
    language_probability: float = 0.0
    duration: float = 0.0
    no_speech_prob: float = 0.0
    prompt_tokens: int = 0
    encoder_tokens: int = 0


async def transcribe_one(
    stub: decoder_pb2_grpc.DecoderServiceStub,
    path: str,
    sampling: decoder_pb2.SamplingParams | None = None,
    out: TextIO | None = None,
    prefix: str = "",
    whisper: decoder_pb2.WhisperOptions | None = None,
) -> Transcript:
    """Sends one audio file; streams its text to ``out`` as it arrives, or with
    ``prefix`` set writes ``prefix + transcript`` as one line when it is done.

    Args:
        whisper: language, task, prompt, timestamps, ... (None = the server's defaults).

    Raises:
        grpc.aio.AioRpcError: the server refused or failed the request.
        OSError: the file cannot be read.
    """
    start = time.perf_counter()
    request = decoder_pb2.GenerateRequest(audio=Path(path).read_bytes(), sampling=sampling, whisper=whisper)
    text, ids, segments, last = [], [], [], None
    async for message in stub.Generate(request):
        text.append(message.text)
        ids.extend(message.token_ids)
        segments.extend(message.segments)
        last = message
        if out is not None and message.text and not prefix:  # one file: stream as it is decoded
            out.write(message.text)
            out.flush()
    if out is not None:  # several files: one line each, as each finishes
        out.write(f"{prefix}{''.join(text).strip()}\n" if prefix else "\n")
        out.flush()
    reason = decoder_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    which = last.WhichOneof("stop_reason")
    stop_reason = "" if which is None else str(getattr(last, which))
    return Transcript(
        path,
        last.request_id,
        "".join(text),
        ids,
        reason,
        last.usage.completion_tokens,
        time.perf_counter() - start,
        stop_reason,
        segments,
        last.language,
        last.language_probability,
        last.duration,
        last.no_speech_prob,
        last.usage.prompt_tokens,
        last.usage.encoder_tokens,
    )


def _f32(value: float) -> float:
    """A float32 proto field as the shortest decimal that reads back to it (3.32, not 3.319999933242798)."""
    return float(str(np.float32(value)))


def transcript_json(t: Transcript) -> dict:
    """One file's JSON object: faster-whisper's ``Segment`` / ``Word`` fields and ``TranscriptionInfo``'s
    language, probability and duration, with the gRPC usage (decoder prompt, generated and encoder tokens)."""
    segments = [
        {
            "id": s.id,
            "seek": s.seek,
            "start": _f32(s.start),
            "end": _f32(s.end),
            "text": s.text,
            "tokens": list(s.tokens),
            "temperature": _f32(s.temperature),
            "avg_logprob": _f32(s.avg_logprob),
            "compression_ratio": _f32(s.compression_ratio),
            "no_speech_prob": _f32(s.no_speech_prob),
            "words": [
                {"word": w.word, "start": _f32(w.start), "end": _f32(w.end), "probability": _f32(w.probability)}
                for w in s.words
            ],
        }
        for s in t.segments
    ]
    return {
        "file": t.path,
        "text": t.text.strip(),
        "language": t.language,
        "language_probability": _f32(t.language_probability),
        "duration": t.duration,
        "segments": segments,
        "finish_reason": t.finish_reason,
        "usage": {
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "encoder_tokens": t.encoder_tokens,
        },
    }


def render(t: Transcript, output_format: str) -> str:
    """``t`` as ``output_format``: "text" (the transcript, one line), "json" (``transcript_json``, one line),
    "srt" / "vtt" (``shared.subtitles`` over its segments).

    Raises:
        KeyError: an unknown format.
    """
    writers = {
        "text": lambda: t.text.strip() + "\n",
        "json": lambda: json.dumps(transcript_json(t), ensure_ascii=False) + "\n",
        "srt": lambda: to_srt(t.segments),
        "vtt": lambda: to_vtt(t.segments),
    }
    return writers[output_format]()


async def transcribe_files(
    address: str,
    paths: list[str],
    out: TextIO = sys.stdout,
    whisper: decoder_pb2.WhisperOptions | None = None,
    output_format: str = "text",
    output_dir: str | None = None,
    security: ClientSecurity | None = None,
    **sampling,
) -> list[Transcript | BaseException]:
    """Transcribes ``paths`` concurrently.

    ``output_format`` "text" without ``output_dir``: one file streams to ``out``, several print one
    ``[name] text`` line each. Otherwise each file, once done, is written as ``render`` makes it: to ``out``
    or, with ``output_dir``, to ``output_dir/<stem><suffix>`` (``SUFFIXES``; the folder is created).

    ``security``: TLS / mutual TLS and the bearer token (``shared.tls.ClientSecurity``); None: plaintext, no token.
    ``sampling``: ``decoder_pb2.SamplingParams`` fields (None = unset; lists for ``stop`` / ``stop_token_ids``).

    Raises:
        ValueError: a TLS file of ``security`` cannot be read or is not PEM.
    """
    params = decoder_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    if output_dir is not None:
        Path(output_dir).mkdir(parents=True, exist_ok=True)

    async def one(stub, path: str, prefix: str) -> Transcript:
        if output_format == "text" and output_dir is None:
            return await transcribe_one(stub, path, params, out, prefix, whisper)
        t = await transcribe_one(stub, path, params, None, "", whisper)
        body = render(t, output_format)
        if output_dir is None:
            out.write(body)
            out.flush()
        else:
            (Path(output_dir) / (Path(path).stem + SUFFIXES[output_format])).write_text(body, encoding="utf-8")
        return t

    async with (security or ClientSecurity()).channel(address, GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        many = len(paths) > 1
        tasks = [one(stub, p, f"[{Path(p).name}] " if many else "") for p in paths]
        return await asyncio.gather(*tasks, return_exceptions=True)
