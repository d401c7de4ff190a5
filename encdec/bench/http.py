"""``encdec bench http``: the OpenAI-compatible HTTP gateway (``encdec serve-http``) vs gRPC straight to the
services, the same work against the same services in one run.

The bench starts the services once (``Services``: Whisper tiny.en encoder + decoder, an all-MiniLM-L6-v2 embed
service and the gateway in front of both) and sends each workload twice from this process, over HTTP to the
gateway and over gRPC (``grpc.aio`` stubs) to the service itself:

* ``embeddings batch 1``: one-sentence ``/v1/embeddings`` requests vs ``Embed`` calls, one at a time
  (``sequential``) and from ``--concurrency`` workers at once;
* ``embeddings batch 32``: 32 sentences per request, one at a time;
* ``transcriptions``: the bundled clips (``encdec.DATA_DIR``, cycled) as multipart ``/v1/audio/transcriptions``
  uploads vs ``Generate`` streams, from ``--audio-concurrency`` workers. The decoder runs with
  ``--encoder-cache 0``, so every request is encoded, whichever path sent the clip first.

The HTTP client is ``httpx.AsyncClient`` over HTTP/1.1 with keep-alive (one pooled connection per worker, opened
during the warm-up): the transport an OpenAI SDK uses (uvicorn serves HTTP/1.1 only), without the SDK's own work
(pydantic response models, retries), so the difference to the gRPC column is the HTTP path itself: the gateway
process, HTTP/1.1 + JSON (or multipart) framing, and the client's parsing. Timed HTTP requests include decoding
the JSON answer, as a client must; gRPC ones the protobuf. Both paths are warmed up before timing (every
connection opened, every model run once). The machines these run on are shared and their speed drifts within
seconds, so each row's requests are sent in ``--rounds`` pieces, each over both paths before the next, which path
goes first alternating: both paths see the same background load (see ``run_workload``).

Rows: the rate per path (requests/s, sentences/s for batch 32), the ratio HTTP / gRPC beside its target (printed,
never asserted: >= 0.9x for embeddings batch 1, >= 0.95x for transcriptions), p50 latencies, and whether both
paths gave the same output (vectors within 1e-4, identical transcripts). Above the table: the machine (CPU model,
ISA, threads per core), since ratios only compare within one machine.

Over 300 lines: the four workloads, the two transports' clients and the alternating rounds are one comparison.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from encdec.bench.embed import make_sentences
from encdec.bench.machine import machine_info, machine_line
from encdec.bench.table import markdown_table, write_json

WHISPER_MODEL = "whisper-tiny.en"
COLUMNS = [
    "workload",
    "mode",
    "requests",
    "unit",
    "HTTP",
    "gRPC",
    "HTTP / gRPC",
    "target",
    "met",
    "HTTP p50 ms",
    "gRPC p50 ms",
    "same output",
]
TARGETS = {"embeddings batch 1": 0.9, "transcriptions": 0.95}  # HTTP / gRPC, printed beside the ratio
SAME_ATOL = 1e-4  # largest |difference| of two paths' embedding values counted as the same vector


# ---- timing ---------------------------------------------------------------------------------------------------
@dataclass
class Timed:
    """One timed run of a path: its wall time, each request's latency and answer."""

    wall_s: float
    latencies: list[float]
    answers: list


async def timed_run(send: Callable[[object], Awaitable[object]], work: list, concurrency: int) -> Timed:
    """Sends every item of ``work`` through ``send`` from ``concurrency`` workers (closed loop: each sends its
    next request when its last one is answered); answers in ``work``'s order."""
    latencies: list[float] = [0.0] * len(work)
    answers: list = [None] * len(work)
    next_index = iter(range(len(work)))

    async def worker() -> None:
        for i in next_index:
            start = time.perf_counter()
            answers[i] = await send(work[i])
            latencies[i] = time.perf_counter() - start

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(work)))))
    return Timed(time.perf_counter() - start, latencies, answers)


def _same_text(a: str, b: str) -> bool:
    return a.strip() == b.strip()


