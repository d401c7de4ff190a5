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
   ``SuppressTokensAtBeginLogitsProcessor`` (first generated token), ``-inf``.

Then for sampled rows the warpers in HF order: temperature, top-k, top-p,
min-p (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper``, all with ``min_tokens_to_keep=1``), and a multinomial
draw from each request's own ``torch.Generator`` so a seeded request gets the
same tokens whatever else shares its batch; greedy rows take the argmax.

Parallel samples (``params.n > 1``): the prompt step's row (``num_samples
== n``) draws sample 0 from the request's generator and sample i from the
generator of ``sample_seq_id(request_id, i)`` seeded ``sample_seed(seed, i)``,
all from the same warped scores; the engine forks the other samples with those
first tokens (``take_extra_samples``), and each sample's later rows use its own
generator. So every sample is reproducible and independent of what shares the
batch.

Beam rows (``params.num_beams > 1``) are not sampled: as HF ``_beam_search``
does, the processors run on ``log_softmax(logits)`` and the processed
log-probabilities are handed to the engine (``take_beam_logprobs``); their
returned token is a placeholder -1.

Log-probabilities (rows with ``params.logprobs``) are ``log_softmax`` of the
scores the token was picked from: after the processors, and for sampled rows
after the warpers too (vLLM's ``logprobs_mode="processed_logprobs"``; vLLM
v1's own default is the raw model output). So the picked token always has a
finite logprob, and a greedy row's token is its top-1 alternative.
"""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from decoder_svc.sequence import sample_seq_id
from kernels.cpu_argmax import argmax_rows
from decoder_svc.sampling_params import SamplingParams

NEG_INF = -float("inf")


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
        """The row of a ``decoder_svc.sequence.Sequence`` about to sample its next token."""
        p = seq.sampling_params
        history = seq.all_token_ids if (p.repetition_penalty != 1.0 or p.no_repeat_ngram_size) else ()
        first = seq.num_output_tokens == 0
        num_samples = p.n if (first and p.num_beams == 1 and seq.index == 0) else 1
        return cls(seq.request_id, p, first, seq.num_tokens, seq.max_len,
                   seq.num_output_tokens, seq.stop_token_ids, history, seq.index, num_samples)


@dataclass
class TokenLogprobs:
    """Log-probabilities of one sampled token.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (natural log; see the module docstring for
            which distribution).
        rank: 1 + how many tokens have a strictly larger logprob.
        top: up to ``params.top_logprobs`` (token_id, logprob) pairs, most likely
            first; tokens filtered to ``-inf`` are left out.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int, filter_value: float = NEG_INF) -> torch.Tensor:
    """``[..., V]``: keep scores >= the k-th largest (ties kept), as HF ``TopKLogitsWarper``."""
    if top_k <= 0:
        return logits
    k = min(max(top_k, 1), logits.size(-1))
    kth = torch.topk(logits, k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, filter_value)


def apply_top_p(logits: torch.Tensor, top_p: float, filter_value: float = NEG_INF) -> torch.Tensor:
    """``[..., V]``: nucleus filter exactly as HF ``TopPLogitsWarper`` (keeps at least one token)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cum_probs <= (1 - top_p)
    sorted_remove[..., -1:] = False
    remove = sorted_remove.scatter(-1, sorted_idx, sorted_remove)
    return logits.masked_fill(remove, filter_value)


def apply_min_p(logits: torch.Tensor, min_p: float, filter_value: float = NEG_INF) -> torch.Tensor:
    """``[..., V]``: drop tokens with probability < ``min_p * p_max`` (HF ``MinPLogitsWarper``; the top token is kept)."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    remove = probs < min_p * top
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, filter_value)


def apply_repetition_penalty(logits: torch.Tensor, token_ids: Seq[int], penalty: float) -> torch.Tensor:
    """``[V]`` in place: every id in ``token_ids`` scores ``s / penalty`` if ``s >= 0`` else ``s * penalty``
    (HF ``RepetitionPenaltyLogitsProcessor``; ids outside ``[0, V)`` are ignored)."""
    if penalty == 1.0 or not token_ids:
        return logits
    v = logits.shape[-1]
    ids = torch.tensor(sorted({t for t in token_ids if 0 <= t < v}), dtype=torch.long, device=logits.device)
    scores = logits[ids]
    logits[ids] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits


