"""Requests with several sequences: n > 1 samples and beam search.

The request starts as one sequence (index 0, id = the request id); the others
are forked from it (``Scheduler.fork``: cross blocks and the prompt's full self
blocks shared by reference count, the partly filled block copied by the model
runner, ``ModelRunner.copy_blocks``), so the cross-attention KV is encoded and
stored once per request.

* n > 1 samples: the prompt step draws n first tokens from the same scores
  (``decoder_svc.core.sampler``), samples 1..n-1 are forked with theirs
  (``fork_samples``), and each sample then runs, finishes and is preempted
  (recompute) on its own; every output carries its ``index``.
* Beam search (``decoder_svc.core.beam_search``): the running beams, as token
  tuples, map to sequences (equal tuples share one); each step takes the
  processed log-probabilities of every live beam sequence, asks
  ``BeamSearch.step`` for the new beams and reorders sequences: a source with
  no successor is freed, its first successor appends the token in place, the
  others are forks. A group steps only when every one of its live sequences
  ran in the same engine step; otherwise (a beam preempted or waiting for a
  seat) that step's results of the group are dropped and the group's running
  members are preempted too (recompute), so the group is admitted again as a
  whole (all-or-nothing; its members share one queue place) and never holds
  seats another group's beams wait for. Results stay independent of batching
  and preemption. Nothing is output until the search ends; then the output
  stage gives one finished output per returned beam (``beam_outputs``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoder_svc.core.beam_search import BeamSearch
from decoder_svc.core.outputs import ModelRunnerOutput
from decoder_svc.core.scheduler import CapacityError, Scheduler, SchedulerOutput
from decoder_svc.core.sequence import Sequence, sample_seq_id
from decoder_svc.core.step_failures import StepFailures


@dataclass
class SequenceGroup:
    """A request with several sequences: n > 1 samples or a beam search."""

    parent: Sequence
    beam: BeamSearch | None = None
    seqs: dict[str, Sequence] = field(default_factory=dict)  # live sequences by scheduler id
    beam_seqs: dict[tuple[int, ...], Sequence] = field(default_factory=dict)  # running beam tokens -> its sequence
    num_finished: int = 0


class SequenceGroups:
    """The engine's sequence groups, by request id.

    Args:
        scheduler: forks, preempts and frees the groups' sequences.
        copy_blocks: does a fork's ``(src, dst)`` self block copies (``ModelRunner.copy_blocks``).
        eos_token_id: the model's end token (a beam hypothesis ends on it).
        max_total_len: the model's max decoder length (prompt + output).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        copy_blocks: Callable[[list[tuple[int, int]]], None],
        eos_token_id: int,
        max_total_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.copy_blocks = copy_blocks
        self.eos_token_id = eos_token_id
        self.max_total_len = max_total_len
        self.groups: dict[str, SequenceGroup] = {}  # request id -> its samples / beams

    def check_capacity(self, seq: Sequence, width: int) -> None:
        """``width`` sequences of ``seq``'s max length must fit the batch and the self pool at once.

        Raises:
            CapacityError: they do not (the message names the numbers).
        """
        sched = self.scheduler
        bm = sched.block_manager
        if width > sched.max_num_seqs:
            raise CapacityError(
                f"request {seq.request_id!r}: {width} samples / beams exceed max_num_seqs {sched.max_num_seqs}"
            )
        need = width * bm.num_blocks_for(max(seq.max_len - 1, seq.num_prompt_tokens))
        if need > bm.num_self_blocks:
            raise CapacityError(
                f"request {seq.request_id!r}: {width} samples / beams of max length {seq.max_len} "
                f"need {need} self blocks of {bm.block_size} tokens, the self pool has {bm.num_self_blocks}"
            )

    def add(self, seq: Sequence) -> None:
        """Starts the group of ``seq``'s request (its sequence 0, already added to the scheduler)."""
        params = seq.sampling_params
        group = self.groups[seq.request_id] = SequenceGroup(seq, seqs={seq.request_id: seq})
        if params.num_beams > 1:
            group.beam = BeamSearch(
                params.num_beams,
                params.n,
                params.length_penalty,
                params.early_stopping,
                (self.eos_token_id,),
                seq.num_prompt_tokens,
                seq.max_len,
            )
            group.beam_seqs[()] = seq

    def fork_samples(self, so: SchedulerOutput, out: ModelRunnerOutput, failures: StepFailures) -> list[Sequence]:
        """Samples 1..n-1 of every n > 1 request whose prompt step just ran, each with its first token appended.

        Runs before ``Scheduler.update_from_output`` appends sample 0's token (it may finish on it).
        A row whose scores were not finite drew no extra samples: they all take sample 0's token.
        ``failures``: a request whose forks raise is recorded there (``decoder_svc.core.step_failures``);
        the children it forked before are returned (the engine frees the whole request).
        """
        children = []
        for s, t in zip(so.scheduled_seqs, out.sampled_token_ids):
            p = s.sampling_params
            if p.num_beams == 1 and s.group_id in self.groups and s.index == 0 and s.num_output_tokens == 0:
                with failures.guard(s.group_id, "fork of its samples", p):
                    self._fork_samples(s, out.extra_token_ids.get(s.request_id, [t] * (p.n - 1)), children)
        return children

    def _fork_samples(self, parent: Sequence, first_tokens: list[int], children: list[Sequence]) -> None:
        """Forks samples 1.. of ``parent`` with ``first_tokens``, appending each to ``children``."""
        parent.num_computed_tokens = parent.num_tokens  # the prompt's K/V were written this step
        for i, tok in enumerate(first_tokens, start=1):
            child = self._new_sequence(parent, i, [tok])
            child.index = i
            self._fork(parent, child)
            children.append(child)

    def _new_sequence(self, parent: Sequence, index: int, output_token_ids: list[int]) -> Sequence:
        """A sibling of ``parent`` (same request, queue place and params) with id ``sample_seq_id(request, index)``."""
        child = Sequence(
            sample_seq_id(parent.group_id, index),
            parent.prompt_token_ids,
            parent.encoder_len,
            parent.sampling_params,
            self.eos_token_id,
            self.max_total_len,
            parent.priority,
        )
        child.group_id = parent.group_id
        child.arrival_order, child.arrival_time = parent.arrival_order, parent.arrival_time
        child.output_token_ids = list(output_token_ids)
        return child

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """``Scheduler.fork`` plus its copy-on-write block copies."""
        self.copy_blocks(self.scheduler.fork(parent.request_id, child))
        self.groups[parent.group_id].seqs[child.request_id] = child

    def step_beams(self, so: SchedulerOutput, out: ModelRunnerOutput, failures: StepFailures) -> list[SequenceGroup]:
        """One beam search step of every beam group that ran this step; returns the groups whose search ended
        (their sequences freed, the group forgotten; ``group.beam.results()`` holds the answer).

        ``failures``: a group whose step raises (e.g. its length penalty overflows) is recorded there
        (``decoder_svc.core.step_failures``) and skipped, and so is one already in it.
        """
        done = []
        for request_id in dict.fromkeys(s.group_id for s in so.scheduled_seqs if s.sampling_params.num_beams > 1):
            group = self.groups.get(request_id)
            if group is None or request_id in failures:
                continue
            with failures.guard(request_id, "beam search step", group.parent.sampling_params):
                if self._beam_step(group, out.beam_logprobs):
                    done.append(group)
        return done

    def _beam_step(self, group: SequenceGroup, beam_logprobs: dict[str, torch.Tensor]) -> bool:
        """One step of ``group`` if all its live sequences ran this step (module docstring); True once it ended."""
        live = list(dict.fromkeys(group.beam_seqs.values()))
        if not all(s.request_id in beam_logprobs for s in live):
            # Part of the group did not run: drop its results this step and send the whole group back to
            # the waiting queue, where its members share one place and are admitted together (beams of
            # two groups holding each other's seats would otherwise wait for each other forever).
            for s in live:
                self.scheduler.preempt(s.request_id)
            return False
        beam = group.beam
        for s in live:
            s.num_computed_tokens = s.num_tokens
        old = list(beam.running)
        new = beam.step(torch.stack([beam_logprobs[group.beam_seqs[t].request_id] for t in old]).float().cpu())
        if beam.done:
            for s in list(group.seqs.values()):
                self._drop(group, s)
            del self.groups[group.parent.group_id]
            return True
        successors: dict[tuple[int, ...], Sequence] = {}  # new running tokens -> its source sequence
        for src, tok in new:
            successors.setdefault(old[src] + (tok,), group.beam_seqs[old[src]])
        used = {id(s) for s in successors.values()}
        for s in live:
            if id(s) not in used:
                self._drop(group, s)
        reused: set[int] = set()
        appends = []
        beam_seqs = {}
        for tokens, src in successors.items():
            if id(src) in reused:
                index = next(
                    k
                    for k in itertools.count(1)
                    if sample_seq_id(group.parent.group_id, k) not in self.scheduler.requests
                )
                child = self._new_sequence(src, index, list(src.output_token_ids) + [tokens[-1]])
                self._fork(src, child)
                beam_seqs[tokens] = child
            else:
                reused.add(id(src))
                appends.append((src, tokens[-1]))
                beam_seqs[tokens] = src
        for src, tok in appends:
            src.append_token(tok)
        group.beam_seqs = beam_seqs
        return False

    def _drop(self, group: SequenceGroup, seq: Sequence) -> None:
        """Frees one sequence of a group (a beam with no successor, or the group ending)."""
        self.scheduler.abort(seq.request_id)
        group.seqs.pop(seq.request_id, None)

    def release(self, seq: Sequence) -> None:
        """A sample finished: the request's group goes with its last sample."""
        group = self.groups.get(seq.group_id)
        if group is not None:
            group.seqs.pop(seq.request_id, None)
            group.num_finished += 1
            if group.num_finished == seq.sampling_params.n:
                del self.groups[seq.group_id]
