"""A decoder's unfinished sequences in their queues: what enters, what leaves (no torch).

The state ``decoder_svc.core.scheduler.Scheduler`` plans each step over, and the
request life cycle around it: admission checks (``check_capacity``), ``add``,
``mark_encoded``, ``fork`` (n > 1 samples, beams), ``abort`` and the finish
that frees a sequence's blocks. Queues are ordered by ``queue_key``: lower
``priority`` value first, first come first served among equals (vLLM's
convention). Life cycle: ``decoder_svc.core.sequence.SequenceStatus``.

Kept cross KV (Whisper's temperature fallback, language detection, word
alignment): a sequence added with ``keep_cross`` does not free its cross
blocks when it finishes (an abort still does); they stay in ``kept_cross``
under its request id until the next sequence of that id is added with
``reuse_cross`` (it reads them, no Encode) or ``release_cross`` frees them.
"""

from __future__ import annotations

from bisect import insort

from decoder_svc.core.block_manager import BlockManager
from decoder_svc.core.encoder_cache import EncoderCache
from decoder_svc.core.sequence import Sequence, SequenceStatus


def queue_key(seq: Sequence) -> tuple[int, int]:
    """Queue order: lower ``priority`` first, then earlier arrival (FCFS)."""
    return (seq.priority, seq.arrival_order)


class CapacityError(ValueError):
    """A request can never fit this decoder's KV pools or batch limits."""


class RequestQueues:
    """Every unfinished sequence of a decoder, by state; ``Scheduler`` adds the per-step planning.

    Args:
        block_manager: the self / cross block pools.
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most query tokens in one step; must cover the
            longest recompute prefill, so longer requests are rejected.

    Raises:
        ValueError: ``max_num_seqs < 1`` or ``max_num_batched_tokens < max_num_seqs``.
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
        self.kept_cross: dict[str, tuple[list[int], int]] = {}  # request id -> (cross block ids, encoder_len)
        self.keeps_cross: set[str] = set()  # unfinished sequences whose cross blocks outlive them

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

    def add(
        self, seq: Sequence, encoder_cache_key: str | None = None, keep_cross: bool = False, reuse_cross: bool = False
    ) -> None:
        """Queues ``seq`` for cross blocks (in ``(priority, arrival_order)`` order).

        Args:
            seq: a new sequence.
            encoder_cache_key: content key of its encoder input
                (``decoder_svc.core.encoder_cache.encoder_cache_key``); while another
                unfinished request with the same key holds cross KV, ``seq``
                shares it instead of being encoded. None: never shared.
            keep_cross: its cross blocks outlive it (``kept_cross``) unless it is aborted.
            reuse_cross: it reads the cross blocks kept under its request id: no Encode,
                it waits for self blocks at once.

        Raises:
            CapacityError: it can never fit (message names the numbers).
            ValueError: its request id is already unfinished here; ``reuse_cross`` with no
                kept cross KV of that id and length.
        """
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.check_capacity(seq)
        if reuse_cross:
            kept = self.kept_cross.get(seq.request_id)
            if kept is None or kept[1] != seq.encoder_len:
                raise ValueError(f"request {seq.request_id!r} has no kept cross KV of length {seq.encoder_len}")
            del self.kept_cross[seq.request_id]
            seq.cross_block_ids = list(kept[0])
            seq.status = SequenceStatus.WAITING
            self.requests[seq.request_id] = seq
            if keep_cross:
                self.keeps_cross.add(seq.request_id)
            insort(self.waiting, seq, key=queue_key)
            return
        seq.status = SequenceStatus.WAITING_CROSS_BLOCKS
        self.requests[seq.request_id] = seq
        if keep_cross:
            self.keeps_cross.add(seq.request_id)
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

    # --- state ----------------------------------------------------------
    @property
    def num_encoding(self) -> int:
        """Requests whose cross KV is being written (handed out, not yet ``mark_encoded``)."""
        return len(self.encoding)

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
        keep = seq.request_id in self.keeps_cross
        self.keeps_cross.discard(seq.request_id)
        if keep and status is not SequenceStatus.FINISHED_ABORTED and seq.cross_block_ids:
            self.release_cross(seq.request_id)  # an older window's, never two kept per request
            self.block_manager.free_self(seq)
            self.kept_cross[seq.request_id] = (seq.cross_block_ids, seq.encoder_len)
            seq.cross_block_ids = []
        else:
            self.block_manager.free(seq)
        seq.status = status
        del self.requests[seq.request_id]

    def release_cross(self, request_id: str) -> bool:
        """Frees the cross blocks kept under ``request_id``; False when none are kept."""
        kept = self.kept_cross.pop(request_id, None)
        if kept is None:
            return False
        self.block_manager.cross_pool.free(kept[0])
        return True

    def abort(self, request_id: str) -> bool:
        """Frees every block of ``request_id`` in any state, kept cross blocks included; False if it is
        neither unfinished here nor keeps cross blocks."""
        released = self.release_cross(request_id)
        seq = self.requests.get(request_id)
        if seq is None:
            return released
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
