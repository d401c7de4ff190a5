"""Block manager: two cache groups, reference counts, fork (copy-on-write), double free."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoder_svc.core.block_manager import BlockError, BlockManager, BlockPool
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.core.sequence import Sequence


def make_seq(rid="r", encoder_len=40, prompt=(1, 2)):
    return Sequence(rid, list(prompt), encoder_len, SamplingParams(), eos_token_id=0, max_total_len=64)


def test_cross_blocks_sized_from_encoder_len():
    bm = BlockManager(num_self_blocks=8, num_cross_blocks=10, block_size=16)
    seq = make_seq(encoder_len=33)  # ceil(33 / 16) = 3
    assert bm.can_allocate_cross(seq)
    ids = bm.allocate_cross(seq)
    assert len(ids) == 3 and seq.cross_block_ids == ids
    assert bm.num_free_cross_blocks == 7 and bm.num_free_self_blocks == 8
    with pytest.raises(BlockError):
        bm.allocate_cross(seq)  # allocated once per request
    big = make_seq("big", encoder_len=16 * 8)
    assert not bm.can_allocate_cross(big)


def test_append_slots_grows_block_table():
    bm = BlockManager(4, 4, block_size=4)
    seq = make_seq()
    assert bm.num_new_self_blocks(seq, 1) == 1
    bm.append_slots(seq, 4)  # tokens 0..3 -> 1 block
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    assert bm.can_append_slots(seq, 1) and bm.num_new_self_blocks(seq, 1) == 1
    bm.append_slots(seq, 1)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    assert bm.append_slots(seq, 3) == []  # still inside block 2
    assert not bm.can_append_slots(seq, 3 + 8 + 1)
    with pytest.raises(BlockError):
        bm.append_slots(seq, 3 + 8 + 1)
    assert len(seq.block_table) == 2  # failed allocation took nothing


def test_free_returns_everything_and_double_free_raises():
    bm = BlockManager(4, 4, block_size=4)
    seq = make_seq(encoder_len=5)
    bm.allocate_cross(seq)
    bm.append_slots(seq, 6)
    table = list(seq.block_table)
    bm.free(seq)
    assert bm.num_free_self_blocks == 4 and bm.num_free_cross_blocks == 4
    assert seq.block_table == [] and seq.cross_block_ids == []
    bm.free(seq)  # tables cleared: freeing a sequence twice is a no-op
    with pytest.raises(BlockError, match="double free"):
        bm.self_pool.free(table)


def test_shared_cross_blocks_refcounted():
    bm = BlockManager(4, 4, block_size=4)
    a, b = make_seq("a", encoder_len=8), make_seq("b", encoder_len=8)
    bm.allocate_cross(a)
    bm.share_cross(a, b)
    assert b.cross_block_ids == a.cross_block_ids
    assert all(bm.cross_pool.ref_counts[i] == 2 for i in a.cross_block_ids)
    bm.free_cross(a)
    assert bm.num_free_cross_blocks == 2  # b still holds them
    bm.free_cross(b)
    assert bm.num_free_cross_blocks == 4
    assert sum(bm.cross_pool.ref_counts) == 0


def test_pool_rejects_bad_use():
    pool = BlockPool("p", 2)
    with pytest.raises(BlockError):
        pool.allocate(3)
    with pytest.raises(BlockError):
        pool.incref([0])
    with pytest.raises(ValueError):
        BlockManager(1, 1, block_size=0)


def test_fork_copy_on_write_and_freeable_count():
    bm = BlockManager(6, 4, block_size=4)
    parent = make_seq("p", encoder_len=8)
    bm.allocate_cross(parent)
    bm.append_slots(parent, 8)
    parent.num_computed_tokens = 8  # two full blocks: nothing to copy
    child = make_seq("c")
    assert bm.fork(parent, child) == []
    assert child.block_table == parent.block_table and child.cross_block_ids == parent.cross_block_ids
    assert bm.num_freeable_self_blocks(parent) == 0 and bm.num_free_self_blocks == 4
    bm.append_slots(parent, 3)  # past the shared blocks: a block of its own
    parent.num_computed_tokens = 10
    grandchild = make_seq("g")
    [(src, dst)] = bm.fork(parent, grandchild)  # block 2 holds 2 tokens: copied
    assert src == parent.block_table[2] and grandchild.block_table == parent.block_table[:2] + [dst]
    assert bm.self_pool.ref_counts[parent.block_table[0]] == 3 and bm.num_freeable_self_blocks(parent) == 1
    with pytest.raises(BlockError, match="without blocks"):
        bm.fork(parent, grandchild)
    full = BlockManager(3, 4, block_size=4)
    p2 = make_seq("p2", encoder_len=4)
    full.allocate_cross(p2)
    full.append_slots(p2, 10)
    p2.num_computed_tokens = 10
    with pytest.raises(BlockError, match="need 1 blocks, 0 free"):
        full.fork(p2, make_seq("c2"))
    assert full.cross_pool.ref_counts[p2.cross_block_ids[0]] == 1  # the failed fork took no reference
    for s in (parent, child, grandchild):
        bm.free(s)
    assert bm.num_free_self_blocks == 6 and bm.num_free_cross_blocks == 4


block_ops = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "append", "fork", "preempt", "free", "double_free"]),
        st.integers(0, 50),
        st.integers(1, 9),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=block_ops, num_self=st.integers(1, 12), num_cross=st.integers(1, 12), block_size=st.integers(1, 4))
def test_property_block_manager_refcounts(ops, num_self, num_cross, block_size):
    """Random allocate / append / fork / preempt (free self) / free / double free on the block manager
    alone: refcounts always equal the references the live sequences hold, no block is leaked or freed twice,
    and everything is free at the end."""
    bm = BlockManager(num_self, num_cross, block_size)
    live: list = []
    freed_tables: list[list[int]] = []
    for i, (op, x, n) in enumerate(ops):
        seq = live[x % len(live)] if live else None
        if op == "allocate":
            s = make_seq(f"s{i}", encoder_len=n)
            if bm.can_allocate_cross(s):
                bm.allocate_cross(s)
                live.append(s)
            else:
                with pytest.raises(BlockError):
                    bm.allocate_cross(s)
        elif op == "append" and seq is not None:
            if bm.can_append_slots(seq, n):
                bm.append_slots(seq, n)
                seq.num_computed_tokens += n  # the step ran: those slots now hold K/V
            else:
                before = list(seq.block_table)
                with pytest.raises(BlockError):
                    bm.append_slots(seq, n)
                assert seq.block_table == before
        elif op == "fork" and seq is not None:
            child = make_seq(f"s{i}")
            needs_copy = seq.num_computed_tokens % block_size != 0
            if needs_copy and bm.num_free_self_blocks == 0:
                with pytest.raises(BlockError):
                    bm.fork(seq, child)
            else:
                copies = bm.fork(seq, child)
                assert len(copies) == int(needs_copy)
                live.append(child)
        elif op == "preempt" and seq is not None:
            bm.free_self(seq)
            seq.num_computed_tokens = 0
        elif op == "free" and seq is not None:
            freed_tables.append(list(seq.block_table))
            bm.free(seq)
            live.remove(seq)
        elif op == "double_free" and freed_tables:
            table = freed_tables[x % len(freed_tables)]
            if table and all(bm.self_pool.ref_counts[b] == 0 for b in table):
                with pytest.raises(BlockError, match="double free"):
                    bm.self_pool.free(table)
        for pool, attr in ((bm.self_pool, "block_table"), (bm.cross_pool, "cross_block_ids")):
            counts = [0] * pool.num_blocks
            for s in live:
                for b in getattr(s, attr):
                    counts[b] += 1
            assert counts == pool.ref_counts
            assert sorted(pool._free) == [b for b, c in enumerate(counts) if c == 0]
        for s in live:  # shared self blocks are full and hold only computed tokens
            for j, b in enumerate(s.block_table):
                if bm.self_pool.ref_counts[b] > 1:
                    assert (j + 1) * block_size <= s.num_computed_tokens
    for s in live:
        bm.free(s)
    assert bm.num_free_self_blocks == num_self and bm.num_free_cross_blocks == num_cross
    assert sum(bm.self_pool.ref_counts) == 0 and sum(bm.cross_pool.ref_counts) == 0
