"""Continuous batching with recompute preemption (vLLM v1 / nano-vllm style, no torch).

Each ``schedule()`` (1) reserves cross-attention blocks, first come first
served, for requests waiting for them and hands them out in ``to_encode``;
(2) gives every running sequence one new self-attention slot, preempting the
most recently arrived running sequence when self blocks run out; (3) if
nothing was preempted, admits encoded waiting sequences (prefill of all their
uncomputed tokens) while blocks, ``max_num_seqs`` and ``max_num_batched_tokens``
allow. Preemption is recompute: the victim's self blocks are freed, its cross
blocks kept, and it re-prefills prompt + output tokens later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from decoder_svc.block_manager import BlockManager
from decoder_svc.sequence import Sequence, SequenceStatus


class CapacityError(ValueError):
    """A request can never fit this decoder's KV pools or batch limits."""


@dataclass
class SchedulerOutput:
    """What one step runs.

    Attributes:
        scheduled_seqs: sequences in batch order (decodes first, then prefills).
        num_scheduled_tokens: per scheduled sequence, its uncomputed tokens
            (``num_tokens - num_computed_tokens``; 1 for a decode step).
        to_encode: sequences whose cross blocks were just reserved; the owner
            asks the encoder to fill them and then calls ``mark_encoded``.
        preempted: sequences preempted this step.
    """

    scheduled_seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    to_encode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_seqs


class Scheduler:
    """Decides, each step, which sequences run and with how many tokens.

    Args:
        block_manager: the self / cross block pools.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most query tokens in one step; must cover the
            longest recompute prefill, so longer requests are rejected.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 4096) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs ({max_num_seqs})"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, Sequence] = {}  # every unfinished sequence
        self.waiting_cross: deque[Sequence] = deque()
        self.encoding: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # --- admission ------------------------------------------------------
    def check_capacity(self, seq: Sequence) -> None:
        """Raises CapacityError if ``seq`` could never run on an idle decoder."""
        bm = self.block_manager
        cross_needed = bm.num_blocks_for(seq.encoder_len)
        if cross_needed > bm.num_cross_blocks:
            raise CapacityError(
                f"request {seq.request_id!r}: encoder_len {seq.encoder_len} needs {cross_needed} cross blocks "
                f"of {bm.block_size} tokens, the cross pool has {bm.num_cross_blocks}"
            )
        # The last token is sampled but never fed back, so it needs no slot.
        max_fed = max(seq.max_len - 1, seq.num_prompt_tokens)
        self_needed = bm.num_blocks_for(max_fed)
        if self_needed > bm.num_self_blocks:
            raise CapacityError(
                f"request {seq.request_id!r}: max length {seq.max_len} needs {self_needed} self blocks "
                f"of {bm.block_size} tokens, the self pool has {bm.num_self_blocks}"
            )
        if max_fed > self.max_num_batched_tokens:
            raise CapacityError(
                f"request {seq.request_id!r}: max length {seq.max_len} exceeds max_num_batched_tokens "
                f"{self.max_num_batched_tokens} (a recompute prefill must fit one step)"
            )

    def add(self, seq: Sequence) -> None:
        """Queues ``seq`` for cross blocks.

        Raises:
            CapacityError: it can never fit (message names the numbers).
            ValueError: its request id is already unfinished here.
        """
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.check_capacity(seq)
        seq.status = SequenceStatus.WAITING_CROSS_BLOCKS
        self.requests[seq.request_id] = seq
        self.waiting_cross.append(seq)

    def mark_encoded(self, request_id: str) -> None:
        """The encoder has filled ``request_id``'s cross blocks: it may now run."""
        seq = self.encoding.pop(request_id, None)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not encoding")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    # --- one step -------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        out = SchedulerOutput()

        # (a) cross blocks, FCFS (head of line blocks the rest).
        while self.waiting_cross and bm.can_allocate_cross(self.waiting_cross[0]):
            seq = self.waiting_cross.popleft()
            bm.allocate_cross(seq)
            seq.status = SequenceStatus.ENCODING
            self.encoding[seq.request_id] = seq
            out.to_encode.append(seq)

        # (b) one slot for every running sequence, preempting the newest on shortage.
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}  # request_id -> tokens, insertion = batch order
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                break
            while not bm.can_append_slots(seq, n):
                victim = max(self.running, key=lambda s: s.arrival_order)
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                bm.append_slots(seq, n)
                scheduled[seq.request_id] = n
                budget -= n

        # (c) admit waiting sequences (prefill) unless this step had to preempt.
        if not out.preempted:
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                n = seq.num_tokens - seq.num_computed_tokens
                if n > budget or not bm.can_append_slots(seq, n):
                    break
                self.waiting.popleft()
                bm.append_slots(seq, n)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled[seq.request_id] = n
                budget -= n

        for rid, n in scheduled.items():
            out.scheduled_seqs.append(self.requests[rid])
            out.num_scheduled_tokens.append(n)
        return out

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop self KV, keep cross KV, back to the front of WAITING."""
        self.running.remove(seq)
        self.block_manager.free_self(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update_from_output(self, seq_ids: list[str], token_ids: list[int]) -> list[Sequence]:
        """Appends each scheduled sequence's sampled token; returns the sequences that finished.

        Finished sequences (end token "stop"; ``max_tokens`` or model max length
        "length") have all their blocks freed and leave the scheduler. Ids no
        longer running (aborted in between) are ignored.
        """
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"{len(seq_ids)} sequence ids but {len(token_ids)} tokens")
        finished = []
        for rid, tok in zip(seq_ids, token_ids):
            seq = self.requests.get(rid)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = seq.num_tokens  # every token fed this step now has K/V
            seq.append_token(int(tok))
            status = seq.check_stop()
            if status is not None:
                self._finish(seq, status)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.ENCODING:
            del self.encoding[seq.request_id]
        elif seq.status is SequenceStatus.WAITING_CROSS_BLOCKS:
            self.waiting_cross.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        del self.requests[seq.request_id]

    def abort(self, request_id: str) -> bool:
        """Frees every block of ``request_id`` in any state; False if it is not unfinished here."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    # --- introspection --------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences not running: waiting for cross blocks, encoding, or waiting for self blocks."""
        return len(self.waiting_cross) + len(self.encoding) + len(self.waiting)
