"""KV cache sized from a memory budget: parsing, the self/cross split, precedence, the start-up report."""

from __future__ import annotations

import logging

import pytest

from decoder_svc.core.kv_budget import block_bytes, free_memory_bytes, resolve_budget, size_kv_cache
from shared.config import DecoderServiceConfig, parse_memory_size

# Whisper tiny.en: 4 decoder layers, 6 heads of 64, float32, 16-token blocks.
WHISPER_BLOCK_BYTES = 4 * 2 * 16 * 6 * 64 * 4  # 196608
MIB = 2**20


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", None),
        ("2GiB", (2 * 2**30, False)),
        ("512MB", (512e6, False)),
        ("512 mib", (512 * MIB, False)),
        ("1073741824", (1073741824, False)),
        ("1.5G", (1.5e9, False)),
        ("0.3", (0.3, True)),
        ("30%", (0.3, True)),
        ("100%", (1.0, True)),
    ],
)
def test_parse_memory_size(text, expected):
    got = parse_memory_size(text)
    if expected is None:
        assert got is None
    else:
        assert got == (pytest.approx(expected[0]), expected[1])


@pytest.mark.parametrize("text", ["abc", "2XB", "-1GiB", "0", "0%", "150%", "GiB", "nan"])
def test_bad_memory_size_names_the_forms(text):
    with pytest.raises(ValueError, match=r"2GiB, 512MB.*0\.3, 30%"):
        parse_memory_size(text)
    with pytest.raises(ValueError, match="memory size"):
        DecoderServiceConfig(kv_cache_memory=text)


def whisper_sizing(**kw):
    args = dict(
        self_block_bytes=WHISPER_BLOCK_BYTES,
        cross_block_bytes=WHISPER_BLOCK_BYTES,
        block_size=16,
        max_decoder_len=448,
        max_encoder_len=1500,
        max_num_seqs=16,
    )
    return size_kv_cache(**{**args, **kw})


def test_budget_split_in_proportion_to_one_max_length_request():
    assert block_bytes(4, 16, 6, 64, 4) == WHISPER_BLOCK_BYTES
    s = whisper_sizing(budget_bytes=64 * MIB)
    # 64 MiB / 192 KiB = 341 blocks; one request: ceil(447/16) = 28 self + ceil(1500/16) = 94 cross.
    assert (s.self_blocks_per_request, s.cross_blocks_per_request) == (28, 94)
    assert s.num_self_blocks + s.num_cross_blocks == 341
    assert s.num_cross_blocks == 341 * 94 // 122 == 262 and s.num_self_blocks == 79
    assert s.max_concurrent_requests == 2 and s.total_bytes <= 64 * MIB
    big = whisper_sizing(budget_bytes=2 * 2**30)
    assert big.max_concurrent_requests == 2**31 // WHISPER_BLOCK_BYTES // 122 == 89
    assert "max concurrent max-length requests: 89 (max_num_seqs=16 caps" in big.describe(16)
    # A float16 cross pool (kv_transfer_dtype) halves cross blocks: the split is by bytes per request.
    half = whisper_sizing(budget_bytes=64 * MIB, cross_block_bytes=WHISPER_BLOCK_BYTES // 2)
    per_request = 28 * WHISPER_BLOCK_BYTES + 94 * WHISPER_BLOCK_BYTES // 2
    assert half.num_cross_blocks == 64 * MIB * 94 // per_request == 427
    assert half.num_self_blocks == (64 * MIB - 427 * WHISPER_BLOCK_BYTES // 2) // WHISPER_BLOCK_BYTES == 127
    assert half.max_concurrent_requests == 4 and half.total_bytes <= 64 * MIB


def test_explicit_block_counts_win():
    s = whisper_sizing(budget_bytes=64 * MIB, num_self_blocks=30)
    assert s.num_self_blocks == 30 and s.num_cross_blocks == 341 - 30  # the rest of the budget
    s = whisper_sizing(budget_bytes=64 * MIB, num_cross_blocks=94)
    assert s.num_cross_blocks == 94 and s.num_self_blocks == 341 - 94
    s = whisper_sizing(budget_bytes=64 * MIB, num_self_blocks=5, num_cross_blocks=7)
    assert (s.num_self_blocks, s.num_cross_blocks, s.budget_bytes) == (5, 7, None)
    s = whisper_sizing()  # no budget: max_num_seqs max-length requests
    assert (s.num_self_blocks, s.num_cross_blocks, s.max_concurrent_requests) == (16 * 28, 16 * 94, 16)


def test_budget_below_one_request_is_refused():
    with pytest.raises(ValueError, match=r"one max-length request needs 28 self \+ 94 cross blocks \(22\.9 MiB\)"):
        whisper_sizing(budget_bytes=20 * MIB)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        whisper_sizing(budget_bytes=64 * MIB, num_cross_blocks=340)  # 1 block left for self


def test_fraction_of_free_memory():
    free = free_memory_bytes("cpu")
    with open("/proc/meminfo") as f:
        available_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert abs(free - available_kib * 1024) < 2**30  # the same reading, a moment apart
    budget = resolve_budget("0.001")
    assert 0 < budget < free and abs(budget - free // 1000) < 2**30 // 1000
    assert resolve_budget("") is None and resolve_budget("3MiB") == 3 * MIB


def test_build_engine_reports_blocks_and_concurrency(whisper_model_dir, caplog):
    from decoder_svc.startup import build_engine
    from shared.models.registry import load_model

    config = DecoderServiceConfig(model=str(whisper_model_dir), kv_cache_memory="64MiB", max_num_seqs=4)
    with caplog.at_level(logging.INFO, logger="decoder_svc.startup"):
        engine, pool = build_engine(config, load_model(whisper_model_dir))
    try:
        bm = engine.block_manager
        assert (bm.num_self_blocks, bm.num_cross_blocks) == (79, 262)
        assert pool.tensor.shape[2] == 262 and engine.model_runner.self_kv_cache.shape[2] == 79
        assert (
            "79 self blocks of 192.0 KiB + 262 cross blocks of 192.0 KiB" in caplog.text
            and "max concurrent max-length requests: 2" in caplog.text
        )
    finally:
        pool.close()
