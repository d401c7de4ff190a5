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
    """The outcome of one file: text, token ids, finish reason, usage, wall seconds, and on a
    "stop" the matched stop string or stop token id (as text; "" for other finish reasons)."""

    path: str
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    completion_tokens: int
    seconds: float
    stop_reason: str = ""


async def transcribe_one(
    stub: decoder_pb2_grpc.DecoderServiceStub,
    path: str,
    sampling: decoder_pb2.SamplingParams | None = None,
    out: TextIO | None = None,
    prefix: str = "",
) -> Transcript:
    """Sends one audio file; streams its text to ``out`` as it arrives, or with
    ``prefix`` set writes ``prefix + transcript`` as one line when it is done.

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
    )


async def transcribe_files(
    address: str, paths: list[str], out: TextIO = sys.stdout, **sampling
) -> list[Transcript | BaseException]:
    """Transcribes ``paths`` concurrently; one file streams to ``out``, several print one ``[name] text`` line each.

    ``sampling``: ``decoder_pb2.SamplingParams`` fields (None = unset; lists for ``stop`` / ``stop_token_ids``).
    """
    params = decoder_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        many = len(paths) > 1
        tasks = [transcribe_one(stub, p, params, out, f"[{Path(p).name}] " if many else "") for p in paths]
        return await asyncio.gather(*tasks, return_exceptions=True)
