"""``encdec bench online --rates``: the rate sweep's rows (refusals, goodput) and the CLI end to end on a tiny shape."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.cli import encdec

from encdec.bench.online import SWEEP_COLUMNS, parse_rates, summarize_sweep

ROOT = Path(__file__).resolve().parents[2]


def result(arrival: float, ttft: float | None, error: str | None = None, tokens: int = 4) -> dict:
    end = arrival + (ttft or 0.0) + 0.5
    return {
        "arrival_s": arrival,
        "start": arrival,
        "end": end,
        "tokens": 0 if error else tokens,
        "error": error,
        "ttft_s": None if error else ttft,
        "tpot_s": None if error else 0.1,
    }


def test_parse_rates():
    assert parse_rates("0.5,1, 2,4") == [0.5, 1.0, 2.0, 4.0]
    for bad in ("", "1,x", "0,1", "-1", "inf"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)


def test_sweep_row_counts_refusals_and_goodput():
    results = [
        result(0.0, 0.2),
        result(1.0, 0.9),
        result(2.0, 3.0),  # completed, but past the 1 s target
        result(2.5, None, "RESOURCE_EXHAUSTED: this decoder is overloaded: 64 requests are waiting"),
        result(2.6, None, "DEADLINE_EXCEEDED: the request's deadline (0.50 s left) is shorter than its wait"),
        result(2.7, None, "UNAVAILABLE: encoder failed"),
    ]
    row = summarize_sweep("whisper", 2.0, 3.0, results, ttft_slo_s=1.0)
    assert set(SWEEP_COLUMNS) <= set(row)
    assert row["requests"] == 6 and row["failed"] == 3 and row["refused"] == 2
    assert row["TTFT SLO ms"] == 1000.0
    assert row["met SLO %"] == pytest.approx(100 * 2 / 6)
    span = (2.0 + 3.0 + 0.5) - 0.0  # first arrival to last completion
    assert row["goodput req/s"] == pytest.approx(2 / span)
    assert row["req/s"] == pytest.approx(3 / span)


def test_cli_rate_sweep_prints_one_row_per_rate(tmp_path, tmp_path_factory):
    out = tmp_path / "sweep.json"
    cmd = encdec(
        "bench",
        "online",
        "--workload",
        "bart-tiny",
        "--rates",
        "2,6",
        "--duration",
        "1",
        "--new-tokens",
        "4",
        "--source-len",
        "6",
        "--ttft-slo-ms",
        "60000",
        "--lone-requests",
        "1",  # per rate, after a 0.2 s idle gap
        "--lone-gap-s",
        "0.2",
        "--cache-dir",
        str(tmp_path_factory.getbasetemp() / "seq2seq-checkpoints"),  # shared with tests/app/test_bench_cli.py
        "--json",
        str(out),
    )
    # The bench starts its own redis-server, and its processes run as a user's do: without the Triton CPU
    # interpreter tests/conftest.py sets for this process (under it every service starts ~2 s slower).
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TRITON_INTERPRET")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| workload"))
    assert [c.strip() for c in header.strip("|").split("|")] == SWEEP_COLUMNS
    payload = json.loads(out.read_text())
    assert payload["rates"] == [2.0, 6.0] and payload["columns"] == SWEEP_COLUMNS
    assert payload["lone_requests"] == 1 and payload["lone_gap_s"] == 0.2
    rows = payload["rows"]
    assert [r["rate req/s"] for r in rows] == [2.0, 6.0]
    for row in rows:
        n = sum(1 for r in payload["requests"] if r["rate"] == row["rate req/s"])
        assert row["requests"] == n and row["failed"] == row["refused"] == 0
        assert row["met SLO %"] == 100.0 and row["goodput req/s"] == pytest.approx(row["req/s"])
        assert row["lone TTFT ms"] > 0  # each rate's run has its lone request
