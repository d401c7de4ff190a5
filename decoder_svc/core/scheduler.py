"""Continuous batching with priority, admission control and recompute preemption (no torch).

vLLM v1 / nano-vllm style. Queues are ordered by ``(priority, arrival_order)``:
lower priority value first (vLLM's convention), first come first served among
equals; the default priority 0 for every request gives plain FCFS.

Each ``schedule()``:

1. **Cross blocks.** The best waiting request gets its cross-attention blocks
   (``ceil(encoder_len / block_size)``) reserved and is handed out in
   ``to_encode`` only when its cross blocks AND its first self blocks (the
   prompt's, on top of those promised to requests encoding or waiting
   ahead of it in queue order; lower-priority ones are not counted) fit. Head of line: a request that does not fit blocks those
   behind it, so a long request is never starved by short ones.
2. **Decode.** Every running sequence, best first, gets one new self slot.
   When self blocks run out a victim is preempted: the running sequence with
   the lowest priority (largest value), latest arrival among equals; it may
   be the sequence asking.
3. **Admission (prefill).** Encoded waiting
   sequences start, best first, while ``max_num_seqs`` seats, the
   ``max_num_batched_tokens`` budget and free self blocks allow. A waiting
   sequence that does not fit may preempt running sequences of strictly lower
   priority (never of equal priority, so FCFS never thrashes). After step 2
   preempted, only such a strictly-higher-priority sequence starts. Step 1
   likewise counts the self blocks it could take from lower-priority running
   sequences, so a high-priority arrival is encoded while they hold the pool.

Encoder cache (``decoder_svc.core.encoder_cache``): a request added with an
``encoder_cache_key`` that an unfinished request already holds cross KV for
shares those blocks in step 1 (no Encode, no new cross blocks); if that KV is
still being encoded it becomes runnable with the leader's ``mark_encoded``.

Preemption mode: **recompute**. The victim's self-attention blocks are freed;
its cross-attention blocks are KEPT (its cross KV stays valid, so it is never
re-encoded), its prompt and generated tokens are kept, and it goes back to the
waiting queue at its original place (``(priority, arrival_order)``). When it is
admitted again its prefill recomputes the self KV of prompt + output tokens
(hence ``check_capacity`` requires the longest such prefill to fit
``max_num_batched_tokens``) and then samples the next token exactly as the
uninterrupted run would have: the per-request sampler state (seeded
generator) lives outside the scheduler and is untouched by preemption.

After the model step, ``update_from_output`` appends the sampled tokens and
finishes sequences on token ids and lengths only; stop strings and text are
the output stage's (``decoder_svc.core.output_processor``). The queues and the
request life cycle (add, mark_encoded, fork, abort, the finish that frees
blocks) live in ``decoder_svc.core.request_queues``; ``SchedulerOutput`` in
``decoder_svc.core.scheduler_output``.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable

from decoder_svc.core.outputs import ModelRunnerOutput
from decoder_svc.core.request_queues import CapacityError, RequestQueues, queue_key
from decoder_svc.core.scheduler_output import SchedulerOutput
from decoder_svc.core.sequence import Sequence, SequenceStatus

__all__ = ["CapacityError", "Scheduler", "SchedulerOutput", "queue_key"]


class Scheduler(RequestQueues):
    """Decides, each step, which sequences run and with how many tokens, and applies each step's tokens.

    Args:
        block_manager: the self / cross block pools.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most query tokens in one step; must cover the
            longest recompute prefill, so longer requests are rejected.
    """

    def _promised_self_blocks(self, before: Sequence) -> int:
        """Self blocks the encoding and waiting sequences queued ahead of ``before`` (by ``queue_key``)
        need to start (their prefill). Those of lower priority are not counted: a higher-priority arrival
        must not wait for blocks promised to them (priority inversion)."""
        bm = self.block_manager
        key = queue_key(before)
        return sum(
            bm.num_blocks_for(s.num_tokens) for s in (*self.encoding.values(), *self.waiting) if queue_key(s) < key
        )

    def _self_blocks_for(self, seq: Sequence) -> int:
        """Self blocks ``seq`` can count on: the free ones plus those it may take by preempting running
        sequences of strictly lower priority (step 3 does so when it is admitted)."""
        bm = self.block_manager
        return bm.num_free_self_blocks + sum(
            bm.num_freeable_self_blocks(r)
            for r in self.running
            if r.priority > seq.priority and r.status is SequenceStatus.RUNNING
        )

    # --- one step -------------------------------------------------------
    def reserve_cross(self) -> SchedulerOutput:
        """Step (1) alone: reserves cross blocks for waiting requests; only ``to_encode`` is filled.

        For a step that runs no model (the engine loop holding decode steps
        while encodes are pending, ``decoder_svc.core.engine_loop``): new requests
        still go to the encoder.
        """
        out = SchedulerOutput()
        self._reserve_cross(out)
        return out

    def schedule(self) -> SchedulerOutput:
        """Plans one step (see the module docstring); allocates the blocks it plans."""
        out = SchedulerOutput()
        self._reserve_cross(out)
        self._schedule_running(out)
        return out

    def _reserve_cross(self, out: SchedulerOutput) -> None:
        """Step (1): cross blocks (or a cached cross KV) + first self blocks must fit; head of line blocks the rest."""
        bm = self.block_manager
        handed_out = 0  # first self blocks of the requests handed out below (each ahead of the next)
        while self.waiting_cross:
            seq = self.waiting_cross[0]
            first_self = bm.num_blocks_for(seq.num_tokens)
            entry = self.encoder_cache.lookup(seq.request_id, seq.encoder_len)
            promised = self._promised_self_blocks(seq) + handed_out
            if (entry is None and not bm.can_allocate_cross(seq)) or promised + first_self > self._self_blocks_for(seq):
                break
            self.waiting_cross.pop(0)
            handed_out += first_self
            if entry is not None:  # encoder cache hit: read the holder's blocks, no Encode
                bm.cross_pool.incref(entry.block_ids)
                seq.cross_block_ids = list(entry.block_ids)
                self.encoder_cache.attach(seq.request_id, entry)
                if entry.ready:
                    seq.status = SequenceStatus.WAITING
                    insort(self.waiting, seq, key=queue_key)
                else:  # runnable when the leader's Encode lands (mark_encoded)
                    seq.status = SequenceStatus.ENCODING
                    self.encoding[seq.request_id] = seq
                continue
            bm.allocate_cross(seq)
            self.encoder_cache.lead(seq.request_id, seq.cross_block_ids, seq.encoder_len)
            seq.status = SequenceStatus.ENCODING
            self.encoding[seq.request_id] = seq
            out.to_encode.append(seq)

    def _schedule_running(self, out: SchedulerOutput) -> None:
        """Steps (2) and (3): decode slots for the running sequences, then admissions (prefill)."""
        bm = self.block_manager
        # (2) one slot for every running sequence, best first; preempt the worst on shortage.
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request_id -> tokens, insertion = batch order
        for seq in sorted(self.running, key=queue_key):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                break
            while not bm.can_append_slots(seq, n):
                victim = max(self.running, key=queue_key)
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                bm.append_slots(seq, n)
                scheduled[seq.request_id] = n
                budget -= n

        # (3) admit waiting sequences (prefill). After step 2 had to preempt for decodes only a sequence of
        # strictly higher priority than a running one starts (preempting those): equals never thrash, and a
        # high-priority request is not held back while lower-priority ones preempt each other.
        decode_preempted = bool(out.preempted)
        while self.waiting:
            seq = self.waiting[0]
            if decode_preempted and not any(
                r.priority > seq.priority for r in self.running if r.status is SequenceStatus.RUNNING
            ):
                break
            n = seq.num_tokens - seq.num_computed_tokens
            victims = self._victims_for(seq, n, budget, scheduled)
            if victims is None:
                break
            for victim in victims:
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim)
                out.preempted.append(victim)
            self.waiting.pop(0)
            bm.append_slots(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.request_id] = n
            budget -= n

        for rid, n in scheduled.items():
            out.scheduled_seqs.append(self.requests[rid])
            out.num_scheduled_tokens.append(n)

    def _victims_for(self, seq: Sequence, n: int, budget: int, scheduled: dict[str, int]) -> list[Sequence] | None:
        """Running sequences to preempt so ``seq`` can prefill ``n`` tokens: [] if it fits
        as is; the fewest of strictly lower priority (worst first) if that suffices; else None."""
        bm = self.block_manager
        need = bm.num_new_self_blocks(seq, n)
        free, seats = bm.num_free_self_blocks, self.max_num_seqs - len(self.running)
        victims: list[Sequence] = []
        candidates = sorted((r for r in self.running if r.priority > seq.priority), key=queue_key, reverse=True)
        while not (need <= free and seats >= 1 and n <= budget):
            if not candidates:
                return None
            victim = candidates.pop(0)
            victims.append(victim)
            free += bm.num_freeable_self_blocks(victim)
            seats += 1
            budget += scheduled.get(victim.request_id, 0)
        return victims

    def preempt(self, request_id: str) -> bool:
        """Recompute-preempts ``request_id`` now if it is RUNNING; returns whether it was running.

        ``decoder_svc.core.sequence_group`` does so for every running beam of a beam group
        that could not run whole in a step, so the group waits and is admitted
        together (its members share one queue place)."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not SequenceStatus.RUNNING:
            return False
        self._preempt(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop self KV, keep cross KV, back into WAITING at its place."""
        self.running.remove(seq)
        self.block_manager.free_self(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=queue_key)
        self.num_preemptions += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput, forked: Iterable[Sequence] = ()
    ) -> list[Sequence]:
        """Applies one model step: appends each scheduled sequence's sampled token; returns those that finished.

        Decides on token ids and lengths only (``Sequence.check_token_stop``): a
        stop token id "stop"; ``max_tokens`` or the model max length "length".
        Stop strings are the output stage's (``decoder_svc.core.output_processor``,
        which calls ``finish_request``). Finished sequences have all their blocks
        freed and leave the scheduler. Beam rows are skipped (their tokens are
        chosen by the request's search, ``decoder_svc.core.sequence_group``), and so
        are sequences no longer running (aborted in between).

        Args:
            scheduler_output: the step's plan (``schedule()``).
            model_runner_output: its result, one token per scheduled sequence.
            forked: sequences forked this step with their first token already
                appended (samples 1..n-1 off a prompt step); checked after the rest.

        Raises:
            ValueError: the output does not name the scheduled sequences.
        """
        seqs, token_ids = scheduler_output.scheduled_seqs, model_runner_output.sampled_token_ids
        if len(seqs) != len(token_ids) or model_runner_output.seq_ids != [s.request_id for s in seqs]:
            raise ValueError(
                f"{len(token_ids)} tokens for {model_runner_output.seq_ids}, "
                f"but {[s.request_id for s in seqs]} were scheduled"
            )
        finished = []
        for scheduled, tok in zip(seqs, token_ids):
            if scheduled.sampling_params.num_beams > 1:
                continue
            seq = self.requests.get(scheduled.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = seq.num_tokens  # every token fed this step now has K/V
            seq.append_token(int(tok))
            if self._check_stop(seq):
                finished.append(seq)
        finished.extend(seq for seq in forked if self._check_stop(seq))
        return finished

    def _check_stop(self, seq: Sequence) -> bool:
        """Finishes ``seq`` if its last token ends it by ids or length; returns whether it did."""
        status = seq.check_token_stop()
        if status is None:
            return False
        self._finish(seq, status)
        return True

    def finish_request(self, seq: Sequence, status: SequenceStatus) -> None:
        """Ends ``seq`` with ``status`` (the output stage found a stop string in its text).

        A sequence that this step's ``update_from_output`` already finished (the
        same token reached its length) only takes the new status: its blocks are free.
        """
        if seq.is_finished:
            seq.status = status
        else:
            self._finish(seq, status)
