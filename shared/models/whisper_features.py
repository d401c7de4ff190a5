"""Whisper preprocessing: log-mel features, tokenizer, special-token ids."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 16_000
N_FRAMES = 3000  # 30 s window at a hop of 160 samples


@functools.lru_cache(maxsize=4)
def _feature_extractor(num_mel_bins: int):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=SAMPLE_RATE)


def log_mel_spectrogram(pcm: np.ndarray, num_mel_bins: int = 80) -> torch.Tensor:
    """Whisper's log-mel features of one clip, padded (or cut) to 30 s.

    Computed with transformers' ``WhisperFeatureExtractor`` (built once per
    ``num_mel_bins``), so features match HF exactly.

    Args:
        pcm: ``[N]`` float32 mono samples at 16 kHz, nominally in [-1, 1].
            Audio longer than 30 s is cut by the extractor.
        num_mel_bins: 80 for tiny.en (128 for large-v3).

    Returns:
        ``[num_mel_bins, 3000]`` float32.

    Raises:
        ValueError: ``pcm`` is not one-dimensional.
    """
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim != 1:
        raise ValueError(f"expected mono pcm of shape [N], got shape {pcm.shape}")
    feats = _feature_extractor(num_mel_bins)(pcm, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features
    return torch.from_numpy(np.ascontiguousarray(feats[0], dtype=np.float32))  # [num_mel_bins, 3000]


def load_tokenizer(model_dir: str | Path):
    """The Whisper tokenizer from ``model_dir/tokenizer.json``.

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with ``<|endoftext|>`` as
        eos/bos/unk/pad token; special tokens (``<|...|>``) are marked special
        so ``decode(ids, skip_special_tokens=True)`` drops them.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``model_dir``.
    """
    from transformers import PreTrainedTokenizerFast

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
    eot = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=eot, bos_token=eot, unk_token=eot, pad_token=eot)


def special_token_ids(model_dir: str | Path) -> dict[str, int]:
    """``content -> id`` of every added (special) token in ``tokenizer.json``.

    Reads the JSON only, without building a tokenizer.
    """
    with open(Path(model_dir) / "tokenizer.json", encoding="utf-8") as f:
        added = json.load(f).get("added_tokens", [])
    return {t["content"]: int(t["id"]) for t in added}