def _same_vectors(a: list[list[float]], b: list[list[float]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and max((abs(p - q) for p, q in zip(x, y)), default=0.0) <= SAME_ATOL for x, y in zip(a, b)
    )


# ---- the two paths --------------------------------------------------------------------------------------------
class Paths:
    """The HTTP and gRPC client of each workload, on one event loop."""

    def __init__(self, http_url: str, decoder_address: str, embed_address: str, embed_model: str, encoding: str):
        import grpc
        import httpx

        from shared.proto import decoder_pb2_grpc, embed_pb2_grpc

        # No pool limit: every worker keeps its own HTTP/1.1 connection alive (HTTP/1.1 has one request in flight
        # per connection); gRPC multiplexes every call over one HTTP/2 connection.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=None)
        # The gateway inherits this environment: with ENCDEC_API_KEY set it wants that key.
        key = os.environ.get("ENCDEC_API_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(
            base_url=http_url, http1=True, http2=False, limits=limits, timeout=600.0, headers=headers
        )
        self.decoder_channel = grpc.aio.insecure_channel(decoder_address)
        self.embed_channel = grpc.aio.insecure_channel(embed_address)
        self.decoder = decoder_pb2_grpc.DecoderServiceStub(self.decoder_channel)
        self.embed = embed_pb2_grpc.EmbedServiceStub(self.embed_channel)
        self.embed_model = embed_model
        self.encoding = encoding

    async def close(self) -> None:
        await self.http.aclose()
        await self.decoder_channel.close()
        await self.embed_channel.close()

    async def open_connections(self, n: int) -> None:
        """``n`` HTTP connections in the pool (``n`` concurrent requests of the cheapest route)."""
        responses = await asyncio.gather(*(self.http.get("/v1/models") for _ in range(n)))
        for r in responses:
            r.raise_for_status()

    async def http_embed(self, sentences: list[str]) -> list[list[float]]:
        body = {"model": self.embed_model, "input": sentences}
        if self.encoding != "float":
            body["encoding_format"] = self.encoding
        r = await self.http.post("/v1/embeddings", json=body)
        r.raise_for_status()
        data = r.json()["data"]
        if self.encoding == "base64":
            import base64

            import numpy as np

            return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() for d in data]
        return [d["embedding"] for d in data]

    async def grpc_embed(self, sentences: list[str]) -> list[list[float]]:
        from shared.proto import embed_pb2

        response = await self.embed.Embed(embed_pb2.EmbedRequest(model=self.embed_model, inputs=sentences))
        return [e.values for e in response.embeddings]  # the repeated field: converted only when compared

    async def http_transcribe(self, clip: tuple[str, bytes]) -> str:
        name, data = clip
        media = "audio/flac" if name.endswith(".flac") else "audio/wav"
        r = await self.http.post(
            "/v1/audio/transcriptions", files={"file": (name, data, media)}, data={"model": WHISPER_MODEL}
        )
        r.raise_for_status()
        return r.json()["text"]

    async def grpc_transcribe(self, clip: tuple[str, bytes]) -> str:
        from shared.proto import decoder_pb2

        request = decoder_pb2.GenerateRequest(
            model=WHISPER_MODEL, audio=clip[1], sampling=decoder_pb2.SamplingParams(temperature=0.0)
        )
        parts = [m.text async for m in self.decoder.Generate(request)]
        return "".join(parts).strip()  # as the gateway answers


@dataclass
class Workload:
    name: str
    mode: str
    unit: str
    per_request: int  # sentences per request (the rate's unit), 1 for req/s
    work: list
    concurrency: int
    http: Callable
    grpc: Callable
    same: Callable[[object, object], bool]


def chunks(work: list, concurrency: int, rounds: int) -> list[list]:
    """``work`` in about ``rounds`` consecutive pieces, each a whole number of ``concurrency`` requests (so every
    worker stays busy until the piece's last round), the last piece what is left."""
    size = concurrency * math.ceil(len(work) / (max(rounds, 1) * concurrency))
    return [work[i : i + size] for i in range(0, len(work), size)]


def _joined(runs: list[Timed]) -> Timed:
    return Timed(
        sum(r.wall_s for r in runs), [t for r in runs for t in r.latencies], [a for r in runs for a in r.answers]
    )


async def run_workload(w: Workload, rounds: int) -> dict:
    """Warm-up (untimed: each path's first ``concurrency`` requests, at least 3, ``concurrency`` at once), then the
    work in ``rounds`` pieces, each sent over both paths before the next, which path first alternating (HTTP gRPC,
    gRPC HTTP, ...): both see the same load from whatever else runs on the machine. A path's rate is all its
    requests over the sum of its pieces' wall times."""
    warm = w.work[: max(w.concurrency, 3)]
    await timed_run(w.http, warm, w.concurrency)
    await timed_run(w.grpc, warm, w.concurrency)
    runs: dict[str, list[Timed]] = {"HTTP": [], "gRPC": []}
    for i, piece in enumerate(chunks(w.work, w.concurrency, rounds)):
        order = (("HTTP", w.http), ("gRPC", w.grpc)) if i % 2 == 0 else (("gRPC", w.grpc), ("HTTP", w.http))
        for label, send in order:
            runs[label].append(await timed_run(send, piece, w.concurrency))
    http, grpc_ = _joined(runs["HTTP"]), _joined(runs["gRPC"])
    rate = {k: w.per_request * len(w.work) / r.wall_s for k, r in (("HTTP", http), ("gRPC", grpc_))}
    target = TARGETS.get(w.name)
    ratio = rate["HTTP"] / rate["gRPC"]
    same = sum(w.same(a, b) for a, b in zip(http.answers, grpc_.answers))
    return {
        "workload": w.name,
        "mode": w.mode,
        "requests": len(w.work),
        "unit": w.unit,
        "HTTP": rate["HTTP"],
        "gRPC": rate["gRPC"],
        "HTTP / gRPC": ratio,
        "target": None if target is None else f">= {target:g}x",
        "met": None if target is None else ("yes" if ratio >= target else "no"),
        "HTTP p50 ms": statistics.median(http.latencies) * 1000,
        "gRPC p50 ms": statistics.median(grpc_.latencies) * 1000,
        "same output": f"{same}/{len(w.work)}",
        "HTTP piece wall s": [r.wall_s for r in runs["HTTP"]],
        "gRPC piece wall s": [r.wall_s for r in runs["gRPC"]],
    }


