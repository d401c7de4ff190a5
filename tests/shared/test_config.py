"""shared/config/: CLI flags over ENCDEC_* environment variables over defaults, and their errors."""

from __future__ import annotations

import argparse

import pytest

from shared.config import DecoderServiceConfig, config_from


def test_flag_wins_over_the_environment_and_errors_name_their_source():
    env = {"ENCDEC_STREAM_INTERVAL": "1000000", "ENCDEC_MAX_NUM_SEQS": "3"}
    cfg = config_from(DecoderServiceConfig, argparse.Namespace(stream_interval="4"), env)
    assert (cfg.stream_interval, cfg.max_num_seqs) == (4, 3)
    with pytest.raises(ValueError, match=r"stream_interval: cannot parse 'abc' \(from ENCDEC_STREAM_INTERVAL\) as int"):
        config_from(DecoderServiceConfig, None, {"ENCDEC_STREAM_INTERVAL": "abc"})
    with pytest.raises(ValueError, match=r"cannot parse 'x' \(from --block-size\)"):
        config_from(DecoderServiceConfig, argparse.Namespace(block_size="x"), {})
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        config_from(DecoderServiceConfig, None, {"ENCDEC_STREAM_INTERVAL": "0"})
    assert config_from(DecoderServiceConfig, None, {"REDIS_URL": "redis://h:1/0"}).redis_url == "redis://h:1/0"


def test_decode_hold_settings_are_validated():
    cfg = config_from(
        DecoderServiceConfig, None, {"ENCDEC_DECODE_HOLD_GAP_STEPS": "0", "ENCDEC_MAX_DECODE_HOLD_MS": "250"}
    )
    assert (cfg.decode_hold_gap_steps, cfg.max_decode_hold_ms) == (0, 250.0)
    with pytest.raises(ValueError, match="decode_hold_gap_steps must be >= 0, got -1"):
        config_from(DecoderServiceConfig, argparse.Namespace(decode_hold_gap_steps="-1"), {})
    with pytest.raises(ValueError, match=r"max_decode_hold_ms must be >= 0 \(0 = never hold\), got nan"):
        config_from(DecoderServiceConfig, None, {"ENCDEC_MAX_DECODE_HOLD_MS": "nan"})
