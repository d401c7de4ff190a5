"""``encdec bench http`` end to end at a tiny size, through ``encdec bench all --only http``: the HTTP gateway and
gRPC paths against the services the bench starts, the Markdown table, the JSON and the PNG. No timing assertions:
speed is what the bench reports, not what tests check.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.cli import encdec

from encdec.bench.http import COLUMNS, TARGETS, chunks, timed_run
from encdec.bench.machine import machine_info, machine_line

ROOT = Path(__file__).resolve().parents[2]
B1, B32, AUDIO, CONCURRENCY = 4, 2, 3, 2


@pytest.fixture(scope="module")
def bench_http(tmp_path_factory):
    pytest.importorskip("httpx")
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench-http")
    cmd = encdec(
        "bench",
        "all",
        "--only",
        "http",
        "--json",
        str(out / "bench.json"),
        "--plot",
        str(out / "bench.png"),
        f"--http-args=--requests-b1 {B1} --requests-b32 {B32} --requests-audio {AUDIO} --concurrency {CONCURRENCY} "
        f"--audio-concurrency {CONCURRENCY} --rounds 2",
    )
    # The bench starts its own redis-server, and its processes run as a user's do: without the Triton CPU
    # interpreter tests/conftest.py sets for this process (under it every service starts ~2 s slower).
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TRITON_INTERPRET")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, proc.stderr, out


def test_table_json_and_plot(bench_http):
    stdout, stderr, out = bench_http
    lines = stdout.splitlines()
    header = lines.index("| " + " | ".join(COLUMNS) + " |")
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines[header + 2 : header + 6]]
    assert [(r[0], r[1], r[2], r[3]) for r in table] == [
        ("embeddings batch 1", "sequential", str(B1), "req/s"),
        ("embeddings batch 1", f"concurrency {CONCURRENCY}", str(B1), "req/s"),
        ("embeddings batch 32", "sequential", str(B32), "sentences/s"),
        ("transcriptions", f"concurrency {CONCURRENCY}", str(AUDIO), "req/s"),
    ]
    assert "machine: " in stderr  # the bench's own stdout (the machine line) goes to stderr under `bench all`

    result = json.loads((out / "bench.json").read_text())
    assert result["failed"] == {}
    payload = result["benches"]["http"]
    assert payload["machine"] == machine_info() and payload["columns"] == COLUMNS
    rows = payload["rows"]
    assert len(rows) == 4
    for row in rows:
        assert row["HTTP"] > 0 and row["gRPC"] > 0 and row["HTTP p50 ms"] > 0 and row["gRPC p50 ms"] > 0
        assert row["HTTP / gRPC"] == pytest.approx(row["HTTP"] / row["gRPC"])
        # Both paths reach the same services: the same vectors, the same transcripts.
        assert row["same output"] == f"{row['requests']}/{row['requests']}", row
        assert len(row["HTTP piece wall s"]) == len(row["gRPC piece wall s"]) == 2  # --rounds 2: two pieces each
        target = TARGETS.get(row["workload"])
        assert row["target"] == (None if target is None else f">= {target:g}x")
        assert row["met"] == (None if target is None else ("yes" if row["HTTP / gRPC"] >= target else "no"))
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_machine_line_names_cpu_isa_threads_per_core_and_libraries():
    import torch

    info = machine_info()
    line = machine_line(info)
    assert line.count(", ") >= 3 and f"{os.cpu_count()} CPUs" in line
    assert "thread" in line and "per core" in line and f"torch {torch.__version__}" in line
    assert info["isa"] in line and info["cpu"] in line
    assert info["onednn"] and info["onednn"] in line  # torch's CPU build carries oneDNN (MKL on x86)
    assert set(info["flags"]) <= set(open("/proc/cpuinfo").read().split())


def test_chunks_are_whole_rounds_of_the_concurrency():
    assert [len(c) for c in chunks(list(range(200)), 8, 8)] == [32] * 6 + [8]
    assert [len(c) for c in chunks(list(range(32)), 16, 8)] == [16, 16]
    assert [len(c) for c in chunks(list(range(3)), 2, 2)] == [2, 1]
    assert sum(chunks(list(range(20)), 1, 8), []) == list(range(20))


def test_timed_run_keeps_the_order_and_the_concurrency():
    in_flight, peak = 0, 0

    async def send(x: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001 * (x % 3))
        in_flight -= 1
        return x * 10

    run = asyncio.run(timed_run(send, list(range(10)), 3))
    assert run.answers == [x * 10 for x in range(10)] and peak == 3
    assert len(run.latencies) == 10 and all(t >= 0 for t in run.latencies) and run.wall_s > 0
