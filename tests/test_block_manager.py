"""Block manager: two cache groups, reference counts, double free."""

import pytest

from decoder_svc.block_manager import BlockError, BlockManager, BlockPool
from decoder_svc.sequence import Sequence
from shared.sampling_params import SamplingParams


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
