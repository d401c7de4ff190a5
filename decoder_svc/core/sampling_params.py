"""Sampling parameters of one request, validated where they are read."""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass

# Temperatures below this sample greedily: dividing logits by a smaller one
# overflows float32 (vLLM uses the same cut-off, ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5
# The OpenAI API's cap on top_logprobs (vLLM's default max_logprobs is 20 too).
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Most parallel samples / beams of one request (vLLM has no fixed cap; 16 keeps one request's
# sequences well inside a decoder's max_num_seqs).
MAX_N = 16
MAX_BEAMS = 16
# Largest seed (2**63 - 1): sample i of a request draws from a generator seeded ``(seed + i) mod 2**63``
# (``decoder_svc.core.sampler.sample_seed``), so every seed is a non-negative int64, as vLLM's (an int64 field).
# The proto's ``uint64 seed`` documents the bound; a larger seed is refused, never silently wrapped.
MAX_SEED = 2**63 - 1
# Bounds of the floats whose effect is multiplied into the scores or exponentiated by a length (issue 20: a
# length_penalty of 400 overflowed ``generated_len ** length_penalty`` inside the shared engine step). HF and vLLM
# accept any positive temperature / repetition_penalty and any finite length_penalty; OpenAI caps temperature at 2;
# common values are 0.6..2. Inside these bounds ``max_len ** length_penalty`` stays a finite Python float and the
# float32 scores scaled by temperature / repetition_penalty stay finite for any model's max length and logits.
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MIN_LENGTH_PENALTY, MAX_LENGTH_PENALTY = -10.0, 10.0


def _float32_floor(x: float) -> float:
    """``x`` or its float32 rounding, whichever is lower: the proto's ``float`` fields arrive rounded to float32
    (0.01 as 0.009999999776...), and a documented inclusive bound must admit its own value sent that way."""
    return min(x, struct.unpack("f", struct.pack("f", x))[0])


_REPETITION_PENALTY_FLOOR = _float32_floor(MIN_REPETITION_PENALTY)

_INT_FIELDS = ("top_k", "min_tokens", "no_repeat_ngram_size", "top_logprobs", "n", "num_beams")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "length_penalty")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "logprobs", "early_stopping", "logprobs_before_warpers")


