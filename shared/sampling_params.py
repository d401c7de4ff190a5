"""Sampling parameters of one request, validated where they are read."""

from __future__ import annotations

from dataclasses import dataclass

# Temperatures below this sample greedily: dividing logits by a smaller one
# overflows float32 (vLLM uses the same cut-off, ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Attributes:
        temperature: softmax temperature; 0 (or anything below
            ``SAMPLING_EPS``) means greedy (argmax).
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: nucleus sampling, keep the smallest set whose probability
            reaches top_p (Holtzman et al. 2019); 1.0 keeps all.
        seed: seed of this request's own ``torch.Generator``; None draws from
            a fresh nondeterministic seed. Never the global RNG.
        max_tokens: most new tokens (end token included); None means up to the
            model's max decoder length.
        min_tokens: fewest new tokens: until this many are generated the end
            token and every ``stop_token_ids`` entry are masked to ``-inf`` (HF
            ``MinNewTokensLengthLogitsProcessor``) and no stop condition ends
            the sequence (vLLM's ``min_tokens``); 0 = off. Must be <= max_tokens.
        ignore_eos: keep generating past the end token (it is still appended
            and counted) until max_tokens / the model's max length (vLLM's
            ``ignore_eos``; for benchmarks).

    Raises:
        ValueError: from ``validate`` with a message naming the bad field.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
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
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
