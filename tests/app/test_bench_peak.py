"""``encdec bench peak`` and the roofline columns (issue 35): FLOP counts against a hand count, the peak
measurement's numbers and tables, the per-row columns, the decode-step product timings and the roofline PNG.
Small sizes only: the whole file runs in a few seconds. No speed is asserted: speed is what the bench reports."""

from __future__ import annotations

import pytest

from encdec.bench import flops, peak, products, roofline
from encdec.bench.table import markdown_table

# d_model 4, 2 heads of 2 (attn 4), 1 + 1 layers, FFN 8, vocab 10.
TINY = flops.Dims(d_model=4, heads=2, head_dim=2, encoder_layers=1, decoder_layers=1, ffn=8, vocab=10)


def test_encoder_flops_match_a_hand_count():
    # 3 positions, multiply-adds: q,k,v,o 4 x (3 x 4 x 4) = 192; q k^T and p v 2 x (3 x 3 x 4) = 72;
    # FFN 2 x (3 x 4 x 8) = 192; cross K,V of the one decoder layer 2 x (3 x 4 x 4) = 96. 552 MACs = 1104 FLOPs.
    assert flops.encoder_flops(TINY, 3) == 2 * (192 + 72 + 192 + 96) == 1104
    # Whisper's stem with 2 mel bins: conv1 over 6 frames 6 x 4 x (2 x 3) = 144, conv2 over 3 positions
    # 3 x 4 x (4 x 3) = 144.
    whisper = flops.Dims(4, 2, 2, 1, 1, 8, 10, mel_bins=2)
    assert flops.encoder_flops(whisper, 3) == 1104 + 2 * (144 + 144)


def test_decoder_flops_match_a_hand_count():
    # 2 positions over 3 encoder positions, multiply-adds per position: self q,k,v,o 4 x 16 + cross q,o 2 x 16
    # + FFN 2 x 32 = 160, so 320; self-attention over 1 then 2 keys: 2 x 4 x (1 + 2) = 24; cross-attention
    # 2 x 4 x 3 per position: 48; 2 logits rows of 4 x 10: 80. 472 MACs = 944 FLOPs.
    assert flops.decoder_flops(TINY, encoder_len=3, positions=2, logits=2) == 2 * (320 + 24 + 48 + 80) == 944
    assert flops.seq2seq_request_flops(TINY, source_len=3, new_tokens=2) == (1104, 944)
    gated = flops.Dims(4, 2, 2, 1, 1, 8, 10, gated_ffn=True)  # a third FFN matrix: + 4 x 8 per position
    assert flops.decoder_flops(gated, 3, 2, 2) == 944 + 2 * 2 * 32


def test_whisper_request_counts_one_window_and_the_prompt():
    en = flops.Dims(4, 2, 2, 1, 1, 8, 51864, mel_bins=2)
    assert flops.whisper_prompt_len(en) == 2
    assert flops.whisper_prompt_len(flops.Dims(4, 2, 2, 1, 1, 8, 51865)) == 4
    enc, dec = flops.whisper_request_flops(en, new_tokens=5, prompt_len=2)
    assert enc == flops.encoder_flops(en, flops.WHISPER_WINDOW)
    assert dec == flops.decoder_flops(en, flops.WHISPER_WINDOW, positions=6, logits=5)


def test_real_shapes_land_where_the_papers_put_them():
    from encdec.bench.seq2seq_checkpoints import SHAPES

    d = flops.seq2seq_dims(SHAPES["t5-small"])
    # Per decoded token, weights alone: 6 layers x (6 x 512^2 + 2 x 512 x 2048) + 512 x 32128 multiply-adds.
    weights = 2 * (6 * (6 * 512 * 512 + 2 * 512 * 2048) + 512 * 32128)
    one_more = flops.decoder_flops(d, 24, 65, 65) - flops.decoder_flops(d, 24, 64, 64)
    assert weights < one_more < weights * 1.05  # + attention over 65 + 24 keys per layer


def test_peak_numbers_and_tables():
    p = peak.measure_peak(threads=1, sizes=(128, 192), reps=1)
    assert p.fp32_gflops > 0 and p.copy_gbs > 0 and p.read_gbs > 0 and p.size in (128, 192)
    for name, value in (("bf16", p.bf16_gflops), ("int8", p.int8_gops)):
        assert (value is not None and value > 0) != (name in p.skipped)
    assert p.for_dtype("fp32") == p.fp32_gflops
    assert p.for_dtype("bf16") == (p.bf16_gflops or p.fp32_gflops)
    table = markdown_table(peak.peak_rows(p), peak.PEAK_COLUMNS)
    assert table.splitlines()[0] == "| measure | value | unit | note |" and len(table.splitlines()) == 2 + 5
    assert "fp32 sgemm" in table and "GB/s" in table
    assert peak.peak_line(p).startswith("Peak at 1 thread(s): fp32 sgemm ")
    merged = peak.best_of(p, peak.Peak(1, 64, (64,), p.fp32_gflops * 2, None, None, 1.0, 1.0, 0.1))
    assert merged.fp32_gflops == 2 * p.fp32_gflops and merged.size == 64 and merged.copy_gbs == p.copy_gbs


