"""Client side of realtime transcription (``DecoderService.TranscribeStream``): paced PCM in, timed events out.

``stream_events`` opens one stream, sends its ``RealtimeConfig`` and then the audio chunks (and controls) it is
given, at ``Pacing.speed`` times real time, half-closes when they run out, and yields every server message as a
``RealtimeEvent`` stamped with the ``time.perf_counter()`` it arrived at. A ``SendLog`` records when each chunk was
handed to gRPC, so a caller can tell how long after its audio was sent an event came (``encdec.bench.realtime``).

Chunk sources: ``pcm_chunks`` cuts PCM bytes (a decoded file) into fixed chunks; ``reader_chunks`` reads a
file descriptor (standard input) on a daemon thread, whatever arrives, as a live source delivers it.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field

import numpy as np

from shared.proto import decoder_pb2

SAMPLE_RATE = 16_000  # what a decoded file is sent at
SAMPLE_BYTES = {"pcm_s16le": 2, "pcm_f32le": 4}  # bytes per mono sample of each RealtimeConfig.encoding
CHUNK_S = 0.1  # audio per message: 100 ms, what a capture device delivers at a time
EVENTS = ("started", "speech_started", "speech_stopped", "partial", "final", "utterance_done", "end")

Chunk = bytes | int  # audio bytes, or a ``decoder_pb2.RealtimeControl`` value (COMMIT / CLEAR)


@dataclass(frozen=True)
class Pacing:
    """How fast audio is sent: a chunk is sent once ``speed`` x real time has covered its end.

    Attributes:
        speed: 1.0 = as a microphone delivers it (a chunk of 100 ms every 100 ms); 2.0 twice as fast; 0 = as
            fast as the stream takes it (no waits; for tests, or a source that paces itself).

    Raises:
        ValueError: a negative or non-finite speed.
    """

    speed: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.speed < float("inf"):
            raise ValueError(f"--realtime-speed must be a finite number >= 0, got {self.speed}")

    def due(self, t0: float, audio_s: float) -> float:
        """``perf_counter`` time at which the audio up to ``audio_s`` stream seconds is sent (``t0``: the first
        chunk's); ``t0`` itself at speed 0."""
        return t0 if self.speed == 0 else t0 + audio_s / self.speed


@dataclass
class SendLog:
    """When each chunk went out: ``audio_s[i]`` (stream seconds at its end) was handed to gRPC at ``wall[i]``
    (``perf_counter``); ``closed``: when the client half-closed (None before)."""

    audio_s: list[float] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    closed: float | None = None

    def sent_at(self, position_s: float) -> float | None:
        """``perf_counter`` time the audio at ``position_s`` stream seconds was sent: the send time of the first
        chunk ending at or after it; None when no chunk reached it."""
        i = bisect.bisect_left(self.audio_s, position_s - 1e-6)
        return self.wall[i] if i < len(self.wall) else None


@dataclass(frozen=True)
class RealtimeEvent:
    """One server message of the stream.

    Attributes:
        kind: which ``TranscribeStreamResponse.event`` it is (``EVENTS``).
        utterance: the utterance it belongs to (0, 1, ... within the stream).
        received: ``perf_counter`` time it arrived.
        text: partial / final / utterance_done text (final's with its leading space); "" for the others.
        start, end: stream seconds: the text's span; a speech boundary's position in both; 0 for started / end.
        message: the whole ``TranscribeStreamResponse`` (a final's ``Segment`` with its words, end's usage).
    """

    kind: str
    utterance: int
    received: float
    text: str
    start: float
    end: float
    message: decoder_pb2.TranscribeStreamResponse


def to_event(message: decoder_pb2.TranscribeStreamResponse, received: float) -> RealtimeEvent:
    """``message`` as a ``RealtimeEvent`` that arrived at ``received``."""
    kind = message.WhichOneof("event") or ""
    body = getattr(message, kind) if kind else None
    text = getattr(body, "text", "")
    if kind in ("speech_started", "speech_stopped"):
        start = end = body.audio_s
    else:
        start, end = getattr(body, "start", 0.0), getattr(body, "end", 0.0)
    return RealtimeEvent(kind, message.utterance, received, text, start, end, message)


def pcm16(audio: np.ndarray) -> bytes:
    """``[N]`` float32 in [-1, 1] -> little-endian int16 bytes (clipped, rounded)."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def chunk_bytes(sample_rate: int = SAMPLE_RATE, encoding: str = "pcm_s16le", chunk_s: float = CHUNK_S) -> int:
    """Bytes of ``chunk_s`` seconds of mono audio (a whole number of samples, at least one)."""
    return max(1, round(sample_rate * chunk_s)) * SAMPLE_BYTES[encoding]


def pcm_chunks(pcm: bytes, size: int) -> Iterable[bytes]:
    """``pcm`` cut into chunks of ``size`` bytes (the last may be shorter)."""
    return (pcm[i : i + size] for i in range(0, len(pcm), size))


async def reader_chunks(fd: int, size: int, stop: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    """Chunks of at most ``size`` bytes read from ``fd`` (a pipe: standard input) as they arrive, until end of
    file or ``stop`` is set. Reads run on a daemon thread, so a source that never ends cannot hold the process
    at exit.

    Raises:
        OSError: a read failed.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        while True:
            try:
                data = os.read(fd, size)
            except OSError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
                return
            loop.call_soon_threadsafe(queue.put_nowait, data)
            if not data:
                return

    threading.Thread(target=read, name="realtime-stdin", daemon=True).start()
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        while True:
            got = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({got, stopped} - {None}, return_when=asyncio.FIRST_COMPLETED)
            if got not in done:
                got.cancel()
                return
            item = got.result()
            if isinstance(item, OSError):
                raise item
            if not item:
                return
            yield item
    finally:
        if stopped is not None:
            stopped.cancel()


def _audio_seconds(config: decoder_pb2.RealtimeConfig) -> float:
    """Bytes per second of the stream's audio (``config``'s rate and encoding, their defaults when unset)."""
    return (config.sample_rate or SAMPLE_RATE) * SAMPLE_BYTES[config.encoding or "pcm_s16le"]


async def _iterate(chunks: Iterable[Chunk] | AsyncIterable[Chunk]) -> AsyncIterator[Chunk]:
    if hasattr(chunks, "__aiter__"):
        async for c in chunks:
            yield c
    else:
        for c in chunks:
            yield c


async def stream_events(
    stub,
    config: decoder_pb2.RealtimeConfig,
    chunks: Iterable[Chunk] | AsyncIterable[Chunk],
    pacing: Pacing = Pacing(),
    log: SendLog | None = None,
    timeout: float | None = None,
) -> AsyncIterator[RealtimeEvent]:
    """One ``TranscribeStream`` call: sends ``config``, then ``chunks`` at ``pacing``, half-closes; yields the
    server's events as they arrive (the last is ``end``).

    Args:
        stub: a ``DecoderServiceStub`` on a ``grpc.aio`` channel.
        config: the first message (``sample_rate`` / ``encoding`` also say how many stream seconds a chunk is).
        chunks: audio bytes (any size; mono PCM as ``config`` says) or ``RealtimeControl`` values, in order.
        log: filled with each chunk's send time (``SendLog``); pass one to measure latencies.
        timeout: the call's deadline in seconds (None: none).

    Raises:
        grpc.aio.AioRpcError: the server ended the call with an error status (INVALID_ARGUMENT: bad config or
            audio; RESOURCE_EXHAUSTED: too many live streams).
        Exception: whatever reading ``chunks`` raised (the call is cancelled first).
    """
    import grpc

    if config.encoding and config.encoding not in SAMPLE_BYTES:
        raise ValueError(f"encoding {config.encoding!r} is not one of {', '.join(SAMPLE_BYTES)}")
    log = log if log is not None else SendLog()
    bytes_per_s = _audio_seconds(config)
    failure: list[BaseException] = []
    # Audio goes out once the server answered the config (started, or the call ended): a refusal at open then
    # reaches us as sent. grpcio's asyncio client replaces the server's status with INTERNAL "Internal error from
    # Core" when a write fails because the call already ended (grpc/grpc#36066).
    opened = asyncio.Event()

    async def requests() -> AsyncIterator[decoder_pb2.TranscribeStreamRequest]:
        yield decoder_pb2.TranscribeStreamRequest(config=config)
        await opened.wait()
        sent, t0 = 0, None
        try:
            async for chunk in _iterate(chunks):
                if isinstance(chunk, int):
                    yield decoder_pb2.TranscribeStreamRequest(control=chunk)
                    continue
                if not chunk:
                    continue
                sent += len(chunk)
                t0 = time.perf_counter() if t0 is None else t0
                wait = pacing.due(t0, sent / bytes_per_s) - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                log.audio_s.append(sent / bytes_per_s)
                log.wall.append(time.perf_counter())
                yield decoder_pb2.TranscribeStreamRequest(audio=chunk)
        except Exception as exc:  # noqa: BLE001 - re-raised to the caller once the call is cancelled
            failure.append(exc)
            call.cancel()
            return
        log.closed = time.perf_counter()

    call = stub.TranscribeStream(requests(), timeout=timeout)
    try:
        async for message in call:
            opened.set()
            yield to_event(message, time.perf_counter())
    except grpc.aio.AioRpcError:
        if failure:
            raise failure[0] from None
        raise
    except asyncio.CancelledError:
        if failure:
            raise failure[0] from None
        raise
    finally:
        call.cancel()  # no-op once the call has ended; stops the sender when the caller stops iterating
    if failure:
        raise failure[0]


# ---- the console: `encdec transcribe --realtime` ------------------------------------------------------------
def clock(seconds: float) -> str:
    """Stream seconds as ``MM:SS.ss`` (``H:MM:SS.ss`` from an hour on)."""
    minutes, secs = divmod(max(0.0, seconds), 60.0)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}:{minutes:02d}:{secs:05.2f}" if hours else f"{minutes:02d}:{secs:05.2f}"


