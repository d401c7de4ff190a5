"""``encdec bench whisper --long-form`` on one 31 s recording with tiny.en, and its parts.

The CLI runs as a user would (a subprocess starting redis + both services, HF and faster-whisper in
processes of their own); the test checks the machine line, the table's columns and rows and the JSON,
not speed. The recording builder, the text normalization and the word error rate are checked alone, and
the CTranslate2 short-form anchor's English prompt against HF on whisper-base (multilingual).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers.cli import encdec

from encdec.bench.machine import machine_line
from encdec.bench.whisper_longform import (
    MAX_S,
    MIN_S,
    PAUSE_S,
    SAMPLE_RATE,
    build_recordings,
    clip_lengths,
    normalize_text,
    word_error_rate,
)

ROOT = Path(__file__).resolve().parents[2]
HAS_FW = importlib.util.find_spec("faster_whisper") is not None
FW_REASON = "faster-whisper is not installed (the [test] or [bench] extra): no faster-whisper rows"
LONG_FORM_MAX_S = 35  # > 30 s: two windows, the long-form algorithm (the recording built comes to 31.4 s)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    pytest.importorskip("jiwer", reason="jiwer is not installed (the [bench] extra): no WER column")
    out = tmp_path_factory.mktemp("longform") / "bench.json"
    cmd = encdec(
        "bench",
        "whisper",
        "--model",
        "whisper-tiny.en",
        "--requests",
        "0",
        "--long-form",
        "--long-form-clips",
        "1",
        "--long-form-max-s",
        str(LONG_FORM_MAX_S),
        "--json",
        str(out),
    )
    # The bench starts its own redis-server, and its processes run as a user's do: without the Triton CPU
    # interpreter tests/conftest.py sets for this process (under it every service starts ~2 s slower).
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TRITON_INTERPRET")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, json.loads(out.read_text())


def _table(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("| system | mode | clips |"))
    rows = []
    for line in lines[i:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_machine_line_and_table(bench_run):
    stdout, payload = bench_run
    first = stdout.splitlines()[0]
    assert first.startswith("Machine: ") and "torch " in first and "thread(s) per core" in first
    assert machine_line(payload["machine"]) in first
    table = _table(stdout)
    assert table[0] == payload["long_form"]["columns"] and "WER vs HF" in table[0]
    long_form = payload["long_form"]
    assert len(long_form["lengths_s"]) == 1 and 30 < long_form["lengths_s"][0] <= LONG_FORM_MAX_S
    rows = {(r["system"], r["mode"]): r for r in long_form["rows"]}
    assert len(table) == 2 + len(rows)
    assert rows["HF transformers fp32", "sequential"]["WER vs HF"] == 0.0  # the reference
    ours = rows["encdec-serve fp32 (2 services, gRPC)", "1 at once"]
    assert ours["words"] > 30 and 0 <= ours["WER vs HF"] < 0.5
    assert ours["audio s"] == pytest.approx(long_form["lengths_s"][0])
    assert long_form["ours_cpu_s"]["encoder"] > 0 and long_form["ours_cpu_s"]["decoder"] > 0
    assert "ours: encoder" in stdout
    for r in rows.values():
        assert r["clips"] == 1 and r["wall s"] > 0
        assert r["x realtime"] == pytest.approx(r["audio s"] / r["wall s"])


@pytest.mark.skipif(not HAS_FW, reason=FW_REASON)
def test_faster_whisper_rows(bench_run):
    stdout, payload = bench_run
    rows = {(r["system"], r["mode"]): r for r in payload["long_form"]["rows"]}
    sequential = rows["faster-whisper fp32", "WhisperModel, file after file"]
    batched = next(r for (s, m), r in rows.items() if m.startswith("BatchedInferencePipeline"))
    assert sequential["x faster-whisper"] == pytest.approx(1.0)
    for r in (sequential, batched):
        assert r["words"] > 30 and 0 <= r["WER vs HF"] < 0.5
    assert stdout.count("ours vs faster-whisper") == 2 and "(target >= 1.5x)" in stdout


def test_clip_lengths():
    assert clip_lengths(4) == [120.0, 180.0, 240.0, 300.0]
    assert clip_lengths(1) == [MIN_S] and clip_lengths(3, 200.0) == [120.0, 200.0, 200.0]
    assert clip_lengths(2)[-1] == MAX_S
    with pytest.raises(ValueError):
        clip_lengths(0)


def test_recordings_are_whole_clips_and_pauses():
    rng = np.random.default_rng(1)
    clips = [rng.uniform(0.1, 1.0, int(s * SAMPLE_RATE)).astype(np.float32) for s in (2.3, 4.1, 7.0)]  # no zeros
    targets = [30.0, 61.5]
    recordings = build_recordings(clips, targets, seed=5)
    assert [r.dtype for r in recordings] == [np.float32] * 2
    again = build_recordings(clips, targets, seed=5)
    assert all(np.array_equal(a, b) for a, b in zip(recordings, again, strict=True))
    assert not np.array_equal(recordings[0], build_recordings(clips, targets[:1], seed=6)[0])
    lengths = {len(c) for c in clips}
    for pcm, target in zip(recordings, targets, strict=True):
        assert target - 7.0 - PAUSE_S[1] < len(pcm) / SAMPLE_RATE <= target
        silent = np.concatenate([[True], pcm == 0, [True]]).astype(np.int8)
        starts, ends = np.flatnonzero(np.diff(silent) == -1), np.flatnonzero(np.diff(silent) == 1)
        assert starts[0] == 0 and ends[-1] == len(pcm)  # starts with a clip, ends without its pause
        assert {int(n) for n in ends - starts} <= lengths  # whole clips only
        pauses = (starts[1:] - ends[:-1]) / SAMPLE_RATE
        assert len(pauses) >= 2 and all(PAUSE_S[0] - 1e-4 <= s <= PAUSE_S[1] for s in pauses)
    with pytest.raises(ValueError):
        build_recordings([], [30.0])


def test_normalize_and_word_error_rate():
    pytest.importorskip("jiwer", reason="jiwer is not installed (the [bench] extra)")
    assert normalize_text(" Let us meet at 3 o'clock,  on Main-Street! ") == "let us meet at 3 oclock on main street"
    assert word_error_rate(["Good morning, everyone."], ["good morning everyone"]) == 0.0
    # one substitution and one deletion over 2 + 3 reference words, as one corpus
    assert word_error_rate(["a b", "c d e"], ["a x", "c d"]) == pytest.approx(2 / 5)
    assert word_error_rate(["", "c d"], ["anything", "c d"]) == 0.0  # empty references are left out
    assert word_error_rate([""], ["a"]) is None


def test_ct2_anchor_prompts_english_like_hf_on_base():
    pytest.importorskip("ctranslate2", reason="ctranslate2 is not installed (the [bench] extra)")
    import torch

    from decoder_svc.session.audio import decode_audio
    from encdec import DATA_DIR
    from encdec.bench.faster_whisper_anchor import run_anchor
    from encdec.bench.hf_whisper import build_hf_whisper
    from shared.models.registry import resolve_model
    from shared.models.whisper_features import log_mel_spectrogram

    model_dir = resolve_model("whisper-base")[1]
    clip = str(DATA_DIR / "short.wav")
    got = run_anchor("ct2", str(model_dir), "float32", 2, "batched", 1, [clip])["tokens"][0]
    hf = build_hf_whisper(model_dir)
    with torch.inference_mode():
        feats = log_mel_spectrogram(decode_audio(Path(clip).read_bytes()))[None]  # [1, 80, 3000]
        want = hf.generate(feats, language="en", task="transcribe").tolist()[0]
    eot = hf.generation_config.eos_token_id
    assert [t for t in got if t < eot] == [t for t in want if t < eot] and len(got) > 5