def test_bf16_is_skipped_with_a_reason_under_a_cap(monkeypatch):
    monkeypatch.setenv("ENCDEC_MAX_CPU_ISA", "avx2")
    p = peak.measure_peak(threads=1, sizes=(64,), reps=1)
    assert p.bf16_gflops is None and "capped to avx2" in p.skipped["bf16"]
    assert "capped to avx2" in markdown_table(peak.peak_rows(p), peak.PEAK_COLUMNS)


def test_achieved_columns():
    p = peak.Peak(2, 1536, (1536,), fp32_gflops=100.0, bf16_gflops=None, int8_gops=400.0, copy_gbs=20.0,
                  read_gbs=20.0, seconds=1.0)  # fmt: skip
    rows = [
        {"system": "HF transformers fp32", "wall s": 2.0, "GFLOP": 50.0, "encoder GFLOP": 10.0, "decoder GFLOP": 40.0},
        {
            "system": "encdec-serve int8 (2 services, gRPC)",
            "wall s": 1.0,
            "GFLOP": 50.0,
            "encoder GFLOP": 10.0,
            "decoder GFLOP": 40.0,
            "cpu s": {"encoder": 1.0, "decoder": 4.0},
        },  # fmt: skip
    ]
    roofline.add_achieved(rows, p, threads=2)
    hf, ours = rows
    assert hf["GFLOP/s (% peak)"] == "25 (25%)" and hf["encoder (% peak)"] == "-" and hf["decoder (% peak)"] == "-"
    assert hf["encoder GFLOP/s"] is None
    # int8 against the int8 peak; busy time = CPU s / 2 threads: encoder 10 / 0.5, decoder 40 / 2.
    assert ours["GFLOP/s"] == 50 and ours["% peak"] == pytest.approx(12.5)
    assert ours["encoder (% peak)"] == "20 (5%)" and ours["decoder (% peak)"] == "20 (5%)"
    assert roofline.row_dtype("encdec-serve bf16 (2 services)") == "bf16"


def test_decode_step_products_are_timed_and_counted():
    times = products.time_products([(48, 32)], rows=(1, 3), threads=1)
    assert set(times) == {(48, 32, 1), (48, 32, 3)}
    for ours_s, ref_s in times.values():
        assert ref_s > 0 and (ours_s is None or ours_s > 0)
    assert products.intensity(1, 512, 512) == pytest.approx(2 * 512 * 512 / (4 * (512 * 512 + 2 * 512)))
    step = products.step_products("whisper-base")
    assert sum(c for *_, c in step) == 6 * 6 + 1  # 6 layers of 6 products, then the output projection
    assert step[-1][1:3] == (51865, 512)


def test_roofline_png(tmp_path):
    pytest.importorskip("matplotlib")
    from encdec.bench.plot import plot_roofline

    p = peak.Peak(2, 1536, (1536,), 100.0, 800.0, None, 20.0, 20.0, 1.0)
    rows = [
        {"FLOP/byte": products.intensity(m, 512, 512), "rows": m, "ours GFLOP/s": 10.0 * m, "F.linear GFLOP/s": 5.0 * m}
        for m in (1, 16, 32)
    ]
    path = plot_roofline([{"peak": p.to_dict(), "rows": rows, "threads": 2}], tmp_path / "roof.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peak_sub_command_parses():
    from encdec.parser import build_parser

    args = build_parser().parse_args(["bench", "peak", "--rows", "1,32", "--cpu-isa", "avx2"])
    assert args.rows == "1,32" and args.threads == 2 and args.func.module == "products"


def test_peak_sizes_from_the_environment(monkeypatch):
    """``ENCDEC_BENCH_PEAK_SIZES`` replaces the peak's product sizes (the suite's bench runs use small ones); a
    value that is not positive integers is refused with the variable's name."""
    monkeypatch.delenv("ENCDEC_BENCH_PEAK_SIZES", raising=False)
    assert peak.default_sizes(2) == (1536, 3072) and peak.default_sizes(16) == (3072, 6144)
    monkeypatch.setenv("ENCDEC_BENCH_PEAK_SIZES", "128, 192")
    assert peak.default_sizes(2) == (128, 192)
    for bad in ("0", "abc", "128,", "-5"):
        monkeypatch.setenv("ENCDEC_BENCH_PEAK_SIZES", bad)
        with pytest.raises(ValueError, match="ENCDEC_BENCH_PEAK_SIZES"):
            peak.default_sizes(2)
