"""shared.models.whisper_features.log_mel_frames: chunked, it gives HF WhisperFeatureExtractor's long-form
features (bit for bit with 3000-frame chunks on long clips; within float32 rounding of the mel matmul for
other chunk sizes, whose BLAS kernels differ), in a fraction of the memory."""

from __future__ import annotations

import numpy as np
import pytest

from shared.models.whisper_features import _feature_extractor, log_mel_frames


def _hf_frames(pcm: np.ndarray, num_mel_bins: int = 80) -> np.ndarray:
    out = _feature_extractor(num_mel_bins)(
        pcm, sampling_rate=16_000, return_tensors="np", truncation=False, padding="longest"
    ).input_features
    return out[0, :, : len(pcm) // 160]


@pytest.mark.parametrize("num_samples", [16_000 * 95 + 37, 16_000 * 31, 479_999, 400, 201])
@pytest.mark.parametrize("chunk_frames", [3000, 777, 1])
def test_chunks_equal_hf_whole_clip(num_samples, chunk_frames):
    rng = np.random.default_rng(num_samples)
    pcm = (0.1 * rng.standard_normal(num_samples)).astype(np.float32)
    pcm[: num_samples // 3] *= 0.01  # a quiet stretch: the max - 8 floor is clip-wide
    want = _hf_frames(pcm)
    got = log_mel_frames(pcm, 80, chunk_frames)
    assert got.shape == want.shape == (80, num_samples // 160) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    if chunk_frames == 3000 and num_samples > 16_000 * 30:
        np.testing.assert_array_equal(got, want)


def test_128_mel_bins():
    pcm = (0.1 * np.random.default_rng(0).standard_normal(16_000 * 40)).astype(np.float32)
    np.testing.assert_array_equal(log_mel_frames(pcm, 128), _hf_frames(pcm, 128))


def test_rejects_non_mono():
    with pytest.raises(ValueError, match="mono"):
        log_mel_frames(np.zeros((2, 1600), np.float32))
