"""Client side of ``encdec transcribe``: stream transcripts over gRPC."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import grpc

from shared.grpc_server import GRPC_OPTIONS
from shared.proto import decoder_pb2, decoder_pb2_grpc


@dataclass
class Transcript:
    """The outcome of one file: text, token ids, finish reason, usage, wall seconds."""

    path: str
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    completion_tokens: int
    seconds: float


async def transcribe_one(
    stub: decoder_pb2_grpc.DecoderServiceStub,
    path: str,
    sampling: decoder_pb2.SamplingParams | None = None,
    out: TextIO | None = None,
    prefix: str = "",
) -> Transcript:
    """Sends one audio file and streams its text to ``out`` as it arrives.

    Raises:
        grpc.aio.AioRpcError: the server refused or failed the request.
        OSError: the file cannot be read.
    """
    start = time.perf_counter()
    request = decoder_pb2.GenerateRequest(audio=Path(path).read_bytes(), sampling=sampling)
    text, ids, last = [], [], None
    async for message in stub.Generate(request):
        text.append(message.text)
        ids.extend(message.token_ids)
        last = message
        if out is not None and message.text:
            out.write(f"{prefix}{message.text}" if prefix else message.text)
            out.write("\n" if prefix else "")
            out.flush()
    reason = decoder_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    return Transcript(path, last.request_id, "".join(text), ids, reason, last.usage.completion_tokens, time.perf_counter() - start)


async def transcribe_files(address: str, paths: list[str], out: TextIO = sys.stdout, **sampling) -> list[Transcript | BaseException]:
    """Transcribes ``paths`` concurrently; text streams to ``out`` (prefixed with the file name when several)."""
    params = decoder_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        many = len(paths) > 1
        tasks = [transcribe_one(stub, p, params, out, f"[{Path(p).name}] " if many else "") for p in paths]
        return await asyncio.gather(*tasks, return_exceptions=True)
