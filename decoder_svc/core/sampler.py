"""Per-row token sampling over a batch of logits.

Order follows HF ``generate`` (``GenerationMixin._get_logits_processor``).
Logits processors, on greedy and sampled rows alike:

1. ``repetition_penalty`` (``RepetitionPenaltyLogitsProcessor``) and
2. ``no_repeat_ngram_size`` (``NoRepeatNGramLogitsProcessor``), both over the
   row's decoder tokens (prompt + output, HF's ``input_ids``);
3. ``min_tokens`` (``MinNewTokensLengthLogitsProcessor``): the end token and
   ``stop_token_ids`` masked until that many tokens were generated;
4. BART-family ``ForcedBOSTokenLogitsProcessor`` at ``cur_len == 1`` and
   ``ForcedEOSTokenLogitsProcessor`` at ``cur_len == max_length - 1``, leaving
   only the forced token;
5. Whisper's ``SuppressTokensLogitsProcessor`` (every step) and
   ``SuppressTokensAtBeginLogitsProcessor`` (first generated token), ``-inf``;
6. the row's own ``params.logits_rules`` (Whisper windows: HF's
   ``WhisperTimeStampLogitsProcessor``, ``decoder_svc.whisper.timestamp_rules``).

Then for sampled rows the warpers in HF order: temperature, top-k, top-p,
min-p (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper``, all with ``min_tokens_to_keep=1``), and a multinomial
draw from each request's own ``torch.Generator`` so a seeded request gets the
same tokens whatever else shares its batch; greedy rows take the argmax.

Parallel samples (``params.n > 1``): the prompt step's row (``num_samples
== n``) draws sample 0 from the request's generator and sample i from the
generator of ``sample_seq_id(request_id, i)`` seeded ``sample_seed(seed, i)``,
all from the same warped scores; the other samples are forked with those first
tokens (``SamplerOutput.extra_token_ids``, ``decoder_svc.core.sequence_group``), and
each sample's later rows use its own generator. So every sample is reproducible and independent of what shares the
batch.

Beam rows (``params.num_beams > 1``) are not sampled: as HF ``_beam_search``
does, the processors run on ``log_softmax(logits)`` and the processed
log-probabilities are returned (``SamplerOutput.beam_logprobs``); their
returned token is a placeholder -1.

Log-probabilities (rows with ``params.logprobs``) are ``log_softmax`` of the
scores the token was picked from: after the processors, and for sampled rows
after the warpers too (vLLM's ``logprobs_mode="processed_logprobs"``; vLLM
v1's own default is the raw model output). So the picked token always has a
finite logprob, and a greedy row's token is its top-1 alternative.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from decoder_svc.core.logits_processors import (
    NEG_INF,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    banned_ngram_tokens,
)
from decoder_svc.core.outputs import SamplerOutput, TokenLogprobs
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.core.sequence import sample_seq_id
from kernels.cpu_argmax import argmax_rows


def multinomial_one(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from ``probs`` ``[V]``: the token ``torch.multinomial(probs, 1, generator=generator)``
    returns, leaving the generator in the same state, for less on a CPU float32 row.

    ``torch.multinomial`` without replacement draws one sample as ``argmax(probs / q)`` with ``q ~ Exp(1)``
    from ``exponential_`` (ATen ``Distributions.cpp``, the Gumbel-max trick), and the CPU ``exponential_``
    computes each ``q`` as ``-log1p(-u)`` in double precision from one uniform double ``u`` of the generator,
    one element after another (ATen ``TransformationHelper.h``), then rounds it to float32. Here the ``u``
    come from ``uniform_`` on a float64 tensor (the same draws in the same order) and ``log1p`` runs
    vectorised instead of element by element, which is where ``torch.multinomial`` spends its time on a
    Whisper row (measured: docs/benchmarks.md). ``tests/decoder/test_sampler.py`` checks the tokens and the
    generator's state against ``torch.multinomial``. Other devices, dtypes and shapes call ``torch.multinomial``.

    Args:
        probs: ``[V]`` probabilities (finite, >= 0, positive sum: softmax output).
        generator: the request's generator (advanced by ``V`` draws, as ``torch.multinomial`` advances it).
    """
    if probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.dim() != 1:
        return int(torch.multinomial(probs, 1, generator=generator).item())
    u = torch.empty(probs.shape, dtype=torch.float64).uniform_(generator=generator)
    q = u.neg_().log1p_().neg_().to(torch.float32)  # [V] float32 Exp(1) draws, as exponential_ rounds them
    return int(torch.div(probs, q).argmax())


