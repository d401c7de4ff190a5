"""Paged KV cache bookkeeping: self-attention and cross-attention blocks (no torch).

Two cache groups share one manager, as vLLM v1 keeps a ``CrossAttentionSpec``
group beside the decoder's own: self-attention blocks grow with a sequence's
tokens; cross-attention blocks are sized once from ``encoder_len``
(``ceil(encoder_len / block_size)``), written by the encoder service, and freed
when the request finishes. Every block carries a reference count so that
several sequences (n > 1, beams) can share one request's cross blocks and the
full self blocks of a common prefix (``fork``). Invariant: a self block with
more than one reference is full, so no sequence ever writes into a block
another one reads.
"""

from __future__ import annotations

from collections import deque

from decoder_svc.core.sequence import Sequence


class BlockError(RuntimeError):
    """A block was freed more often than it was referenced, or a pool was misused."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Fixed set of block ids ``0..num_blocks-1`` with reference counts."""

    def __init__(self, name: str, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name}: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise BlockError(f"{self.name}: need {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def allocate_contiguous(self, n: int) -> list[int]:
        """Like ``allocate`` but prefers one ascending run of ids (the lowest that fits).

        A sequence whose blocks form one run can be read as a zero-copy slice
        of the cache (``kernels.cross_attention``); when free blocks are too
        fragmented for a run, any free blocks are returned instead.
        """
        if n > len(self._free):
            raise BlockError(f"{self.name}: need {n} blocks, {len(self._free)} free")
        run = 0
        for b, refs in enumerate(self.ref_counts):
            run = run + 1 if refs == 0 else 0
            if run == n:
                ids = list(range(b - n + 1, b + 1))
                taken = set(ids)
                self._free = deque(x for x in self._free if x not in taken)
                for x in ids:
                    self.ref_counts[x] = 1
                return ids
        return self.allocate(n)

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise BlockError(f"{self.name}: incref of free block {b}")
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference to each block; a block reaching 0 becomes free.

        Raises:
            BlockError: a block is already free (double free).
        """
        for b in block_ids:
            if self.ref_counts[b] <= 0:
                raise BlockError(f"{self.name}: double free of block {b}")
        for b in block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class BlockManager:
    """Self-attention and cross-attention block pools of one decoder.

    Args:
        num_self_blocks: blocks of the self-attention KV cache.
        num_cross_blocks: blocks of the cross-attention KV cache.
        block_size: tokens per block, the same in both groups.
    """

    def __init__(self, num_self_blocks: int, num_cross_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.self_pool = BlockPool("self", num_self_blocks)
        self.cross_pool = BlockPool("cross", num_cross_blocks)

    # --- sizes -----------------------------------------------------------
    @property
    def num_self_blocks(self) -> int:
        return self.self_pool.num_blocks

    @property
    def num_cross_blocks(self) -> int:
        return self.cross_pool.num_blocks

    @property
    def num_free_self_blocks(self) -> int:
        return self.self_pool.num_free

    @property
    def num_free_cross_blocks(self) -> int:
        return self.cross_pool.num_free

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- cross-attention group ------------------------------------------
    def can_allocate_cross(self, seq: Sequence) -> bool:
        return self.num_blocks_for(seq.encoder_len) <= self.cross_pool.num_free

    def allocate_cross(self, seq: Sequence) -> list[int]:
        """Reserves ``ceil(encoder_len / block_size)`` cross blocks for ``seq``."""
        if seq.cross_block_ids:
            raise BlockError(f"{seq.request_id}: cross blocks already allocated")
        seq.cross_block_ids = self.cross_pool.allocate_contiguous(self.num_blocks_for(seq.encoder_len))
        return seq.cross_block_ids

    def share_cross(self, src: Sequence, dst: Sequence) -> None:
        """Lets ``dst`` read ``src``'s cross blocks (one more reference each)."""
        if dst.cross_block_ids:
            raise BlockError(f"{dst.request_id}: cross blocks already allocated")
        self.cross_pool.incref(src.cross_block_ids)
        dst.cross_block_ids = list(src.cross_block_ids)

    def free_cross(self, seq: Sequence) -> None:
        self.cross_pool.free(seq.cross_block_ids)
        seq.cross_block_ids = []

    # --- self-attention group -------------------------------------------
    def num_new_self_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the table covers ``num_computed_tokens + num_new_tokens`` slots."""
        need = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, need - len(seq.block_table))

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_self_blocks(seq, num_new_tokens) <= self.self_pool.num_free

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grows ``seq.block_table`` to cover ``num_new_tokens`` more slots; returns new ids."""
        new = self.self_pool.allocate(self.num_new_self_blocks(seq, num_new_tokens))
        seq.block_table.extend(new)
        return new

    def num_freeable_self_blocks(self, seq: Sequence) -> int:
        """Self blocks that ``free_self(seq)`` would return to the pool (those only ``seq`` references)."""
        return sum(1 for b in seq.block_table if self.self_pool.ref_counts[b] == 1)

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Gives ``child`` the KV of ``parent``'s computed tokens (n > 1 samples, beams).

        The child references the parent's cross blocks and every *full* self
        block of its ``num_computed_tokens``; the partly filled last block,
        which both will write next, is copied into a fresh block now
        (copy-on-write at fork time: a block referenced twice is always full
        and never written again). Blocks past the computed tokens are not
        shared. ``child.num_computed_tokens`` is set to the parent's; its
        token ids are the caller's business.

        Returns:
            ``(src, dst)`` self block id pairs whose KV the model runner must
            copy (``cache[:, :, dst] = cache[:, :, src]``) before the child runs.

        Raises:
            BlockError: ``child`` already holds blocks, or no self block is
                free for the copy (nothing changes then).
        """
        if child.block_table or child.cross_block_ids:
            raise BlockError(f"{child.request_id}: a forked sequence must start without blocks")
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        table = parent.block_table[:num_full]
        copies = []
        if partial:
            [dst] = self.self_pool.allocate(1)  # first: raises before any reference is taken
            copies.append((parent.block_table[num_full], dst))
        self.self_pool.incref(table)
        self.cross_pool.incref(parent.cross_block_ids)
        child.block_table = table + [dst for _, dst in copies]
        child.cross_block_ids = list(parent.cross_block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        return copies

    def free_self(self, seq: Sequence) -> None:
        self.self_pool.free(seq.block_table)
        seq.block_table = []

    def free(self, seq: Sequence) -> None:
        """Frees both groups of ``seq`` (idempotent per sequence: tables are cleared)."""
        self.free_self(seq)
        self.free_cross(seq)
