"""``encdec bench embed``: our EmbedService (gRPC, separate process) vs sentence-transformers
on the same machine and model (all-MiniLM-L6-v2 by default).

Both systems embed the same sentences (deterministic, 4-40 words, normalised
vectors) with the same torch thread count, one request at a time: ``batch 1``
sends one sentence per request, ``batch 32`` a list of 32. Per request we time
the round trip (ours: gRPC included) and report sentences/s, p50 / p99 latency
and our speed over sentence-transformers. sentence-transformers runs in this
process after our service has stopped, so they never share the CPUs.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import grpc

from encdec.bench.machine import machine_line
from encdec.bench.table import markdown_table, write_json

WORDS = (
    "the a serving system batches requests of different lengths together while every padded position costs compute "
    "sorting by length and packing tokens keeps waste small encoder models embed sentences into vectors for search "
    "retrieval clustering and ranking users compare latency throughput quality across machines today tomorrow "
    "quickly slowly large small new old city river mountain music book data model"
).split()
COLUMNS = ["system", "batch", "requests", "sentences/s", "p50 ms", "p99 ms", "x sentence-transformers"]


def make_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))).capitalize() + "." for _ in range(n)]


def _row(system: str, batch: int, latencies: list[float]) -> dict:
    lat = sorted(latencies)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    return {
        "system": system,
        "batch": batch,
        "requests": len(lat),
        "sentences/s": batch * len(lat) / sum(lat),
        "p50 ms": statistics.median(lat) * 1000,
        "p99 ms": p99 * 1000,
    }


def _requests(sentences: list[str], batch: int, count: int) -> list[list[str]]:
    return [[sentences[(i * batch + j) % len(sentences)] for j in range(batch)] for i in range(count)]


def run_ours(address: str, work: dict[int, list[list[str]]]) -> dict[int, list[float]]:
    from shared.proto import embed_pb2, embed_pb2_grpc

    out = {}
    with grpc.insecure_channel(address) as channel:
        stub = embed_pb2_grpc.EmbedServiceStub(channel)
        for batch, reqs in work.items():
            for r in reqs[:3]:  # warm-up
                stub.Embed(embed_pb2.EmbedRequest(inputs=r, truncate=True))
            lat = []
            for r in reqs:
                start = time.perf_counter()
                resp = stub.Embed(embed_pb2.EmbedRequest(inputs=r, truncate=True))
                lat.append(time.perf_counter() - start)
                assert len(resp.embeddings) == len(r)
            out[batch] = lat
    return out


def run_st(model_dir: str, work: dict[int, list[list[str]]], threads: int) -> dict[int, list[float]]:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    model = SentenceTransformer(model_dir, device="cpu")
    out = {}
    for batch, reqs in work.items():
        for r in reqs[:3]:
            model.encode(r, batch_size=batch, normalize_embeddings=True, show_progress_bar=False)
        lat = []
        for r in reqs:
            start = time.perf_counter()
            model.encode(r, batch_size=batch, normalize_embeddings=True, show_progress_bar=False)
            lat.append(time.perf_counter() - start)
        out[batch] = lat
    return out


def main(args) -> int:
    from encdec.launcher import encoder_service
    from shared.models.registry import resolve_model

    model_dir = str(resolve_model(args.model)[1])
    sentences = make_sentences(512)
    work = {1: _requests(sentences, 1, args.requests_b1), 32: _requests(sentences, 32, args.requests_b32)}
    print(
        f"model {args.model}, {args.threads} threads per system, {os.cpu_count()} CPUs; "
        f"batch 1: {args.requests_b1} requests, batch 32: {args.requests_b32} requests",
        file=sys.stderr,
    )
    if args.address:
        ours = run_ours(args.address, work)
    else:
        with encoder_service(args.model, ["--num-threads", str(args.threads)]) as address:
            ours = run_ours(address, work)
    st = run_st(model_dir, work, args.threads)
    rows = []
    for batch in work:
        ref = _row("sentence-transformers (in process)", batch, st[batch])
        mine = _row("encdec-serve EmbedService (gRPC)", batch, ours[batch])
        mine["x sentence-transformers"] = mine["sentences/s"] / ref["sentences/s"]
        rows += [ref, mine]
    print(f"Machine: {machine_line()}\n")
    print(markdown_table(rows, COLUMNS))
    if args.json:
        write_json(
            args.json,
            {"bench": "embed", "model": args.model, "threads": args.threads, "cpu_count": os.cpu_count(), "rows": rows},
        )
    return 0