def sample_seed(seed: int | None, index: int) -> int | None:
    """Generator seed of sample ``index`` of a request seeded ``seed``: ``(seed + index) mod 2**63``."""
    return None if seed is None else (seed + index) % 2**63


@dataclass
class SamplingRow:
    """One row of a batch: its request, params, and whether it samples its first token."""

    request_id: str
    params: SamplingParams
    is_first_token: bool
    num_tokens: int = 0  # decoder tokens so far (prompt + output): HF's cur_len
    max_len: int = 0  # the sequence's max tokens (prompt + output); 0 = unknown
    num_output_tokens: int = 0  # generated tokens so far (``min_tokens`` counts these)
    stop_token_ids: tuple[int, ...] = ()  # ids masked while num_output_tokens < params.min_tokens
    token_ids: Seq[int] = ()  # decoder tokens (prompt + output); only filled when a penalty needs them
    index: int = 0  # sample index within the request (its generator is seeded sample_seed(seed, index))
    num_samples: int = 1  # n on the prompt step of an n > 1 request (draws n first tokens), else 1

    @property
    def beam(self) -> bool:
        return self.params.num_beams > 1

    @classmethod
    def from_sequence(cls, seq) -> SamplingRow:
        """The row of a ``decoder_svc.core.sequence.Sequence`` about to sample its next token."""
        p = seq.sampling_params
        needs_history = p.repetition_penalty != 1.0 or p.no_repeat_ngram_size or p.logits_rules is not None
        history = seq.all_token_ids if needs_history else ()
        first = seq.num_output_tokens == 0
        num_samples = p.n if (first and p.num_beams == 1 and seq.index == 0) else 1
        return cls(
            seq.request_id,
            p,
            first,
            seq.num_tokens,
            seq.max_len,
            seq.num_output_tokens,
            seq.stop_token_ids,
            history,
            seq.index,
            num_samples,
        )


