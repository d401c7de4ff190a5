"""Quality checks of one decoded Whisper window: compression ratio, average log-probability, the verdict.

The rules are HF transformers' long-form ``WhisperGenerationMixin`` (``models/whisper/generation_whisper.py``:
``_retrieve_compression_ratio``, ``_retrieve_avg_logprobs``, ``_need_fallback`` and the temperature loop of
``generate_with_fallback``), which follow openai-whisper's ``transcribe.py`` with two differences kept here:

* the compression ratio is over the token ids' bytes (each id as ``int(log2(vocab_size) / 8) + 1`` little-endian
  bytes), not over the decoded text, so the same threshold is looser than openai-whisper's (HF's docstring
  suggests 1.35 where openai-whisper uses 2.4);
* the no-speech skip is decided on every attempt (not once after the fallback loop), and it needs
  ``logprob_threshold``: the skip is ``avg_logprob < logprob_threshold and no_speech_prob > no_speech_threshold``.

Pure Python (numpy for HF's float32 arithmetic); no tensors, no I/O.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# openai-whisper's transcribe() defaults, which HF's docstrings and examples use too.
DEFAULT_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def compression_ratio(token_ids: Sequence[int], vocab_size: int) -> float:
    """Raw bytes over zlib-compressed bytes of the token ids (HF ``_retrieve_compression_ratio``).

    Args:
        token_ids: the window's generated ids as HF checks them: timestamps included, and the final
            ``<|endoftext|>`` included when the model produced it.
        vocab_size: the model's vocabulary; each id takes ``int(log2(vocab_size) / 8) + 1`` bytes
            (2 for Whisper's 51864/51865).

    Returns:
        The ratio (> 1 for repetitive output); 0.0 for no tokens (``0 / len(zlib.compress(b""))``).

    Raises:
        OverflowError: an id does not fit in that many bytes (as ``int.to_bytes``).
    """
    width = int(math.log2(vocab_size) / 8) + 1
    raw = b"".join(int(t).to_bytes(width, "little") for t in token_ids)
    return len(raw) / len(zlib.compress(raw))


def avg_logprob(token_logprobs: Sequence[float]) -> float:
    """Mean log-probability of the generated tokens (HF ``_retrieve_avg_logprobs``).

    HF sums the chosen token's log-probability of every generated step, ``<|endoftext|>`` included
    (openai-whisper's ``sum_logprob / (len(tokens) + 1)`` with its end token excluded from ``tokens``:
    the same number when the window ended on ``<|endoftext|>``; HF divides by the step count also
    when the window stopped at the length limit). The sum runs in float32 left to right and the
    division is float32, as HF does with 0-dim float32 tensors, so the value is bit-identical.

    Args:
        token_logprobs: ``[n]`` one per generated token: ``log_softmax`` of that step's processed
            scores (suppression and timestamp rules applied) before temperature scaling, at the
            chosen id (HF: ``log_softmax(scores * temperature)``, the scores being divided by it,
            so HF's value can differ from the pre-temperature one in the last float32 bit).

    Returns:
        The mean, a float32 value as a Python float.

    Raises:
        ValueError: no tokens (HF would divide by zero).
    """
    if len(token_logprobs) == 0:
        raise ValueError("avg_logprob of no tokens")
    total = np.float32(0.0)
    for lp in token_logprobs:
        total = np.float32(total + np.float32(lp))
    return float(np.float32(total / np.float32(len(token_logprobs))))


@dataclass(frozen=True)
class FallbackRules:
    """When to re-decode a window at the next temperature or skip it as silence (HF long-form options).

    Attributes:
        temperatures: tried in order; attempt ``k`` decodes at ``temperatures[k]`` (0.0 = greedy).
            When the last one fails too, see ``keep_best_attempt``.
        compression_ratio_threshold: retry when ``compression_ratio > threshold`` (None: never).
        logprob_threshold: retry when ``avg_logprob < threshold`` (None: never).
        no_speech_threshold: skip the window (no segments, seek past it) when
            ``no_speech_prob > threshold`` and ``avg_logprob < logprob_threshold`` (None: never).

    Raises:
        ValueError: no temperatures, a negative one, or ``no_speech_threshold`` without
            ``logprob_threshold`` (HF's ``_need_fallback`` reads an unset variable there and fails).
        keep_best_attempt: when every temperature failed, take the attempt with the highest average
            logprob among those under the compression-ratio threshold (all of them if none is), as
            faster-whisper does; False takes the last attempt, as HF and openai-whisper do (a
            temperature-1.0 sample is often gibberish).
    """

    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    keep_best_attempt: bool = True

    def __post_init__(self) -> None:
        if not self.temperatures or any(t < 0.0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty tuple of values >= 0, got {self.temperatures!r}")
        if self.no_speech_threshold is not None and self.logprob_threshold is None:
            raise ValueError("no_speech_threshold needs logprob_threshold (HF skips on both together)")


class Verdict(enum.Enum):
    """What to do with one decoded attempt of a window."""

    ACCEPT = "accept"  # split it into segments and seek on
    RETRY = "retry"  # decode the same window again at the next temperature
    SKIP = "skip"  # no speech: no segments, seek past the whole window


@dataclass(frozen=True)
class Judgement:
    """The verdict on one attempt and the numbers behind it.

    Attributes:
        verdict: see ``Verdict``.
        temperature: the attempt's temperature.
        compression_ratio: of the generated ids (with the end token), always computed.
        avg_logprob: see ``avg_logprob``, always computed.
        no_speech_prob: the probability of ``<|nospeech|>`` at the ``<|startoftranscript|>`` position.
        needs_fallback: HF's flag; True with ACCEPT when the last temperature still failed.
    """

    verdict: Verdict
    temperature: float
    compression_ratio: float
    avg_logprob: float
    no_speech_prob: float
    needs_fallback: bool


def best_attempt(judgements: Sequence[Judgement], rules: FallbackRules) -> int:
    """Index of the attempt to keep when every temperature failed (``FallbackRules.keep_best_attempt``):
    the highest ``avg_logprob`` among attempts whose compression ratio is within the threshold, else among all."""
    limit = rules.compression_ratio_threshold
    fine = [i for i, j in enumerate(judgements) if limit is None or j.compression_ratio <= limit]
    pool = fine or list(range(len(judgements)))
    return max(pool, key=lambda i: judgements[i].avg_logprob)


def judge(
    generated: Sequence[int],
    token_logprobs: Sequence[float],
    no_speech_prob: float,
    attempt: int,
    rules: FallbackRules,
    vocab_size: int,
    heard_no_speech: bool = False,
) -> Judgement:
    """HF ``_need_fallback`` on one attempt, and what ``generate_with_fallback`` does with it.

    Args:
        generated: the ids produced after the prompt, the final ``<|endoftext|>`` included when produced.
        token_logprobs: ``[len(generated)]`` see ``avg_logprob``.
        no_speech_prob: softmax of the raw logits at the ``<|startoftranscript|>`` position, at
            ``<|nospeech|>`` (HF ``WhisperNoSpeechDetection``); compared in float32 as HF does.
        attempt: index into ``rules.temperatures`` of this decode.
        rules: the thresholds.
        vocab_size: the model's vocabulary (for ``compression_ratio``).
        heard_no_speech: a voice activity detector found no speech in the window either. Then the
            no-speech rule skips the window whatever its logprob: Whisper says " you" over digital
            silence with a confident logprob, which HF's rule (no_speech and low logprob) keeps.

    Returns:
        SKIP when the no-speech rule fires (it overrides a retry), else RETRY when a threshold
        failed and a higher temperature is left, else ACCEPT.

    Raises:
        ValueError: ``attempt`` outside ``rules.temperatures``, or ``token_logprobs`` not one per token.
    """
    if not 0 <= attempt < len(rules.temperatures):
        raise ValueError(f"attempt {attempt} outside the {len(rules.temperatures)} temperatures")
    if len(token_logprobs) != len(generated):
        raise ValueError(f"{len(token_logprobs)} logprobs for {len(generated)} generated tokens")
    ratio = compression_ratio(generated, vocab_size)
    mean_lp = avg_logprob(token_logprobs)
    needs_fallback = False
    if rules.compression_ratio_threshold is not None and ratio > rules.compression_ratio_threshold:
        needs_fallback = True
    # HF compares 0-dim float32 tensors with Python floats, i.e. in float32
    low_logprob = rules.logprob_threshold is not None and np.float32(mean_lp) < np.float32(rules.logprob_threshold)
    if low_logprob:
        needs_fallback = True
    skip = (
        rules.no_speech_threshold is not None
        and (low_logprob or heard_no_speech)
        and np.float32(no_speech_prob) > np.float32(rules.no_speech_threshold)
    )
    if skip:
        verdict, needs_fallback = Verdict.SKIP, False
    elif needs_fallback and attempt < len(rules.temperatures) - 1:
        verdict = Verdict.RETRY
    else:
        verdict = Verdict.ACCEPT
    return Judgement(
        verdict=verdict,
        temperature=rules.temperatures[attempt],
        compression_ratio=ratio,
        avg_logprob=mean_lp,
        no_speech_prob=float(no_speech_prob),
        needs_fallback=needs_fallback,
    )
