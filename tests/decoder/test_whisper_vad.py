"""silero-vad speech regions (faster-whisper's ``vad_filter`` defaults) and the map from speech-only times back."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from decoder_svc.whisper import vad
from decoder_svc.whisper.vad import SAMPLE_RATE, SpeechMap, VadOptions, speech_regions

ROOT = Path(__file__).resolve().parents[2]
LEAD_S = 5.0  # silence before and after the speech clip: longer than the 2 s that closes a region


@pytest.fixture(scope="module")
def padded_speech() -> tuple[np.ndarray, int, int]:
    """5 s of silence + encdec/data/sample.wav (7.27 s of speech) + 5 s of silence: (pcm, speech start, end)."""
    speech, rate = sf.read(ROOT / "encdec/data/sample.wav", dtype="float32")
    assert rate == SAMPLE_RATE
    lead = np.zeros(int(LEAD_S * SAMPLE_RATE), dtype=np.float32)
    pcm = np.concatenate([lead, speech, lead])
    return pcm, lead.size, lead.size + speech.size


def test_regions_cover_speech_not_silence(padded_speech):
    pcm, speech_start, speech_end = padded_speech
    regions = speech_regions(pcm)
    assert regions, "no speech found in sample.wav"
    pad = VadOptions().speech_pad_ms * SAMPLE_RATE // 1000
    # pauses inside the sentence are under 2 s, so the default options give one region
    assert len(regions) == 1
    start, end = regions[0]
    # within the speech span plus the 400 ms padding (and one 32 ms window of slack), never deep in the silences
    window = 512
    assert speech_start - pad - window <= start <= speech_start + window
    assert speech_end - window <= end <= speech_end + pad + window
    assert start > SAMPLE_RATE * 4 and end < pcm.size - SAMPLE_RATE * 4


def test_batched_regions_are_the_sequential_ones_within_a_window(padded_speech):
    """The VAD gate's batched run (stretches side by side): the same regions as silero's own loop, each edge
    within one 32 ms window, here and on the clip cut into pieces that end mid-stretch."""
    pcm, _, _ = padded_speech
    for clip in (pcm, pcm[: 3 * SAMPLE_RATE + 777], np.concatenate([pcm, pcm[::-1]])):
        exact, batched = speech_regions(clip), speech_regions(clip, batched=True)
        assert len(exact) == len(batched)
        for (a, b), (c, d) in zip(exact, batched, strict=True):
            assert abs(a - c) <= 512 and abs(b - d) <= 512
    probs = vad.speech_probabilities(pcm)
    assert len(probs) == -(-pcm.size // 512) and all(0.0 <= p <= 1.0 for p in probs)


def test_batched_probabilities_barely_depend_on_the_batch_size(padded_speech, monkeypatch):
    """``speech_probabilities`` runs up to MAX_BATCH stretches side by side: whatever that size, the same numbers to
    float rounding (the batched products' order) and the same regions."""
    pcm, _, _ = padded_speech
    clip = np.concatenate([pcm] * 3)  # 52 s: 25 stretches
    want = np.array(vad.speech_probabilities(clip))
    regions = speech_regions(clip, batched=True)
    for size in (1, 7):
        monkeypatch.setattr(vad, "MAX_BATCH", size)
        np.testing.assert_allclose(vad.speech_probabilities(clip), want, atol=1e-4)
        assert speech_regions(clip, batched=True) == regions, size


def test_speech_map_round_trip_on_detected_regions(padded_speech):
    pcm, speech_start, speech_end = padded_speech
    regions = speech_regions(pcm)
    speech_map = SpeechMap(regions, pcm.size)
    speech = speech_map.speech_pcm(pcm)
    assert speech.dtype == np.float32
    assert speech.size == speech_map.num_speech_samples == sum(end - start for start, end in regions)
    # a time in the middle of the speech-only audio lands inside the original speech span
    middle = speech.size / 2 / SAMPLE_RATE
    original = speech_map.original_time(middle)
    assert speech_start / SAMPLE_RATE < original < speech_end / SAMPLE_RATE
    # sample-exact: every mapped position holds the same sample in the original
    for k in range(0, speech.size, 997):
        t = k / SAMPLE_RATE
        assert pcm[round(speech_map.original_time(t) * SAMPLE_RATE)] == speech[k]


def test_speech_map_two_regions_boundaries():
    # regions [1 s, 2 s) and [4 s, 5 s) of a 6 s clip: 1 s removed before the first, 3 s before the second
    regions = [(SAMPLE_RATE, 2 * SAMPLE_RATE), (4 * SAMPLE_RATE, 5 * SAMPLE_RATE)]
    speech_map = SpeechMap(regions, 6 * SAMPLE_RATE)
    pcm = np.arange(6 * SAMPLE_RATE, dtype=np.float32)
    speech = speech_map.speech_pcm(pcm)
    np.testing.assert_array_equal(speech[:SAMPLE_RATE], pcm[SAMPLE_RATE : 2 * SAMPLE_RATE])
    np.testing.assert_array_equal(speech[SAMPLE_RATE:], pcm[4 * SAMPLE_RATE : 5 * SAMPLE_RATE])
    assert speech_map.original_time(0.0) == pytest.approx(1.0)
    assert speech_map.original_time(0.5) == pytest.approx(1.5)
    # on the boundary: a start belongs to the next region, an end to the one it closes
    assert speech_map.original_time(1.0) == pytest.approx(4.0)
    assert speech_map.original_time(1.0, is_end=True) == pytest.approx(2.0)
    assert speech_map.original_time(1.5) == pytest.approx(4.5)
    # past the end of the speech audio: the last region's shift
    assert speech_map.original_time(2.5) == pytest.approx(5.5)
    # an explicit region (a word's midpoint region) overrides the lookup
    assert speech_map.original_time(1.02, region=0) == pytest.approx(2.02)


def test_pure_silence_is_representable():
    speech_map = SpeechMap([], 3 * SAMPLE_RATE)
    speech = speech_map.speech_pcm(np.ones(3 * SAMPLE_RATE, dtype=np.float32))
    assert speech.shape == (0,) and speech.dtype == np.float32
    assert speech_map.num_speech_samples == 0
    with pytest.raises(ValueError, match="no speech regions"):
        speech_map.original_time(0.0)


@pytest.mark.parametrize("kind", ["zeros", "noise_-60dBFS"])
def test_silence_and_low_noise_have_no_regions(kind):
    n = 20 * SAMPLE_RATE
    if kind == "zeros":
        pcm = np.zeros(n, dtype=np.float32)
    else:
        rms = 10 ** (-60 / 20)
        pcm = (np.random.default_rng(0).standard_normal(n) * rms).astype(np.float32)
    assert speech_regions(pcm) == []


def test_concurrent_calls_agree():
    # The model keeps its state between windows: unserialised calls mix their states (or crash the TorchScript
    # interpreter). Fine options make the regions sensitive to any change in the probabilities.
    clips = [sf.read(path, dtype="float32")[0] for path in sorted((ROOT / "encdec/data").glob("*.wav"))]
    fine = VadOptions(min_silence_duration_ms=0, speech_pad_ms=0)
    expected = [speech_regions(clip, fine) for clip in clips]
    assert sum(len(regions) for regions in expected) > len(clips)  # pauses found: the probabilities matter
    with ThreadPoolExecutor(max_workers=len(clips)) as pool:
        assert list(pool.map(lambda clip: speech_regions(clip, fine), clips)) == expected


def test_options_validated():
    with pytest.raises(ValueError, match="threshold"):
        VadOptions(threshold=1.5)
    with pytest.raises(ValueError, match="neg_threshold"):
        VadOptions(threshold=0.5, neg_threshold=0.6)
    with pytest.raises(ValueError, match="speech_pad_ms"):
        VadOptions(speech_pad_ms=-1)
    with pytest.raises(ValueError, match="max_speech_duration_s"):
        VadOptions(max_speech_duration_s=0)
    with pytest.raises(ValueError, match="sorted, non-overlapping"):
        SpeechMap([(0, 100), (50, 200)], 1000)
    with pytest.raises(ValueError, match="sorted, non-overlapping"):
        SpeechMap([(0, 2000)], 1000)
    with pytest.raises(ValueError, match="1-D"):
        speech_regions(np.zeros((2, 100), dtype=np.float32))


def test_loading_keeps_torch_threads():
    # silero_vad's import sets torch.set_num_threads(1); a fresh process shows whether we put it back
    code = (
        "import torch; torch.set_num_threads(3)\n"
        "from decoder_svc.whisper.vad import load_vad_model; load_vad_model()\n"
        "print(torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"


def test_has_speech_hears_the_clip_and_not_silence_or_low_noise(padded_speech):
    """``has_speech`` (the check of a window the model rates silent, on the batched probabilities): the clip with
    its silent lead-in is speech, as is a 30 s window holding 1 s of it; digital silence and low white noise
    alone are not."""
    pcm, speech_start, _ = padded_speech
    assert vad.has_speech(pcm)
    window = np.zeros(30 * SAMPLE_RATE, np.float32)
    window[10 * SAMPLE_RATE : 11 * SAMPLE_RATE] = pcm[speech_start + SAMPLE_RATE : speech_start + 2 * SAMPLE_RATE]
    assert vad.has_speech(window)
    assert not vad.has_speech(np.zeros(30 * SAMPLE_RATE, np.float32))
    noise = np.random.default_rng(0).normal(0, 0.003, 30 * SAMPLE_RATE).astype(np.float32)
    assert not vad.has_speech(noise)