class Sampler:
    """Picks one token per row.

    Args:
        suppress_tokens: ids masked to ``-inf`` on every step.
        begin_suppress_tokens: ids masked on a sequence's first generated token.
        forced_bos_token_id: the only allowed token when ``row.num_tokens == 1``.
        forced_eos_token_id: the only allowed token when ``row.num_tokens == row.max_len - 1``.

    Each call returns a ``decoder_svc.core.outputs.SamplerOutput``: the tokens, and the
    ``TokenLogprobs``, extra samples and beam log-probabilities of the rows that have
    them. The only state kept between calls is each request's generator.
    """

    def __init__(
        self,
        suppress_tokens: Seq[int] = (),
        begin_suppress_tokens: Seq[int] = (),
        forced_bos_token_id: int | None = None,
        forced_eos_token_id: int | None = None,
    ) -> None:
        self.suppress_tokens = torch.tensor(sorted(set(suppress_tokens)), dtype=torch.long)
        self.begin_suppress_tokens = torch.tensor(sorted(set(begin_suppress_tokens)), dtype=torch.long)
        self.forced_bos_token_id = forced_bos_token_id
        self.forced_eos_token_id = forced_eos_token_id
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
        """The request's own generator, created (seeded) on first use on ``device`` (the logits').

        A CUDA generator (Philox) draws other numbers than a CPU one (Mersenne
        Twister) from the same seed: seeded sampling reproduces per device type.
        """
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**63))
            self._generators[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        """Forgets a finished or aborted request's generator."""
        self._generators.pop(request_id, None)

    def process_logits(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        inplace: bool = False,
        failed: dict[str, BaseException] | None = None,
    ) -> torch.Tensor:
        """``[N, V]`` float32 -> ``[N, V]`` after the logits processors (steps 1-5 of the module docstring).

        ``inplace``: write into ``logits`` itself (float32 only; the caller owns
        it) instead of a copy: 4 MB per batch-32 t5 step not copied.
        ``failed``: row request id -> exception; a row whose own processors raise is
        recorded there (its scores are then meaningless) instead of failing the batch;
        rows already in it are skipped. None: the exception propagates.
        """
        logits = logits.float() if inplace and logits.dtype == torch.float32 else logits.float().clone()
        for i, r in enumerate(rows):
            if failed is not None and r.request_id in failed:
                continue
            try:
                self._process_row(logits[i], r)
            except Exception as exc:  # noqa: BLE001 - this row's own failure (decoder_svc.core.step_failures)
                if failed is None:
                    raise
                failed[r.request_id] = exc
        for i, r in enumerate(rows):
            forced = None
            if self.forced_bos_token_id is not None and r.num_tokens == 1:
                forced = self.forced_bos_token_id
            if self.forced_eos_token_id is not None and r.max_len and r.num_tokens == r.max_len - 1:
                forced = self.forced_eos_token_id
            if forced is not None:
                logits[i] = NEG_INF
                logits[i, forced] = 0.0
        if self.suppress_tokens.numel():
            logits[:, self.suppress_tokens.to(logits.device)] = NEG_INF
        first = [i for i, r in enumerate(rows) if r.is_first_token]
        if first and self.begin_suppress_tokens.numel():
            idx = torch.tensor(first, dtype=torch.long, device=logits.device)
            logits[idx[:, None], self.begin_suppress_tokens.to(logits.device)[None, :]] = NEG_INF
        for i, r in enumerate(rows):
            if r.params.logits_rules is not None and not (failed is not None and r.request_id in failed):
                try:
                    r.params.logits_rules.apply(logits[i], r.token_ids)
                except Exception as exc:  # noqa: BLE001 - this row's own failure (decoder_svc.core.step_failures)
                    if failed is None:
                        raise
                    failed[r.request_id] = exc
        return logits

    @staticmethod
    def _process_row(scores: torch.Tensor, r: SamplingRow) -> None:
        """``[V]`` in place: the row's own processors (repetition penalty, n-gram ban, min_tokens)."""
        p = r.params
        if p.repetition_penalty != 1.0:
            apply_repetition_penalty(scores, r.token_ids, p.repetition_penalty)
        if p.no_repeat_ngram_size:
            banned = banned_ngram_tokens(r.token_ids, p.no_repeat_ngram_size)
            if banned:
                scores[[t for t in banned if t < scores.shape[0]]] = NEG_INF
        if r.num_output_tokens < p.min_tokens and r.stop_token_ids:  # HF MinNewTokensLengthLogitsProcessor
            scores[list(r.stop_token_ids)] = NEG_INF

    @staticmethod
    def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """``[..., V]`` -> warped scores: temperature, top-k, top-p, then min-p."""
        logits = apply_temperature(logits, params.temperature)
        logits = apply_top_k(logits, params.top_k)
        logits = apply_top_p(logits, params.top_p)
        return apply_min_p(logits, params.min_p)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits``: ``[N, V]`` (row i for ``rows[i]``) -> N token ids and what came with them.

        Overwrites ``logits`` (the step's own). A row whose own processing raises
        (its penalties, warpers, draw or logprobs) is listed in ``SamplerOutput.failed``
        with token -1; the other rows are unaffected (``decoder_svc.core.step_failures``).

        Raises:
            ValueError: ``logits`` does not have one row per sampling row.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        result = SamplerOutput()
        if not rows:
            return result
        beam = [i for i, r in enumerate(rows) if r.beam]
        if beam:  # HF _beam_search: processors over log_softmax(logits)
            idx = torch.tensor(beam, dtype=torch.long, device=logits.device)
            beam_rows = [rows[i] for i in beam]
            lp = self.process_logits(torch.log_softmax(logits[idx].float(), dim=-1), beam_rows, failed=result.failed)
            lp = lp.cpu()
            result.beam_logprobs = {
                r.request_id: lp[j] for j, r in enumerate(beam_rows) if r.request_id not in result.failed
            }
        logits = self.process_logits(logits, rows, inplace=True, failed=result.failed)
        out = argmax_rows(logits).tolist()  # greedy rows are done in one batched op (kernels/cpu_argmax.py)
        for i, row in enumerate(rows):
            if row.beam or row.request_id in result.failed:
                out[i] = -1
                continue
            try:
                out[i] = self._pick(logits[i], out[i], row, result)
            except Exception as exc:  # noqa: BLE001 - this row's own failure (decoder_svc.core.step_failures)
                result.failed[row.request_id] = exc
                result.logprobs.pop(row.request_id, None)
                result.extra_token_ids.pop(row.request_id, None)
                out[i] = -1
        result.sampled_token_ids = out
        return result

    def _pick(self, scores: torch.Tensor, argmax: int, row: SamplingRow, result: SamplerOutput) -> int:
        """Row ``row``'s token from its processed ``scores`` ``[V]`` (``argmax``: greedy's pick); fills its
        logprobs and extra samples into ``result``."""
        token, processed = argmax, scores
        if not row.params.greedy:
            warped = self.warp(scores, row.params)
            probs = warped.softmax(dim=-1)  # [V]
            gen = self.generator(row.request_id, sample_seed(row.params.seed, row.index), probs.device)
            # softmax output lies in [0, 1] or is NaN, so its sum is finite exactly when every entry is: an
            # overflowing row keeps its argmax and never fails the batch (one reduction, not isfinite + all)
            if math.isfinite(float(probs.sum())):
                token = multinomial_one(probs, gen)
                scores = warped
                if row.num_samples > 1:
                    result.extra_token_ids[row.request_id] = self._draw_extra_samples(
                        row, probs, warped, result.logprobs
                    )
            # else: keeps the row's argmax (and reports the processed scores' logprobs)
        if row.params.logprobs:
            picked_from = processed if row.params.logprobs_before_warpers else scores
            # greedy's pick is a maximum of the scores, so of their log-softmax (monotonic): rank 1, not counted
            known_rank = 1 if token == argmax and picked_from is processed else None
            result.logprobs[row.request_id] = token_logprobs(picked_from, token, row.params.top_logprobs, known_rank)
        return token

    def _draw_extra_samples(
        self, row: SamplingRow, probs: torch.Tensor, warped: torch.Tensor, logprobs: dict[str, TokenLogprobs]
    ) -> list[int]:
        """First tokens of samples 1..n-1 of ``row``'s request, each from its own generator;
        their logprobs go into ``logprobs`` under their ``sample_seq_id`` when the row asks for them."""
        extra = []
        for k in range(1, row.num_samples):
            sid = sample_seq_id(row.request_id, k)
            tok = multinomial_one(probs, self.generator(sid, sample_seed(row.params.seed, k), probs.device))
            extra.append(tok)
            if row.params.logprobs:
                logprobs[sid] = token_logprobs(warped, tok, row.params.top_logprobs)
        return extra


def token_logprobs(scores: torch.Tensor, token_id: int, top_n: int, rank: int | None = None) -> TokenLogprobs:
    """``scores`` ``[V]`` -> the logprobs of ``token_id`` and the ``top_n`` most likely finite tokens; ``rank``:
    the token's rank when the caller knows it (1 for an argmax), else 1 + the count of strictly likelier tokens."""
    lp = torch.log_softmax(scores.float(), dim=-1)
    chosen = lp[token_id]
    rank = rank if rank is not None else int((lp > chosen).sum()) + 1
    top: list[tuple[int, float]] = []
    if top_n:
        vals, idx = torch.topk(lp, min(top_n, lp.shape[-1]))
        top = [(int(t), float(v)) for v, t in zip(vals.tolist(), idx.tolist()) if v != NEG_INF]
    return TokenLogprobs(int(token_id), float(chosen), rank, top)