def final_json(event: RealtimeEvent) -> dict:
    """A final as one JSON object: utterance, id, start, end (stream seconds), text, and words when timed."""
    seg = event.message.final
    out = {"utterance": event.utterance, "id": seg.id, "start": round(seg.start, 3), "end": round(seg.end, 3)}
    out["text"] = seg.text.strip()
    if seg.words:
        out["words"] = [
            {"word": w.word, "start": round(w.start, 3), "end": round(w.end, 3), "probability": round(w.probability, 3)}
            for w in seg.words
        ]
    return out


class RealtimePrinter:
    """Writes a stream's events to ``out`` as ``--format`` says.

    ``text``: one line per final (``[start -> end] `` before it with ``times``); on a terminal (``live``) the
    running partial is shown in place on the line below the finals (carriage return, line cleared), cut to the
    terminal's width so it never wraps. ``json``: one object per final (``final_json``), a line each. ``srt`` /
    ``vtt``: a cue per final, written as it arrives (VTT's header first). Partials go nowhere but a terminal.
    """

    def __init__(self, out, output_format: str = "text", times: bool = False, live: bool = False) -> None:
        self.out, self.format, self.times, self.live = out, output_format, times, live and output_format == "text"
        self.finals: list = []
        self.written = 0  # srt / vtt: characters of the subtitle document written so far
        self.partial_shown = False

    def _clear(self) -> None:
        if self.partial_shown:
            self.out.write("\r\x1b[2K")
            self.partial_shown = False

    def _partial(self, text: str) -> None:
        import shutil

        text = " ".join(text.split())
        width = shutil.get_terminal_size().columns - 1
        self._clear()
        if text:
            self.out.write(text if len(text) <= width else "…" + text[-(width - 1) :])
            self.partial_shown = True

    def event(self, event: RealtimeEvent) -> None:
        """Shows one event (partials only when ``live``; finals always)."""
        import json

        from shared.subtitles import to_srt, to_vtt

        if event.kind == "partial" and self.live:
            self._partial(event.text)
        elif event.kind == "final":
            self._clear()
            seg = event.message.final
            if self.format == "json":
                self.out.write(json.dumps(final_json(event), ensure_ascii=False) + "\n")
            elif self.format in ("srt", "vtt"):
                self.finals.append(seg)
                doc = (to_srt if self.format == "srt" else to_vtt)(self.finals)
                self.out.write(doc[self.written :])
                self.written = len(doc)
            else:
                when = f"[{clock(seg.start)} -> {clock(seg.end)}] " if self.times else ""
                self.out.write(f"{when}{seg.text.strip()}\n")
        elif event.kind == "end":
            self._clear()
        else:
            return
        self.out.flush()

    def close(self, complete: bool = True) -> None:
        """Clears a partial left on the terminal; a ``complete`` VTT stream without finals still gets its header."""
        self._clear()
        if complete and self.format == "vtt" and not self.written:
            self.out.write("WEBVTT\n\n")
        self.out.flush()


async def transcribe_realtime(
    address: str,
    config: decoder_pb2.RealtimeConfig,
    chunks: Iterable[Chunk] | AsyncIterable[Chunk],
    printer: RealtimePrinter,
    pacing: Pacing = Pacing(),
    security=None,
) -> RealtimeEvent | None:
    """Streams ``chunks`` to the decoder at ``address`` and shows its events with ``printer``; returns the
    ``end`` event (None if the call ended without one).

    Args:
        security: ``shared.tls.ClientSecurity`` (TLS, bearer token); None: plaintext, no token.

    Raises:
        grpc.aio.AioRpcError: the server refused or failed the stream. ValueError: a TLS file is unreadable.
    """
    from shared.grpc_server import GRPC_OPTIONS
    from shared.proto import decoder_pb2_grpc
    from shared.tls import ClientSecurity

    end = None
    async with (security or ClientSecurity()).channel(address, GRPC_OPTIONS) as channel:
        stub = decoder_pb2_grpc.DecoderServiceStub(channel)
        try:
            async for event in stream_events(stub, config, chunks, pacing):
                printer.event(event)
                end = event if event.kind == "end" else end
        finally:
            printer.close(complete=end is not None)
    return end
