"""Quality checks of one decoded Whisper window: compression ratio, average log-probability, the verdict.

Two sets of decoding rules (``FallbackRules.decoding_rules``):

* ``"openai"`` (the default): openai-whisper's ``transcribe.py`` / ``decoding.py``, which faster-whisper's
  ``transcribe.py`` follows: the compression ratio is zlib's over the UTF-8 bytes of the window's decoded
  text (timestamps left out, stripped; ``whisper.utils.compression_ratio``), which the threshold 2.4 was
  chosen for; at a temperature above 0, ``best_of`` samples are drawn and the one with the highest sum
  logprob / length is judged (``rank_samples``, openai-whisper's ``MaximumLikelihoodRanker``). Ours on top:
  a repetition loop too short to compress past the threshold fails an attempt too
  (``decoder_svc.whisper.repetition``), and a looping sample or attempt is kept only when all loop.
* ``"hf"``: HF transformers' long-form ``WhisperGenerationMixin`` (``models/whisper/generation_whisper.py``:
  ``_retrieve_compression_ratio``, ``_retrieve_avg_logprobs``, ``_need_fallback`` and the temperature loop of
  ``generate_with_fallback``): the compression ratio is over the token ids' bytes (each id as
  ``int(log2(vocab_size) / 8) + 1`` little-endian bytes), so the same threshold 2.4 lets repetition loops
  through (HF's docstring suggests 1.35; HF PR #27658); one sample per temperature. Kept for the parity
  tests against HF ``generate``.

In both the no-speech skip is ``avg_logprob < logprob_threshold and no_speech_prob > no_speech_threshold``,
decided on every attempt (openai-whisper's loop stops on the same condition, then skips).

Pure Python (numpy for HF's float32 arithmetic); no tensors, no I/O.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from decoder_svc.whisper.repetition import has_loop

# openai-whisper's transcribe() defaults, which HF's docstrings and examples use too.
DEFAULT_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
DECODING_RULES = ("openai", "hf")
DEFAULT_BEST_OF = 5  # openai-whisper's CLI and faster-whisper's transcribe() default
MAX_BEST_OF = 16
PROMPT_RESET_ON_TEMPERATURE = 0.5  # faster-whisper's default; openai-whisper's fixed "temperature > 0.5"


def text_compression_ratio(text: str) -> float:
    """UTF-8 bytes over zlib-compressed bytes of ``text`` (openai-whisper ``whisper.utils.compression_ratio``,
    faster-whisper ``get_compression_ratio``): above 2.4 for text that repeats itself; 0.0 for no text.

    Args:
        text: the window's decoded text tokens (timestamps and special tokens left out), stripped.
    """
    raw = text.encode("utf-8")
    return len(raw) / len(zlib.compress(raw))


def rank_samples(
    samples: Sequence[tuple[Sequence[int], Sequence[float]]], eot: int, acceptable: Sequence[bool] | None = None
) -> int:
    """Index of the sample to judge among ``best_of`` at one temperature: the highest sum logprob divided by the
    length (openai-whisper's ``decoding.MaximumLikelihoodRanker`` with ``length_penalty=None``; CTranslate2's
    ``num_hypotheses`` with ``length_penalty=1`` in faster-whisper ranks the same way), among the ``acceptable``
    samples when any is. That last rule is ours: a repetition loop is the likeliest sequence of all (each
    repeat more certain than the last), so by likelihood alone the loop wins over every sample that did not
    loop, and the window fails again at every temperature.

    Args:
        samples: per sample ``(generated ids, their logprobs)``; a final ``eot`` counts in the sum (openai-whisper's
            ``sum_logprobs`` adds the end token's logprob) but not in the length.
        eot: ``<|endoftext|>``.
        acceptable: per sample, whether its text neither loops nor passes the compression-ratio threshold
            (``text_passes``); None ranks by likelihood only.

    Returns:
        The index; the first of equal scores.

    Raises:
        ValueError: no samples, or not one flag per sample.
    """
    if not samples:
        raise ValueError("rank_samples of no samples")
    if acceptable is not None and len(acceptable) != len(samples):
        raise ValueError(f"{len(acceptable)} flags for {len(samples)} samples")

    def score(sample: tuple[Sequence[int], Sequence[float]]) -> float:
        ids, lps = sample
        length = len(ids) - (1 if ids and ids[-1] == eot else 0)
        return sum(lps) / max(length, 1)

    pool = list(range(len(samples)))
    if acceptable is not None:
        pool = [i for i in pool if acceptable[i]] or pool
    return max(pool, key=lambda i: score(samples[i]))


def text_passes(text: str, threshold: float | None) -> bool:
    """openai rules: the text neither repeats itself in a loop (``repetition.has_loop``) nor compresses above
    ``threshold`` (None: no ratio limit)."""
    return not has_loop(text) and (threshold is None or text_compression_ratio(text) <= threshold)


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
    """When to re-decode a window at the next temperature or skip it as silence.

    Attributes:
        temperatures: tried in order; attempt ``k`` decodes at ``temperatures[k]`` (0.0 = greedy).
            When the last one fails too, see ``keep_best_attempt``.
        compression_ratio_threshold: retry when ``compression_ratio > threshold`` (None: never); the ratio
            is of the text (``"openai"``) or of the ids (``"hf"``), see the module docstring.
        logprob_threshold: retry when ``avg_logprob < threshold`` (None: never).
        no_speech_threshold: skip the window (no segments, seek past it) when
            ``no_speech_prob > threshold`` and ``avg_logprob < logprob_threshold`` (None: never).
        keep_best_attempt: when every temperature failed, take the attempt with the highest average
            logprob among those under the compression-ratio threshold (all of them if none is), as
            faster-whisper does; False takes the last attempt, as HF and openai-whisper do (a
            temperature-1.0 sample is often gibberish).
        decoding_rules: ``"openai"`` or ``"hf"`` (module docstring).
        best_of: samples drawn at each temperature above 0 (``"openai"``; ``"hf"`` draws one), the best by
            ``rank_samples`` judged. 1 = one sample.
        prompt_reset_on_temperature: ``"openai"``: the next window is not conditioned on the previous text
            after a window decoded above this temperature (faster-whisper's option; openai-whisper's 0.5);
            ``"hf"`` conditions only after a temperature below 0.5.

    Raises:
        ValueError: no temperatures, a negative one, ``no_speech_threshold`` without
            ``logprob_threshold`` (HF's ``_need_fallback`` reads an unset variable there and fails),
            unknown ``decoding_rules``, ``best_of`` outside [1, ``MAX_BEST_OF``].
    """

    temperatures: tuple[float, ...] = DEFAULT_TEMPERATURES
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    keep_best_attempt: bool = True
    decoding_rules: str = "openai"
    best_of: int = DEFAULT_BEST_OF
    prompt_reset_on_temperature: float = PROMPT_RESET_ON_TEMPERATURE

    def __post_init__(self) -> None:
        if not self.temperatures or any(t < 0.0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty tuple of values >= 0, got {self.temperatures!r}")
        if self.no_speech_threshold is not None and self.logprob_threshold is None:
            raise ValueError("no_speech_threshold needs logprob_threshold (HF skips on both together)")
        if self.decoding_rules not in DECODING_RULES:
            raise ValueError(f"decoding_rules must be one of {DECODING_RULES}, got {self.decoding_rules!r}")
        if not 1 <= self.best_of <= MAX_BEST_OF:
            raise ValueError(f"best_of must be in [1, {MAX_BEST_OF}], got {self.best_of}")

    @property
    def openai(self) -> bool:
        return self.decoding_rules == "openai"

    def samples_at(self, temperature: float) -> int:
        """Samples to draw at ``temperature``: ``best_of`` above 0 under openai's rules, else 1."""
        return self.best_of if self.openai and temperature > 0 else 1

    def conditions_after(self, temperature: float) -> bool:
        """Whether the window after one accepted at ``temperature`` is prompted with the previous text."""
        if self.openai:
            return temperature <= self.prompt_reset_on_temperature
        return temperature < 0.5  # HF: do_condition_on_prev_tokens only below 0.5


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
        compression_ratio: of the decoded text (openai rules) or of the generated ids with the end token
            (hf), always computed.
        avg_logprob: see ``avg_logprob``, always computed.
        no_speech_prob: the probability of ``<|nospeech|>`` at the ``<|startoftranscript|>`` position.
        needs_fallback: HF's flag; True with ACCEPT when the last temperature still failed.
        repetition: openai rules: the text holds a repetition loop (``decoder_svc.whisper.repetition``), which
            fails the attempt as a compression ratio over the threshold does.
    """

    verdict: Verdict
    temperature: float
    compression_ratio: float
    avg_logprob: float
    no_speech_prob: float
    needs_fallback: bool
    repetition: bool = False


def best_attempt(judgements: Sequence[Judgement], rules: FallbackRules) -> int:
    """Index of the attempt to keep when every temperature failed (``FallbackRules.keep_best_attempt``):
    the highest ``avg_logprob`` among attempts whose compression ratio is within the threshold (and, openai rules,
    without a repetition loop), else among all."""
    limit = rules.compression_ratio_threshold
    fine = [i for i, j in enumerate(judgements) if (limit is None or j.compression_ratio <= limit) and not j.repetition]
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
    text: str | None = None,
    heard_speech: bool = False,
) -> Judgement:
    """The fallback test on one attempt (HF ``_need_fallback``; openai-whisper ``decode_with_fallback``), and what
    the temperature loop does with it.

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
        text: the attempt's decoded text (``"openai"`` rules: its compression ratio is judged).
        heard_speech: a voice activity detector heard speech in the window (ours, with the VAD gate): then it is
            never skipped as silence. Whisper's no-speech rule fires on a window that starts in a loop (a low
            logprob) where the model also rates ``<|nospeech|>`` high, and 30 s of speech are lost; faster-whisper
            and openai-whisper lose them too. Such a window is decoded again hotter instead.

    Returns:
        SKIP when the no-speech rule fires (it overrides a retry), else RETRY when a threshold
        failed and a higher temperature is left, else ACCEPT.

    Raises:
        ValueError: ``attempt`` outside ``rules.temperatures``, ``token_logprobs`` not one per token, or no
            ``text`` under ``"openai"`` rules.
    """
    if not 0 <= attempt < len(rules.temperatures):
        raise ValueError(f"attempt {attempt} outside the {len(rules.temperatures)} temperatures")
    if len(token_logprobs) != len(generated):
        raise ValueError(f"{len(token_logprobs)} logprobs for {len(generated)} generated tokens")
    repetition = False
    if rules.openai:
        if text is None:
            raise ValueError("openai decoding rules judge the decoded text: pass text")
        ratio = text_compression_ratio(text)
        repetition = has_loop(text)
    else:
        ratio = compression_ratio(generated, vocab_size)
    mean_lp = avg_logprob(token_logprobs)
    needs_fallback = repetition
    if rules.compression_ratio_threshold is not None and ratio > rules.compression_ratio_threshold:
        needs_fallback = True
    # HF compares 0-dim float32 tensors with Python floats, i.e. in float32
    low_logprob = rules.logprob_threshold is not None and np.float32(mean_lp) < np.float32(rules.logprob_threshold)
    if low_logprob:
        needs_fallback = True
    skip = (
        rules.no_speech_threshold is not None
        and not heard_speech
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
        repetition=repetition,
    )
