"""Beam search state of one request, step for step as HF ``generate(num_beams=...)``.

The algorithm is transformers' ``GenerationMixin._beam_search`` (v5, the
vectorised rewrite) for one batch item:

* ``num_beams`` running beams, all starting as the decoder prompt with scores
  ``[0, -1e9, ...]`` (only the first beam's continuations count at first);
* each step every running beam's processed log-probabilities (the logits
  processors run on ``log_softmax(logits)``) are added to its score, and the
  top ``beams_to_keep = max(2, 1 + num_eos) * num_beams`` continuations over
  all beams are kept;
* a continuation that hits a stopping criterion (its token is the end token,
  or it reaches ``max_len`` tokens) is finished; among the first ``num_beams``
  continuations finished ones join the finished hypotheses with score
  ``sum_logprobs / generated_len ** length_penalty`` (the best ``num_beams``
  are kept), unless all hypotheses are already finished with
  ``early_stopping=True`` or improvement is impossible;
* the best ``num_beams`` unfinished continuations are the next running beams;
* the search ends when no running beam can improve the worst kept hypothesis
  (``early_stopping=False``: the best running score at its current length
  compared; the check is sticky), when all ``num_beams`` hypotheses finished
  and ``early_stopping=True``, or when every kept continuation hit a stop.

The same float32 tensor operations, in HF's order, keep scores and
tie-breaking equal to HF's. Beams are token tuples here;
``decoder_svc.core.sequence_group`` maps each distinct running tuple to one
``Sequence`` (beams with equal tokens share one, since their logits are equal)
and reorders sequences by fork / free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEG = -1.0e9  # HF's "never pick" offset


@dataclass
class Hypothesis:
    """One returned beam: generated tokens (end token included when it ended on it) and HF's score."""

    token_ids: tuple[int, ...]
    score: float
    finished: bool


class BeamSearch:
    """HF beam search over one request.

    Args:
        num_beams: beam width (>= 2).
        num_return: hypotheses returned by ``results`` (HF ``num_return_sequences``), <= num_beams.
        length_penalty: exponent of the generated length dividing a finished hypothesis' score.
        early_stopping: HF's True / False (``"never"`` is not offered).
        eos_token_ids: tokens that finish a hypothesis.
        prompt_len: decoder prompt tokens (HF ``decoder_prompt_len``).
        max_len: most decoder tokens, prompt included (HF ``max_length``).

    Attributes:
        running: ``num_beams`` running beams, best first: generated token tuples.
        done: True once the search ended; ``results`` then holds the answer.
    """

    def __init__(
        self,
        num_beams: int,
        num_return: int,
        length_penalty: float,
        early_stopping: bool,
        eos_token_ids: tuple[int, ...],
        prompt_len: int,
        max_len: int,
    ) -> None:
        if not 1 <= num_return <= num_beams:
            raise ValueError(f"num_return must be in [1, num_beams={num_beams}], got {num_return}")
        self.num_beams = num_beams
        self.num_return = num_return
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prompt_len = prompt_len
        self.max_len = max_len
        self.beams_to_keep = max(2, 1 + len(self.eos_token_ids)) * num_beams
        self.top_mask = torch.arange(self.beams_to_keep) < num_beams
        self.running: list[tuple[int, ...]] = [()] * num_beams
        self.running_scores = torch.full((num_beams,), NEG, dtype=torch.float32)
        self.running_scores[0] = 0.0
        self.finished: list[tuple[int, ...]] = [()] * num_beams  # HF's ``sequences``
        self.finished_scores = torch.full((num_beams,), NEG, dtype=torch.float32)
        self.is_finished = torch.zeros(num_beams, dtype=torch.bool)
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied (sticky)
        self.done = False

    @property
    def cur_len(self) -> int:
        """Decoder tokens of every running beam (prompt included)."""
        return self.prompt_len + len(self.running[0])

    def step(self, logprobs: torch.Tensor) -> list[tuple[int, int]]:
        """Advances one token.

        Args:
            logprobs: ``[num_beams, V]`` float32 processed log-probabilities of
                ``self.running[i]``'s next token in row i.

        Returns:
            The new running beams as ``(source beam index, token id)``, best
            first (empty once ``done``).

        Raises:
            RuntimeError: the search already ended.
        """
        if self.done:
            raise RuntimeError("beam search already done")
        nb, cur_len = self.num_beams, self.cur_len
        vocab = logprobs.shape[-1]
        acc = (logprobs.float() + self.running_scores[:, None]).reshape(-1)
        top_lp, top_idx = torch.topk(acc, k=min(self.beams_to_keep, acc.numel()))
        if top_lp.numel() < self.beams_to_keep:  # a vocabulary smaller than 2 * num_beams
            pad = self.beams_to_keep - top_lp.numel()
            top_lp = torch.cat([top_lp, torch.full((pad,), -float("inf"))])
            top_idx = torch.cat([top_idx, top_idx[-1:].expand(pad)])
        src = (top_idx // vocab).tolist()
        tok = (top_idx % vocab).tolist()
        cands = [self.running[s] + (t,) for s, t in zip(src, tok)]
        hits = torch.tensor([t in self.eos_token_ids or cur_len + 1 >= self.max_len for t in tok], dtype=torch.bool)

        # Next running beams: the best num_beams continuations that did not stop.
        run_lp = top_lp + hits.to(torch.float32) * NEG
        nxt = torch.topk(run_lp, k=nb)[1].tolist()
        self.running = [cands[i] for i in nxt]
        self.running_scores = run_lp[nxt]

        # Finished hypotheses: merge the top num_beams continuations that stopped.
        just_finished = hits & self.top_mask
        fin_lp = top_lp / ((cur_len + 1 - self.prompt_len) ** self.length_penalty)
        full = bool(self.is_finished.all()) and self.early_stopping is True
        fin_lp = fin_lp + float(full) * NEG
        fin_lp = fin_lp + float(not self.improvable) * NEG
        fin_lp = fin_lp + (~just_finished) * NEG
        merged = self.finished + cands
        merged_scores = torch.cat((self.finished_scores, fin_lp))
        merged_finished = torch.cat((self.is_finished, just_finished))
        keep = torch.topk(merged_scores, k=nb)[1].tolist()
        self.finished = [merged[i] for i in keep]
        self.finished_scores = merged_scores[keep]
        self.is_finished = merged_finished[keep]

        # Can the running beams still improve the worst kept hypothesis? (HF's early-stop heuristic)
        best = self.running_scores[:1] / ((cur_len + 1 - self.prompt_len) ** self.length_penalty)
        worst = torch.where(self.is_finished, self.finished_scores.min(), torch.tensor(NEG))
        self.improvable = self.improvable and bool((best > worst).any())
        open_beam = not (bool(self.is_finished.all()) and self.early_stopping is True)
        valid = not bool(hits.all())
        self.done = not (self.improvable and open_beam and valid)
        if self.done:
            return []
        return [(src[i], tok[i]) for i in nxt]

    def results(self) -> list[Hypothesis]:
        """The ``num_return`` best hypotheses, best first (HF's returned ``sequences`` / ``sequences_scores``)."""
        return [
            Hypothesis(t, float(s), bool(f))
            for t, s, f in zip(
                self.finished[: self.num_return],
                self.finished_scores[: self.num_return].tolist(),
                self.is_finished[: self.num_return].tolist(),
            )
        ]
