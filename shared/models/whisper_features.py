"""Whisper preprocessing: log-mel features, tokenizer, special-token ids."""

from __future__ import annotations

import functools
import json
import re
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


# Frames per STFT chunk of ``log_mel_frames`` (30 s): the transient per chunk is a few MB whatever the clip's length.
MEL_CHUNK_FRAMES = 3000


def log_mel_frames(pcm: np.ndarray, num_mel_bins: int = 80, chunk_frames: int = MEL_CHUNK_FRAMES) -> np.ndarray:
    """Whisper's log-mel features of a whole clip of any length, unpadded (HF long-form's input).

    What ``WhisperFeatureExtractor(truncation=False, padding="longest")`` gives HF's long-form ``generate``
    (its torch path, ``_torch_extract_fbank_features``): an STFT with centre reflect padding, power, mel
    filters, log10 floored at 1e-10, one normalisation (``max - 8`` floor) over the whole clip; a window is then
    its slice ``[:, seek:seek + 3000]`` zero-padded to 3000 frames. Computed ``chunk_frames`` frames at a time
    (each frame sees only its own 400 samples, so chunks give the whole clip's frames), so memory is the output
    plus one chunk's STFT, not the whole clip's complex spectrum (about 10x the PCM).

    Args:
        pcm: ``[N]`` float32 mono samples at 16 kHz.
        chunk_frames: frames per STFT chunk.

    Returns:
        ``[num_mel_bins, N // 160]`` float32.

    Raises:
        ValueError: ``pcm`` is not one-dimensional.
    """
    pcm = np.asarray(pcm, dtype=np.float32)
    if pcm.ndim != 1:
        raise ValueError(f"expected mono pcm of shape [N], got shape {pcm.shape}")
    extractor = _feature_extractor(num_mel_bins)
    n_fft, hop = extractor.n_fft, extractor.hop_length
    num_frames = len(pcm) // hop  # HF drops the STFT's last frame: 1 + N // hop - 1
    out = np.empty((num_mel_bins, num_frames), np.float32)
    if num_frames == 0:
        return out
    # torch.stft(center=True) pads n_fft // 2 on each side by reflection; pad once, then frame chunks uncentred.
    padded = torch.nn.functional.pad(torch.from_numpy(pcm)[None, None], (n_fft // 2, n_fft // 2), mode="reflect")[0, 0]
    window = torch.hann_window(n_fft)
    filters_t = torch.from_numpy(extractor.mel_filters).to(torch.float32).T.contiguous()  # [num_mel_bins, 201]
    with torch.inference_mode():
        for first in range(0, num_frames, chunk_frames):
            last = min(first + chunk_frames, num_frames)
            piece = padded[first * hop : (last - 1) * hop + n_fft]
            stft = torch.stft(piece, n_fft, hop, window=window, center=False, return_complex=True)  # [201, frames]
            mel = filters_t @ (stft.abs() ** 2)
            out[:, first:last] = torch.clamp(mel, min=1e-10).log10().numpy()
    np.maximum(out, out.max() - 8.0, out=out)
    out += 4.0
    out /= 4.0
    return out


def window_features(frames: np.ndarray, seek: int, num_frames: int) -> np.ndarray:
    """``[num_mel_bins, 3000]``: frames ``[seek, seek + num_frames)`` of ``log_mel_frames``, zero-padded (HF
    ``_get_input_segment``)."""
    out = np.zeros((frames.shape[0], N_FRAMES), dtype=np.float32)
    piece = frames[:, seek : seek + min(num_frames, N_FRAMES)]
    out[:, : piece.shape[1]] = piece
    return out


def load_tokenizer(model_dir: str | Path):
    """The Whisper tokenizer of a CTranslate2 or HF-format directory.

    Read from ``tokenizer.json``, else built from the BPE files ``vocab.json`` +
    ``merges.txt`` with the added tokens of ``added_tokens.json`` (or
    ``tokenizer_config.json``'s ``added_tokens_decoder``), as transformers 4
    saved Whisper tokenizers. The BPE build is the one of HF ``WhisperTokenizer``
    (byte-level BPE, no prefix space); it has no post-processor, so
    ``encode(text)`` adds no prompt tokens (prompts come from ``WhisperSpecials``).

    Returns:
        ``transformers.PreTrainedTokenizerFast`` with ``<|endoftext|>`` as
        eos/bos/unk/pad token; special tokens (``<|...|>``) are marked special
        so ``decode(ids, skip_special_tokens=True)`` drops them (timestamp
        tokens ``<|0.00|>`` .. ``<|30.00|>`` are not special, as in openai's ``tokenizer.json``).

    Raises:
        FileNotFoundError: neither ``tokenizer.json`` nor ``vocab.json`` + ``merges.txt`` in ``model_dir``.
        ValueError: an added token does not get the id its file gives it.
    """
    from transformers import PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    eot = "<|endoftext|>"
    kwargs = dict(eos_token=eot, bos_token=eot, unk_token=eot, pad_token=eot)
    path = model_dir / "tokenizer.json"
    if path.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(path), **kwargs)
    if not ((model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file()):
        raise FileNotFoundError(f"no tokenizer.json (nor vocab.json + merges.txt) in {model_dir}")
    return PreTrainedTokenizerFast(tokenizer_object=_bpe_tokenizer(model_dir), **kwargs)


_TIMESTAMP = re.compile(r"<\|\d+\.\d+\|>")


def _bpe_tokenizer(model_dir: Path):
    """A ``tokenizers.Tokenizer`` from ``vocab.json`` + ``merges.txt`` + the added tokens (ids checked)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = _read_json(model_dir / "vocab.json")
    lines = (model_dir / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for content, token_id in sorted(special_token_ids(model_dir).items(), key=lambda kv: kv[1]):
        if _TIMESTAMP.fullmatch(content):
            tok.add_tokens([AddedToken(content, special=False, normalized=True)])
        else:
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        if tok.token_to_id(content) != token_id:
            raise ValueError(f"{model_dir}: added token {content!r} got id {tok.token_to_id(content)}, not {token_id}")
    return tok


def _read_json(path: Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def special_token_ids(model_dir: str | Path) -> dict[str, int]:
    """``content -> id`` of every added (special) token of the directory's tokenizer.

    Reads the JSON only, without building a tokenizer: ``tokenizer.json``'s
    ``added_tokens``, else ``added_tokens.json``, else ``tokenizer_config.json``'s
    ``added_tokens_decoder``; ``<|endoftext|>`` is taken from ``vocab.json`` when
    only that file holds it (English-only checkpoints keep it at GPT-2's id 50256).

    Raises:
        FileNotFoundError: none of those files lists added tokens.
    """
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        added = _read_json(model_dir / "tokenizer.json").get("added_tokens", [])
        return {t["content"]: int(t["id"]) for t in added}
    ids: dict[str, int] = {}
    if (model_dir / "added_tokens.json").is_file():
        ids = {k: int(v) for k, v in _read_json(model_dir / "added_tokens.json").items()}
    elif (model_dir / "tokenizer_config.json").is_file():
        decoder = _read_json(model_dir / "tokenizer_config.json").get("added_tokens_decoder") or {}
        ids = {t["content"]: int(i) for i, t in decoder.items()}
    if not ids:
        raise FileNotFoundError(
            f"no added tokens in {model_dir}: expected tokenizer.json, added_tokens.json or tokenizer_config.json"
        )
    if "<|endoftext|>" not in ids and (model_dir / "vocab.json").is_file():
        eot = _read_json(model_dir / "vocab.json").get("<|endoftext|>")
        if eot is not None:
            ids["<|endoftext|>"] = int(eot)
    return ids


# preprocessor_config.json settings our extractor fixes (transformers' WhisperFeatureExtractor defaults).
_FIXED_FEATURES = {"sampling_rate": SAMPLE_RATE, "hop_length": 160, "n_fft": 400, "chunk_length": 30}


def preprocessor_num_mel_bins(model_dir: str | Path) -> int | None:
    """``feature_size`` of an HF directory's ``preprocessor_config.json`` (80, or 128 for large-v3); None without the file.

    Raises:
        ValueError: the file sets a sampling rate, hop, FFT size or window other than
            the ones ``log_mel_spectrogram`` computes with (16 kHz, 160, 400, 30 s).
    """
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        return None
    cfg = _read_json(path)
    for key, ours in _FIXED_FEATURES.items():
        if key in cfg and cfg[key] != ours:
            raise ValueError(f"{path}: {key}={cfg[key]} is not supported (log_mel_spectrogram uses {ours})")
    return int(cfg["feature_size"]) if "feature_size" in cfg else None
