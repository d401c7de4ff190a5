"""Language detection and no-speech probability from the logits at ``<|startoftranscript|>``.

Both read the raw decoder logits of the one-token prompt ``[<|startoftranscript|>]`` (the
output position that predicts the language token):

- language: softmax over the language tokens only, every other id masked to ``-inf``
  (openai-whisper ``decoding.detect_language``; HF ``WhisperForConditionalGeneration.detect_language``
  takes the argmax of the same masked logits).
- no speech: softmax over the whole vocabulary, read at ``<|nospeech|>`` (``<|nocaptions|>`` in
  English-only checkpoints); openai-whisper's ``no_speech_prob``, HF ``WhisperNoSpeechDetection``.
"""

from __future__ import annotations

import torch

from shared.models.whisper_specials import WhisperLanguageError, WhisperSpecials


def _check_row(logits: torch.Tensor, highest_id: int) -> None:
    if logits.dim() != 1:
        raise ValueError(f"logits must be [V], got shape {tuple(logits.shape)}")
    if logits.shape[0] <= highest_id:
        raise ValueError(f"logits have {logits.shape[0]} entries, token id {highest_id} is out of range")


def _language_logits(logits: torch.Tensor, specials: WhisperSpecials) -> tuple[torch.Tensor, list[int]]:
    """``[V]`` float32 copy of ``logits`` with every non-language id at ``-inf``, and the language ids."""
    ids = specials.language_ids
    if not ids:
        raise WhisperLanguageError("this model is English-only: it has no language tokens to detect a language with")
    _check_row(logits, max(ids))
    masked = torch.full_like(logits, float("-inf"), dtype=torch.float32)  # [V]
    index = torch.tensor(ids, device=logits.device)
    masked[index] = logits[index].float()
    return masked, ids


def language_probabilities(logits: torch.Tensor, specials: WhisperSpecials) -> dict[str, float]:
    """Probability of each language of the checkpoint.

    Args:
        logits: ``[V]`` raw decoder logits at the ``<|startoftranscript|>`` position (prompt ``[sot]``).
        specials: the checkpoint's special tokens (``languages``: code -> token id).

    Returns:
        ISO code -> probability (float32 softmax over the language tokens only; sums to 1).

    Raises:
        WhisperLanguageError (a ValueError): English-only checkpoint (no language tokens).
        ValueError: ``logits`` is not 1-D or shorter than the largest language id.
    """
    masked, ids = _language_logits(logits, specials)
    probs = masked.softmax(dim=-1)[torch.tensor(ids, device=logits.device)].tolist()
    by_id = dict(zip(ids, probs, strict=True))
    return {code: by_id[tid] for code, tid in specials.languages.items()}


def detect_language(logits: torch.Tensor, specials: WhisperSpecials) -> tuple[str, float]:
    """The likeliest language: HF ``detect_language``'s choice (argmax; a tie goes to the lower id).

    Args: as ``language_probabilities``.

    Returns:
        ``(code, probability)``, e.g. ``("de", 0.93)``.

    Raises:
        As ``language_probabilities``.
    """
    masked, _ = _language_logits(logits, specials)
    token_id = int(masked.argmax())
    return specials.language_code(token_id), float(masked.softmax(dim=-1)[token_id])


def no_speech_probability(logits: torch.Tensor, specials: WhisperSpecials) -> float:
    """Probability that the window holds no speech.

    Args:
        logits: ``[V]`` raw decoder logits at the ``<|startoftranscript|>`` position.
        specials: the checkpoint's special tokens (``no_speech``).

    Returns:
        ``softmax(logits.float())[<|nospeech|>]``, in [0, 1].

    Raises:
        ValueError: ``logits`` is not 1-D or has no ``<|nospeech|>`` entry.
    """
    _check_row(logits, specials.no_speech)
    return float(logits.float().softmax(dim=-1)[specials.no_speech])
