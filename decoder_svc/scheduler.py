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

Encoder cache (``decoder_svc.encoder_cache``): a request added with an
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
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field

from decoder_svc.block_manager import BlockManager
from decoder_svc.encoder_cache import EncoderCache
from decoder_svc.sequence import Sequence, SequenceStatus


def queue_key(seq: Sequence) -> tuple[int, int]:
    """Queue order: lower ``priority`` first, then earlier arrival (FCFS)."""
    return (seq.priority, seq.arrival_order)


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
        self.waiting_cross: list[Sequence] = []  # sorted by queue_key
        self.encoding: dict[str, Sequence] = {}
        self.waiting: list[Sequence] = []  # sorted by queue_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start, for metrics
        self.encoder_cache = EncoderCache()

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

    def add(self, seq: Sequence, encoder_cache_key: str | None = None) -> None:
        """Queues ``seq`` for cross blocks (in ``(priority, arrival_order)`` order).

        Args:
            seq: a new sequence.
            encoder_cache_key: content key of its encoder input
                (``decoder_svc.encoder_cache.encoder_cache_key``); while another
                unfinished request with the same key holds cross KV, ``seq``
                shares it instead of being encoded. None: never shared.

        Raises:
            CapacityError: it can never fit (message names the numbers).
            ValueError: its request id is already unfinished here.
        """
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.check_capacity(seq)
        seq.status = SequenceStatus.WAITING_CROSS_BLOCKS
        self.requests[seq.request_id] = seq
        if encoder_cache_key is not None:
            self.encoder_cache.keys[seq.request_id] = encoder_cache_key
        insort(self.waiting_cross, seq, key=queue_key)

    def mark_encoded(self, request_id: str) -> None:
        """The encoder has filled ``request_id``'s cross blocks: it may now run, and so may the
        requests that attached to the same encoder input meanwhile (encoder cache)."""
        seq = self.encoding.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id!r} is not encoding")
        entry = self.encoder_cache.held_by(request_id)
        if entry is not None and entry.leader != request_id and not entry.ready:
            raise KeyError(f"request {request_id!r} shares {entry.leader!r}'s encoding; mark that one")
        del self.encoding[request_id]
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=queue_key)
        for rid in self.encoder_cache.mark_ready(request_id):  # attached while it was encoding
            follower = self.encoding.pop(rid)
            follower.status = SequenceStatus.WAITING
            insort(self.waiting, follower, key=queue_key)

    def fork(self, parent_id: str, child: Sequence) -> list[tuple[int, int]]:
        """Adds ``child`` (n > 1 samples, beams) sharing ``parent_id``'s cross KV and computed self KV.

        ``child`` must carry the parent's token ids up to the parent's
        ``num_computed_tokens`` (later ones may differ) and its own request id
        and sampling params. A RUNNING parent's child runs from the next step
        with the parent's full self blocks shared and the partly filled one
        copied (``BlockManager.fork``) when a batch seat and a self block are
        free; otherwise, and for a WAITING parent, the child waits with only
        the cross blocks shared and prefills its tokens when admitted.

        Returns:
            ``(src, dst)`` self block copies for the model runner (see ``BlockManager.fork``).

        Raises:
            KeyError: ``parent_id`` is not unfinished here.
            ValueError: the parent's cross KV is not written yet (still queued
                or encoding), the child's id is taken, or its tokens differ
                from the parent's computed ones.
        """
        parent = self.requests[parent_id]
        if parent.status not in (SequenceStatus.RUNNING, SequenceStatus.WAITING):
            raise ValueError(f"cannot fork {parent_id!r} while {parent.status.name}: its cross KV is not written yet")
        if child.request_id in self.requests:
            raise ValueError(f"duplicate request id {child.request_id!r}")
        computed = parent.num_computed_tokens
        if child.all_token_ids[:computed] != parent.all_token_ids[:computed]:
            raise ValueError(f"{child.request_id!r} does not start with {parent_id!r}'s {computed} computed tokens")
        self.check_capacity(child)
        bm = self.block_manager
        copies: list[tuple[int, int]] = []
        runs = (
            parent.status is SequenceStatus.RUNNING
            and len(self.running) < self.max_num_seqs
            and (computed % bm.block_size == 0 or bm.num_free_self_blocks >= 1)
        )
        if runs:
            copies = bm.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        else:
            bm.share_cross(parent, child)
            child.status = SequenceStatus.WAITING
            insort(self.waiting, child, key=queue_key)
        self.requests[child.request_id] = child
        self.encoder_cache.hold(parent_id, child.request_id)
        return copies

    def _promised_self_blocks(self, before: Sequence) -> int:
        """Self blocks the encoding and waiting sequences queued ahead of ``before`` (by ``queue_key``)
        need to start (their prefill). Those of lower priority are not counted: a higher-priority arrival
        must not wait for blocks promised to them (priority inversion)."""
        bm = self.block_manager
        key = queue_key(before)
        return sum(bm.num_blocks_for(s.num_tokens) for s in (*self.encoding.values(), *self.waiting) if queue_key(s) < key)

    def _self_blocks_for(self, seq: Sequence) -> int:
        """Self blocks ``seq`` can count on: the free ones plus those it may take by preempting running
        sequences of strictly lower priority (step 3 does so when it is admitted)."""
        bm = self.block_manager
        return bm.num_free_self_blocks + sum(bm.num_freeable_self_blocks(r) for r in self.running
                                             if r.priority > seq.priority and r.status is SequenceStatus.RUNNING)

    # --- one step -------------------------------------------------------
    @property
    def num_encoding(self) -> int:
        """Requests whose cross KV is being written (handed out, not yet ``mark_encoded``)."""
        return len(self.encoding)

    def reserve_cross(self) -> SchedulerOutput:
        """Step (1) alone: reserves cross blocks for waiting requests; only ``to_encode`` is filled.

        For a step that runs no model (the engine loop holding decode steps
        while encodes are pending, ``decoder_svc.engine_loop``): new requests
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
            if decode_preempted and not any(r.priority > seq.priority for r in self.running if r.status is SequenceStatus.RUNNING):
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
        """Recompute-preempts ``request_id`` now if it is RUNNING (the engine does so for every running
        beam of a beam group that could not run whole in a step, so the group waits and is admitted
        together: its members share one queue place). Returns whether it was running."""
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
        for rid in self.encoder_cache.release(seq.request_id):  # its Encode never landed: encode afresh
            orphan = self.encoding.pop(rid)
            self.block_manager.free_cross(orphan)
            orphan.status = SequenceStatus.WAITING_CROSS_BLOCKS
            insort(self.waiting_cross, orphan, key=queue_key)
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
