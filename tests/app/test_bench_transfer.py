"""``encdec bench transfer`` at a tiny payload over shm: the table and the JSON, not the speed."""

from __future__ import annotations

import json

import pytest

from encdec.bench.machine import machine_info, machine_line
from encdec.bench.transfer import COLUMNS, PAYLOADS, parse_payloads
from encdec.cli import main
from encdec.parser import build_parser


def test_payload_sizes_match_the_models():
    tiny, small, large = parse_payloads("whisper-tiny,whisper-small,whisper-large-v3", "float32")
    assert tiny.nbytes == 4 * 2 * 1500 * 6 * 64 * 4 == 18_432_000
    assert small.nbytes == 12 * 2 * 1500 * 12 * 64 * 4
    assert large.nbytes == 32 * 2 * 1500 * 20 * 64 * 4
    assert parse_payloads("2x3x8x13", "float16")[0].nbytes == 2 * 2 * 13 * 3 * 8 * 2
    with pytest.raises(ValueError, match="LxHxDxS"):
        parse_payloads("whisper-huge", "float32")
    assert set(PAYLOADS) == {"whisper-tiny", "whisper-small", "whisper-large-v3"}


def test_shm_bench_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    args = build_parser().parse_args(
        [
            "bench",
            "transfer",
            "--payloads",
            "2x3x8x13,1x1x4x16",
            "--transports",
            "shm",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--block-size",
            "5",
            "--json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == f"Machine: {machine_line()}" and lines[1] == ""  # the machine heads every bench's table
    assert lines[2] == "| " + " | ".join(COLUMNS) + " |"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:]]
    assert [(r[0], r[2], r[3], r[8], r[9]) for r in rows] == [
        ("2x3x8x13", "shm", "cpu", "yes", ""),
        ("1x1x4x16", "shm", "cpu", "yes", ""),
    ]

    result = json.loads(out.read_text())
    assert result["bench"] == "transfer" and result["block_size"] == 5 and result["iters"] == 2
    assert result["machine"] == machine_info()
    assert [r["payload"] for r in result["rows"]] == ["2x3x8x13", "1x1x4x16"]
    for row, nbytes in zip(result["rows"], (2 * 2 * 13 * 3 * 8 * 4, 1 * 2 * 16 * 1 * 4 * 4), strict=True):
        assert row["MB"] == nbytes / 1e6
        assert row["GB/s"] > 0 and row["memcpy GB/s"] > 0 and row["p50 ms"] > 0
        assert row["x memcpy"] == pytest.approx(row["GB/s"] / row["memcpy GB/s"])
        assert row["bit-exact"] == "yes" and "note" not in row


def test_bad_arguments_are_a_usage_error(capsys):
    assert main(["bench", "transfer", "--payloads", "3x3", "--transports", "shm"]) == 2
    assert "LxHxDxS" in capsys.readouterr().err
    assert main(["bench", "transfer", "--payloads", "1x1x4x16", "--transports", "carrier-pigeon"]) == 2
    assert "unknown transports" in capsys.readouterr().err