def _finite(x: float) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_types(params: SamplingParams) -> None:
    """Every field has its type (a float where an int belongs would reach ``torch.topk`` or a range compare).

    Raises:
        ValueError: naming the first field of the wrong type.
    """
    for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
        value = getattr(params, name)
        if not (_is_int(value) or (value is None and name in _OPTIONAL_INT_FIELDS)):
            raise ValueError(f"{name} must be an integer, got {value!r:.80}")
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {value!r:.80}")
    for name in _BOOL_FIELDS:
        value = getattr(params, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r:.80}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Processing order is HF ``generate``'s: repetition_penalty, no_repeat_ngram_size,
    min_tokens, (the checkpoint's forced / suppressed tokens), then for sampled
    rows temperature, top_k, top_p, min_p (``decoder_svc.core.sampler``).

    Attributes:
        temperature: softmax temperature, in [0, ``MAX_TEMPERATURE``]; 0 (or
            anything below ``SAMPLING_EPS``) means greedy (argmax).
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: nucleus sampling, keep the smallest set whose probability
            reaches top_p (Holtzman et al. 2019); 1.0 keeps all.
        seed: seed of this request's own ``torch.Generator``, in [0, ``MAX_SEED``] (2**63 - 1; the proto's
            uint64 field is documented with this bound, as vLLM's int64 seed); None draws from a fresh
            nondeterministic seed. Never the global RNG.
        max_tokens: most new tokens (end token included); None means up to the
            model's max decoder length.
        min_tokens: fewest new tokens: until this many are generated the end
            token and every ``stop_token_ids`` entry are masked to ``-inf`` (HF
            ``MinNewTokensLengthLogitsProcessor``) and no stop condition ends
            the sequence (vLLM's ``min_tokens``); 0 = off. Must be <= max_tokens.
        ignore_eos: keep generating past the end token (it is still appended
            and counted) until max_tokens / the model's max length (vLLM's
            ``ignore_eos``; for benchmarks).
        min_p: drop tokens whose probability is below ``min_p`` times the top
            token's (HF ``MinPLogitsWarper``, after top_p); 0 = off; in [0, 1].
        repetition_penalty: CTRL penalty (Keskar et al. 2019, HF
            ``RepetitionPenaltyLogitsProcessor``): the score of every token id
            already among the decoder tokens -- the decoder prompt (start token,
            forced prefix) included, as HF applies it over ``decoder_input_ids``;
            the encoder source is not counted -- is divided by it when positive,
            multiplied when negative. 1 = off; in [``MIN_REPETITION_PENALTY``,
            ``MAX_REPETITION_PENALTY``].
        no_repeat_ngram_size: ban any token that would repeat an n-gram of
            this size among the decoder tokens (prompt included, as HF
            ``NoRepeatNGramLogitsProcessor``); 0 = off.
        stop: strings that end the sequence (finish reason "stop") when they
            appear in the output text, wherever the token boundaries fall; the
            text is cut before the match (after it with
            ``include_stop_str_in_output``). At most ``MAX_STOP_STRINGS``, each
            1..``MAX_STOP_STRING_CHARS`` characters.
        stop_token_ids: token ids that end the sequence ("stop") besides the
            end token; the stopping token's text is not streamed (unless
            ``include_stop_str_in_output``). At most ``MAX_STOP_TOKEN_IDS``; each
            must be in the model's vocabulary (checked by the engine).
        include_stop_str_in_output: keep the matched stop string / stop token's
            text in the output.
        logprobs: return each generated token's log-probability.
        top_logprobs: also return the N most likely tokens per step, 0..20;
            needs ``logprobs``.
        n: with ``num_beams == 1``: independent samples of the request (vLLM's
            ``n``), 1..``MAX_N``; n > 1 needs temperature > 0 (greedy samples
            would all be equal). Sample i draws from its own generator seeded
            ``(seed + i) mod 2**63`` (``decoder_svc.core.sampler.sample_seed``). With
            beams: how many of the best finished hypotheses are returned (HF
            ``num_return_sequences``), <= ``num_beams``.
        num_beams: beam search width (HF ``generate(num_beams=...)``,
            ``decoder_svc.core.beam_search``), 1..``MAX_BEAMS``; 1 = off. Beam search
            is deterministic: it refuses temperature > 0, ``stop``,
            ``stop_token_ids``, ``ignore_eos`` and ``logprobs`` (the
            processors -- penalties, ``no_repeat_ngram_size``, ``min_tokens``,
            forced / suppressed tokens -- apply as in HF).
        length_penalty: beam search: a finished hypothesis scores
            ``sum(logprobs) / generated_len ** length_penalty`` (HF); in
            [``MIN_LENGTH_PENALTY``, ``MAX_LENGTH_PENALTY``] (outside it the power
            overflows for long outputs).
        early_stopping: beam search stopping (HF ``early_stopping``): True stops
            as soon as ``num_beams`` hypotheses finished; False stops when the best
            running beam, scored at its current length, cannot beat the worst
            finished one. HF's third mode "never" is not offered.

    Set by the decoder service for Whisper windows (never from the wire):

        logits_rules: an object with ``apply(scores [V] float32, token_ids) -> None`` run on
            the row's scores after the checkpoint's suppressions, in place, with every
            decoder token so far (e.g. ``decoder_svc.whisper.timestamp_rules.TimestampRules``,
            HF's ``WhisperTimeStampLogitsProcessor``); None = none.
        logprobs_before_warpers: logprobs are ``log_softmax`` of the processed scores before
            temperature / top-k / top-p / min-p (what HF's Whisper fallback averages).
        stop_criterion: a callable ``(output token ids) -> bool`` asked after each new token (once no stop
            token ended the sequence); True ends the sequence as "stop", its ``reason`` attribute the
            ``stop_reason`` (``decoder_svc.whisper.repetition.LoopStop``: a window that loops); None = none.
            One object per sequence (n = 1): it may keep state between calls.
        probe_position: a prompt position whose raw logits ``[V]`` (before any processor)
            come with the sequence's first output (``RequestOutput.probe_logits``); Whisper
            reads language and no-speech probabilities at ``<|startoftranscript|>``.

    Every field is type-checked too (an int field refuses a float, a bool field
    anything but True / False).

    Raises:
        ValueError: from ``validate`` with a message naming the bad field and its range.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    logits_rules: object | None = None
    logprobs_before_warpers: bool = False
    stop_criterion: object | None = None
    probe_position: int | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ValueError(f"{name} must be a list, got {value!r:.80}")
            object.__setattr__(self, name, tuple(value))
        bad = [t for t in self.stop_token_ids if not _is_int(t)]
        if bad:
            raise ValueError(f"stop_token_ids must be integers, got {bad[0]!r:.80}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        _check_types(self)
        if not (_finite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0 (0 disables it), got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise ValueError(
                f"seed must be in [0, {MAX_SEED}] (2**63 - 1: a non-negative signed 64-bit integer, as vLLM's "
                f"seed), got {self.seed}; send a smaller seed, e.g. seed % 2**63"
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if not (
            _finite(self.repetition_penalty)
            and _REPETITION_PENALTY_FLOOR <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                f"(1 disables it), got {self.repetition_penalty}"
            )
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0 (0 disables it), got {self.no_repeat_ngram_size}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
                raise ValueError(f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters, got {s!r:.80}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.probe_position is not None and (not _is_int(self.probe_position) or self.probe_position < 0):
            raise ValueError(f"probe_position must be a prompt index >= 0, got {self.probe_position!r:.80}")
        if self.logits_rules is not None and not callable(getattr(self.logits_rules, "apply", None)):
            raise ValueError("logits_rules must have an apply(scores, token_ids) method")
        if self.stop_criterion is not None and not callable(self.stop_criterion):
            raise ValueError("stop_criterion must be callable with the output token ids")
        if self.stop_criterion is not None and (self.n != 1 or self.num_beams != 1):
            raise ValueError("stop_criterion keeps one sequence's state: n = 1 and num_beams = 1 only")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not 1 <= self.num_beams <= MAX_BEAMS:
            raise ValueError(f"num_beams must be in [1, {MAX_BEAMS}], got {self.num_beams}")
        if not (_finite(self.length_penalty) and MIN_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY):
            raise ValueError(
                f"length_penalty must be in [{MIN_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}] "
                f"(1 = HF's default), got {self.length_penalty}"
            )
        if self.num_beams > 1:
            if self.n > self.num_beams:
                raise ValueError(
                    f"n ({self.n}) must be <= num_beams ({self.num_beams}): beam search returns the n best beams"
                )
            refused = [
                name
                for name, on in (
                    ("temperature > 0", not self.greedy),
                    ("stop", self.stop),
                    ("stop_token_ids", self.stop_token_ids),
                    ("ignore_eos", self.ignore_eos),
                    ("logprobs", self.logprobs),
                )
                if on
            ]
            if refused:
                raise ValueError(f"beam search (num_beams > 1) does not support {refused[0]}; leave it unset")
        elif self.n > 1 and self.greedy:
            raise ValueError(
                "n > 1 needs temperature > 0 (greedy samples would all be equal); use num_beams for n best"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
