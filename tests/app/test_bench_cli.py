"""``encdec bench all`` end to end on tiny shapes: seq2seq and online through real services.

Runs the CLI as a user would (a subprocess; it starts redis + encoder + decoder
itself), then checks that the Markdown tables, the JSON and the PNG exist and
parse and that the results are consistent (token counts, HF parity counts).
No timing assertions: speed is what the bench reports, not what tests check.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.cli import encdec

ROOT = Path(__file__).resolve().parents[2]
REQUESTS, NEW_TOKENS, SOURCE_LEN = 4, 8, 6
LONE_REQUESTS = 1  # one lone request (after a short idle gap) fills the lone TTFT column


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench")
    # The session's checkpoint cache (also tests/app/test_bench_online_sweep.py's): each shape is built once.
    cache = tmp_path_factory.getbasetemp() / "seq2seq-checkpoints"
    cmd = encdec(
        "bench",
        "all",
        "--only",
        "seq2seq,online",
        "--skip-ct2",
        "--json",
        str(out / "bench.json"),
        "--plot",
        str(out / "bench.png"),
        f"--seq2seq-args=--models t5-tiny --requests {REQUESTS} --new-tokens {NEW_TOKENS} --source-len {SOURCE_LEN} "
        f"--skip-hf-sequential --repeats 1 --stream-intervals 1,16 --cache-dir {cache}",
        f"--online-args=--workload bart-tiny --rate 4 --duration 1.5 --new-tokens {NEW_TOKENS} --source-len {SOURCE_LEN} "
        f"--lone-requests {LONE_REQUESTS} --lone-gap-s 0.2 --cache-dir {cache}",
    )
    # The bench starts its own redis-server, and its processes run as a user's do: without the Triton CPU
    # interpreter tests/conftest.py sets for this process (under it every service starts ~2 s slower).
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TRITON_INTERPRET")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, out


def _table(stdout: str, header_start: str) -> list[list[str]]:
    lines = stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_seq2seq_table_and_json(bench_run):
    stdout, out = bench_run
    table = _table(stdout, "| model | system |")
    assert table[0][:3] == ["model", "system", "mode"] and "x best batched" in table[0]
    payload = json.loads((out / "bench.json").read_text())
    assert payload["failed"] == {}
    rows = payload["benches"]["seq2seq"]["rows"]
    assert len(table) == 2 + len(rows)
    systems = {(r["system"], r["mode"]) for r in rows}
    assert ("HF transformers fp32", "batched") in systems
    ours = [r for r in rows if r["system"].startswith("encdec-serve")]
    assert [r["system"] for r in ours] == [
        "encdec-serve fp32 (2 services, gRPC)",
        "encdec-serve fp32 (2 services, gRPC, stream interval 16)",
    ]
    assert all(r["requests"] == REQUESTS for r in ours)
    hf = next(r for r in rows if r["system"].startswith("HF"))
    assert hf["tokens"] == REQUESTS * NEW_TOKENS  # HF min_new_tokens = max_new_tokens
    assert 0 < ours[0]["tokens"] <= REQUESTS * NEW_TOKENS
    assert (
        ours[1]["tokens"] == ours[0]["tokens"] and ours[1]["same as HF"] == ours[0]["same as HF"]
    )  # merged, not changed
    if payload["benches"]["seq2seq"]["ours_fixed_length"]:
        assert ours[0]["tokens"] == REQUESTS * NEW_TOKENS
    assert hf["x best batched"] == pytest.approx(1.0)  # HF batched is the only baseline without CTranslate2
    for r in rows:
        same, total = map(int, r["same as HF"].split("/"))
        assert total == REQUESTS and 0 <= same <= total
        assert r["tokens/s"] > 0 and r["wall s"] > 0


def test_online_table_and_json(bench_run):
    stdout, out = bench_run
    table = _table(stdout, "| workload | rate req/s |")
    payload = json.loads((out / "bench.json").read_text())["benches"]["online"]
    row = payload["rows"][0]
    assert table[2][0] == "bart-tiny"
    assert payload["lone_requests"] == LONE_REQUESTS and payload["lone_gap_s"] == 0.2
    assert row["requests"] == len(payload["requests"]) and row["failed"] == 0
    for key in ("TTFT p50 ms", "TTFT p99 ms", "lone TTFT ms", "TPOT p50 ms", "TPOT p99 ms", "tokens/s"):
        assert row[key] is not None and row[key] > 0, key
    assert row["TTFT p50 ms"] <= row["TTFT p99 ms"]
    assert row["p99 / lone"] == pytest.approx(row["TTFT p99 ms"] / row["lone TTFT ms"])
    assert len(payload["requests"]) == row["requests"]  # the lone requests before the run are not counted in it
    assert all(r["tokens"] >= 1 and r["error"] is None for r in payload["requests"])


def test_plot_png(bench_run):
    import matplotlib.pyplot as plt

    _, out = bench_run
    png = out / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    h, w = plt.imread(png).shape[:2]
    assert h > 100 and w > 100


def test_median_run_is_the_middle_wall_time():
    from encdec.bench.seq2seq import median_run

    assert median_run([(3.0, "a"), (1.0, "b"), (2.0, "c")]) == (2.0, "c")
    assert median_run([(4.0, "a"), (1.0, "b"), (2.0, "c"), (3.0, "d")]) == (2.0, "c")  # the lower middle
    assert median_run([(5.0, "x")]) == (5.0, "x")


@pytest.mark.parametrize("bench", ["whisper", "seq2seq"])
def test_repeats_must_be_a_positive_count(bench, capsys):
    from encdec.parser import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", bench]).repeats == 3
    assert parser.parse_args(["bench", bench, "--repeats", "5"]).repeats == 5
    for bad, message in (
        ("0", "must be >= 1, got 0"),
        ("-2", "must be >= 1, got -2"),
        ("x", "expected a whole number >= 1, got 'x'"),
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["bench", bench, "--repeats", bad])
        assert message in capsys.readouterr().err
