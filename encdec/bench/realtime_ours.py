"""``encdec bench realtime`` on our services: N ``TranscribeStream`` calls at once, file requests beside them.

Each stream has its own channel (as N clients would) and is fed by ``encdec.realtime_client.stream_events`` at
1x real time in 100 ms chunks; its events and send log become a ``realtime_load.StreamRun``. During each run one
``Generate`` of a bundled clip goes out every ``file_every_s`` seconds on another channel, sent whatever is still
running. Before the runs: a warm-up (a file and a short stream, untimed), and every recording sent once as a file
through ``Generate`` (untimed), the text the streams' WER is compared with.
"""

from __future__ import annotations

import asyncio
import io
import shlex
import sys
import time

from encdec.bench import realtime_load as rl

REFUSED = "RESOURCE_EXHAUSTED"  # the decoder's answer to a stream beyond --max-realtime-streams or a full machine


def _wav(pcm) -> bytes:
    """``[N]`` float32 16 kHz -> 16-bit WAV bytes."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, pcm, rl.SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


async def one_stream(address: str, config, pcm: bytes, delay_s: float) -> rl.StreamRun:
    """One stream of ``pcm`` (16 kHz s16le) at 1x real time, started after ``delay_s``; a refusal or another error
    is the run's ``error``, not raised."""
    import grpc

    from encdec.realtime_client import Pacing, SendLog, chunk_bytes, pcm_chunks, stream_events
    from shared.grpc_server import GRPC_OPTIONS
    from shared.proto import decoder_pb2_grpc

    await asyncio.sleep(delay_s)
    run, log = rl.StreamRun(), SendLog()
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        try:
            async for e in stream_events(stub, config, pcm_chunks(pcm, chunk_bytes()), Pacing(1.0), log):
                run.events.append((e.kind, e.received, e.start, e.end, e.text))
        except grpc.aio.AioRpcError as exc:
            run.error = f"{exc.code().name}: {exc.details()}"
    run.sent_audio_s, run.sent_wall, run.closed = log.audio_s, log.wall, log.closed
    return run


async def file_requests(stub, audio: bytes, audio_s: float, every_s: float, until: asyncio.Event) -> list[dict]:
    """One ``Generate`` of ``audio`` every ``every_s`` seconds until ``until`` is set; each ``{"start",
    "latency_s", "audio_s", "error"}`` ("" when it succeeded)."""
    import grpc

    from shared.proto import decoder_pb2

    async def one() -> dict:
        start, error = time.perf_counter(), ""
        try:
            async for _ in stub.Generate(decoder_pb2.GenerateRequest(audio=audio)):
                pass
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        return {"start": start, "latency_s": time.perf_counter() - start, "audio_s": audio_s, "error": error}

    tasks = []
    while not until.is_set():
        tasks.append(asyncio.ensure_future(one()))
        try:
            await asyncio.wait_for(until.wait(), every_s)
        except TimeoutError:
            pass
    return list(await asyncio.gather(*tasks))


async def _run_n(address: str, config, recs: list[rl.Recording], n: int, stagger_s: float, files) -> dict:
    """N streams (stream i: ``recs[i mod R]``, ``i x stagger_s`` late) and the file requests; ``{"runs", "files",
    "span_s"}`` (``files`` None without file requests)."""
    import grpc

    from encdec.realtime_client import pcm16
    from shared.grpc_server import GRPC_OPTIONS
    from shared.proto import decoder_pb2_grpc

    pcms = [pcm16(recs[i % len(recs)].pcm) for i in range(n)]
    done = asyncio.Event()
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        sender = asyncio.ensure_future(file_requests(stub, *files, done)) if files else None
        start = time.perf_counter()
        runs = await asyncio.gather(*(one_stream(address, config, pcm, i * stagger_s) for i, pcm in enumerate(pcms)))
        span = time.perf_counter() - start
        done.set()
        file_runs = await sender if sender else None
    return {"runs": runs, "files": file_runs, "span_s": span}


async def _ours(address: str, recs: list[rl.Recording], ns: list[int], args, file_audio: bytes) -> dict:
    import grpc
    import soundfile as sf

    from encdec.realtime_client import Pacing, pcm16, stream_events
    from shared.grpc_server import GRPC_OPTIONS
    from shared.proto import decoder_pb2, decoder_pb2_grpc

    config = decoder_pb2.RealtimeConfig(language="en")
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        async for _ in stub.Generate(decoder_pb2.GenerateRequest(audio=file_audio)):  # warm-up
            pass
        started = None
        async for e in stream_events(stub, config, [pcm16(recs[0].pcm[: 5 * rl.SAMPLE_RATE])], Pacing(0)):
            started = e.message.started if e.kind == "started" else started
        whisper, texts = decoder_pb2.WhisperOptions(language="en"), {}
        for rec in {r.name: r for r in recs}.values():
            request = decoder_pb2.GenerateRequest(audio=_wav(rec.pcm), whisper=whisper)
            texts[rec.name] = "".join([m.text async for m in stub.Generate(request)])
    files = (file_audio, sf.info(io.BytesIO(file_audio)).duration, args.file_every_s) if args.file_every_s else None
    per_n = {}
    for n in ns:
        print(f"[realtime] ours: {n} stream(s)", file=sys.stderr, flush=True)
        per_n[n] = await _run_n(address, config, recs, n, args.stagger_s, files)
    return {"per_n": per_n, "file_texts": texts, "step_s": started.step_s if started else None}


def run_ours(recs: list[rl.Recording], ns: list[int], args, file_audio: bytes) -> dict:
    """Every N of ``ns`` on the services at ``--address``, or on a stack started here (``--num-threads`` each,
    ``--decoder-args``): ``{"per_n": {n: {"runs", "files", "span_s"}}, "file_texts": {recording: text},
    "step_s": the server's step}``.

    Raises:
        grpc.aio.AioRpcError: the warm-up or a file transcription failed. ServicesError: the stack did not start.
    """
    if args.address:
        return asyncio.run(_ours(args.address, recs, ns, args, file_audio))
    from encdec.launcher import Services

    flags = ["--num-threads", str(args.threads)]
    with Services(
        model=args.model,
        log_level="WARNING",
        extra_encoder_args=flags,
        extra_decoder_args=[*flags, *shlex.split(args.decoder_args)],
    ) as svc:
        return asyncio.run(_ours(svc.decoder_address, recs, ns, args, file_audio))