def banned_ngram_tokens(token_ids: Seq[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already in ``token_ids`` (HF ``NoRepeatNGramLogitsProcessor``).

    The last ``n - 1`` tokens are matched against every earlier window of
    ``n - 1`` tokens; each match bans the token that followed it. O(len * n).
    """
    cur = len(token_ids)
    if n <= 0 or cur < n:
        return []
    ids = list(token_ids)
    prefix = ids[cur - n + 1 :]
    return [ids[j + n - 1] for j in range(cur - n + 1) if ids[j : j + n - 1] == prefix]


class Sampler:
    """Picks one token per row.

    Args:
        suppress_tokens: ids masked to ``-inf`` on every step.
        begin_suppress_tokens: ids masked on a sequence's first generated token.
        forced_bos_token_id: the only allowed token when ``row.num_tokens == 1``.
        forced_eos_token_id: the only allowed token when ``row.num_tokens == row.max_len - 1``.

    After each call, ``take_logprobs()`` returns the step's ``TokenLogprobs`` of
    the rows that asked for them.
    """

    def __init__(self, suppress_tokens: Seq[int] = (), begin_suppress_tokens: Seq[int] = (),
                 forced_bos_token_id: int | None = None, forced_eos_token_id: int | None = None) -> None:
        self.suppress_tokens = torch.tensor(sorted(set(suppress_tokens)), dtype=torch.long)
        self.begin_suppress_tokens = torch.tensor(sorted(set(begin_suppress_tokens)), dtype=torch.long)
        self.forced_bos_token_id = forced_bos_token_id
        self.forced_eos_token_id = forced_eos_token_id
        self._generators: dict[str, torch.Generator] = {}
        self._logprobs: dict[str, TokenLogprobs] = {}
        self._extra_samples: dict[str, list[int]] = {}
        self._beam_logprobs: dict[str, torch.Tensor] = {}

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

    def take_logprobs(self) -> dict[str, TokenLogprobs]:
        """request_id -> logprobs of the token the last call picked (rows with ``params.logprobs`` only);
        an n > 1 prompt step also lists samples 1..n-1 under their ``sample_seq_id``."""
        out, self._logprobs = self._logprobs, {}
        return out

    def take_extra_samples(self) -> dict[str, list[int]]:
        """request_id -> first tokens of samples 1..n-1 drawn by the last call (n > 1 prompt steps)."""
        out, self._extra_samples = self._extra_samples, {}
        return out

    def take_beam_logprobs(self) -> dict[str, torch.Tensor]:
        """Sequence id -> ``[V]`` float32 processed log-probabilities of the last call's beam rows."""
        out, self._beam_logprobs = self._beam_logprobs, {}
        return out

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow], inplace: bool = False) -> torch.Tensor:
        """``[N, V]`` float32 -> ``[N, V]`` after the logits processors (steps 1-5 of the module docstring).

        ``inplace``: write into ``logits`` itself (float32 only; the caller owns
        it) instead of a copy: 4 MB per batch-32 t5 step not copied.
        """
        logits = logits.float() if inplace and logits.dtype == torch.float32 else logits.float().clone()
        for i, r in enumerate(rows):
            p = r.params
            if p.repetition_penalty != 1.0:
                apply_repetition_penalty(logits[i], r.token_ids, p.repetition_penalty)
            if p.no_repeat_ngram_size:
                banned = banned_ngram_tokens(r.token_ids, p.no_repeat_ngram_size)
                if banned:
                    logits[i, [t for t in banned if t < logits.shape[1]]] = NEG_INF
            if r.num_output_tokens < p.min_tokens and r.stop_token_ids:  # HF MinNewTokensLengthLogitsProcessor
                logits[i, list(r.stop_token_ids)] = NEG_INF
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
        return logits

    @staticmethod
    def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """``[..., V]`` -> warped scores: temperature, top-k, top-p, then min-p."""
        logits = apply_temperature(logits, params.temperature)
        logits = apply_top_k(logits, params.top_k)
        logits = apply_top_p(logits, params.top_p)
        return apply_min_p(logits, params.min_p)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """``logits``: ``[N, V]`` (row i for ``rows[i]``) -> N token ids. Overwrites ``logits`` (the step's own)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        self._logprobs, self._extra_samples, self._beam_logprobs = {}, {}, {}
        if not rows:
            return []
        beam = [i for i, r in enumerate(rows) if r.beam]
        if beam:  # HF _beam_search: processors over log_softmax(logits)
            idx = torch.tensor(beam, dtype=torch.long, device=logits.device)
            lp = self.process_logits(torch.log_softmax(logits[idx].float(), dim=-1), [rows[i] for i in beam]).cpu()
            self._beam_logprobs = {rows[i].request_id: lp[j] for j, i in enumerate(beam)}
        logits = self.process_logits(logits, rows, inplace=True)
        out = argmax_rows(logits).tolist()  # greedy rows are done in one batched op (kernels/cpu_argmax.py)
        for i, row in enumerate(rows):
            if row.beam:
                out[i] = -1
                continue
            scores = logits[i]
            if not row.params.greedy:
                warped = self.warp(scores, row.params)
                probs = warped.softmax(dim=-1)  # [V]
                gen = self.generator(row.request_id, sample_seed(row.params.seed, row.index), probs.device)
                if bool(torch.isfinite(probs).all()):  # never let one row's overflow fail the whole batch
                    out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
                    scores = warped
                    if row.num_samples > 1:
                        self._draw_extra_samples(row, probs, warped)
                # else: keeps the row's argmax (and reports the processed scores' logprobs)
            if row.params.logprobs:
                self._logprobs[row.request_id] = token_logprobs(scores, out[i], row.params.top_logprobs)
        return out

    def _draw_extra_samples(self, row: SamplingRow, probs: torch.Tensor, warped: torch.Tensor) -> None:
        """First tokens of samples 1..n-1 of ``row``'s request, each from its own generator."""
        extra = []
        for k in range(1, row.num_samples):
            sid = sample_seq_id(row.request_id, k)
            tok = int(torch.multinomial(probs, 1, generator=self.generator(sid, sample_seed(row.params.seed, k), probs.device)).item())
            extra.append(tok)
            if row.params.logprobs:
                self._logprobs[sid] = token_logprobs(warped, tok, row.params.top_logprobs)
        self._extra_samples[row.request_id] = extra


def token_logprobs(scores: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    """``scores`` ``[V]`` -> the logprobs of ``token_id`` and the ``top_n`` most likely finite tokens."""
    lp = torch.log_softmax(scores.float(), dim=-1)
    chosen = lp[token_id]
    rank = int((lp > chosen).sum()) + 1
    top: list[tuple[int, float]] = []
    if top_n:
        vals, idx = torch.topk(lp, min(top_n, lp.shape[-1]))
        top = [(int(t), float(v)) for v, t in zip(vals.tolist(), idx.tolist()) if v != NEG_INF]
    return TokenLogprobs(int(token_id), float(chosen), rank, top)
