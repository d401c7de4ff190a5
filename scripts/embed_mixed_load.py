"""Short Embed requests' latency beside a stream of long ones, against a real embed service process.

Starts the embed service (``--model``, default all-MiniLM-L6-v2) on a free loopback port, runs
``--long-clients`` threads sending long requests back to back (``--long-inputs`` texts of about
``--long-words`` words each, truncate=true) and one thread sending one short sentence at a time, for
``--duration-s`` seconds, then prints the short requests' p50 / p90 / p99 / max latency and the
long requests' count and median.

    .venv/bin/python scripts/embed_mixed_load.py --duration-s 30
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import grpc

from encdec.launcher import encoder_service
from shared.proto import embed_pb2, embed_pb2_grpc

WORDS = "the quick brown fox jumps over a lazy dog near the river bank under morning light".split()


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--long-clients", type=int, default=3)
    ap.add_argument("--long-inputs", type=int, default=64)
    ap.add_argument("--long-words", type=int, default=300)
    ap.add_argument("--duration-s", type=float, default=30.0)
    args = ap.parse_args()
    long_texts = [
        " ".join(WORDS[(k + j) % len(WORDS)] for j in range(args.long_words)) for k in range(args.long_inputs)
    ]
    with encoder_service(args.model, ["--metrics-port", "0"]) as address:
        stub = embed_pb2_grpc.EmbedServiceStub(grpc.insecure_channel(address))
        stub.Embed(embed_pb2.EmbedRequest(inputs=["warm up"]))
        stop = time.monotonic() + args.duration_s
        short_lat: list[float] = []
        long_lat: list[float] = []

        def long_client() -> None:
            while time.monotonic() < stop:
                t = time.perf_counter()
                stub.Embed(embed_pb2.EmbedRequest(inputs=long_texts, truncate=True), timeout=600)
                long_lat.append(time.perf_counter() - t)

        threads = [threading.Thread(target=long_client) for _ in range(args.long_clients)]
        for th in threads:
            th.start()
        time.sleep(1.0)  # let the long stream build up
        k = 0
        while time.monotonic() < stop:
            t = time.perf_counter()
            stub.Embed(embed_pb2.EmbedRequest(inputs=[f"a short sentence number {k}"]), timeout=600)
            short_lat.append(time.perf_counter() - t)
            k += 1
        for th in threads:
            th.join()
    ms = [x * 1000 for x in short_lat]
    print(
        f"short: n={len(ms)} p50={_quantile(ms, 0.5):.0f} ms p90={_quantile(ms, 0.9):.0f} ms "
        f"p99={_quantile(ms, 0.99):.0f} ms max={max(ms):.0f} ms"
    )
    print(f"long ({args.long_inputs} inputs): n={len(long_lat)} median={statistics.median(long_lat):.2f} s")


if __name__ == "__main__":
    main()