def clips(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.wav")) + sorted(folder.glob("*.flac"))


async def run_all(args, http_url: str, decoder_address: str, embed_address: str) -> list[dict]:
    paths = Paths(http_url, decoder_address, embed_address, args.embed_model, args.encoding_format)
    try:
        await paths.open_connections(max(args.concurrency, args.audio_concurrency))
        sentences = make_sentences(512)
        b1 = [[sentences[i % len(sentences)]] for i in range(args.requests_b1)]
        b32 = [[sentences[(i * 32 + j) % len(sentences)] for j in range(32)] for i in range(args.requests_b32)]
        files = clips(Path(args.clips))
        audio = [(files[i % len(files)].name, files[i % len(files)].read_bytes()) for i in range(args.requests_audio)]
        embed, transcribe = (paths.http_embed, paths.grpc_embed), (paths.http_transcribe, paths.grpc_transcribe)
        workloads = [
            Workload("embeddings batch 1", "sequential", "req/s", 1, b1, 1, *embed, _same_vectors),
            Workload(
                "embeddings batch 1",
                f"concurrency {args.concurrency}",
                "req/s",
                1,
                b1,
                args.concurrency,
                *embed,
                _same_vectors,
            ),
            Workload("embeddings batch 32", "sequential", "sentences/s", 32, b32, 1, *embed, _same_vectors),
            Workload(
                "transcriptions",
                f"concurrency {args.audio_concurrency}",
                "req/s",
                1,
                audio,
                args.audio_concurrency,
                *transcribe,
                _same_text,
            ),
        ]
        rows = []
        for w in workloads:
            start = time.perf_counter()
            rows.append(await run_workload(w, args.rounds))
            print(f"[bench http] {w.name}, {w.mode}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        return rows
    finally:
        await paths.close()


def main(args) -> int:
    from encdec.launcher import Services

    if not clips(Path(args.clips)):
        print(f"no .wav/.flac clips in {args.clips}", file=sys.stderr)
        return 2
    try:
        import httpx  # noqa: F401 - the HTTP client; checked before the services start
    except ImportError:
        print("encdec bench http needs httpx: pip install httpx (or the [test] extra)", file=sys.stderr)
        return 2
    info = machine_info()
    line = machine_line(info)
    load_before = os.getloadavg()
    print(
        f"machine: {line}; {args.threads} threads per encoder / decoder; embeddings batch 1: {args.requests_b1}, "
        f"batch 32: {args.requests_b32}, transcriptions: {args.requests_audio} requests per path; {args.rounds} rounds",
        file=sys.stderr,
    )
    flags = ["--num-threads", str(args.threads)]
    start = time.perf_counter()
    # Clips repeat across requests and paths: the encoder-output cache off, so every request is encoded.
    with Services(
        model=WHISPER_MODEL,
        embed_model=args.embed_model,
        http_port=0,
        log_level="WARNING",
        extra_encoder_args=flags,
        extra_decoder_args=[*flags, "--encoder-cache", "0"],
    ) as svc:
        print(f"[bench http] services up in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        rows = asyncio.run(run_all(args, svc.http_url, svc.decoder_address, svc.embed_address))
    print(f"Machine: {line}\n")
    print(markdown_table(rows, COLUMNS))
    if args.json:
        write_json(
            args.json,
            {
                "bench": "http",
                "machine": info,
                "threads": args.threads,
                "cpu_count": os.cpu_count(),
                "rounds": args.rounds,
                "encoding_format": args.encoding_format,
                "targets": TARGETS,
                "loadavg_before": load_before,  # 1/5/15-min load: how shared the machine was
                "loadavg_after": os.getloadavg(),
                "columns": COLUMNS,
                "rows": rows,
            },
        )
    return 0
