"""Scheduler: cross-block reservation, admission, decode, recompute preemption, finish, abort."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoder_svc.block_manager import BlockManager
from decoder_svc.scheduler import CapacityError, Scheduler
from decoder_svc.sequence import Sequence, SequenceStatus
from shared.sampling_params import SamplingParams

EOS = 0


def make_seq(rid, encoder_len=8, prompt=(1, 2), max_tokens=None, max_total_len=32):
    return Sequence(rid, list(prompt), encoder_len, SamplingParams(max_tokens=max_tokens), EOS, max_total_len)


def fake_token(seq, stop_at=None):
    """Deterministic 'model': next token depends only on the request and its tokens so far."""
    if stop_at is not None and seq.num_output_tokens + 1 >= stop_at:
        return EOS
    return 1 + (hash((seq.request_id, tuple(seq.all_token_ids))) % 1000)


def step(sched, stop_at=None):
    so = sched.schedule()
    for seq in so.to_encode:
        sched.mark_encoded(seq.request_id)
    for seq, n in zip(so.scheduled_seqs, so.num_scheduled_tokens):
        assert n == seq.num_tokens - seq.num_computed_tokens
        assert len(seq.block_table) * sched.block_manager.block_size >= seq.num_tokens
    toks = [fake_token(s, stop_at.get(s.request_id) if stop_at else None) for s in so.scheduled_seqs]
    finished = sched.update_from_output([s.request_id for s in so.scheduled_seqs], toks)
    return so, finished


def test_cross_blocks_fcfs_then_encoded_admission():
    sched = Scheduler(BlockManager(16, 4, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = make_seq("a", encoder_len=8), make_seq("b", encoder_len=12), make_seq("c", encoder_len=4)
    for s in (a, b, c):
        sched.add(s)
    so = sched.schedule()
    # a takes 2 of 4 cross blocks; b needs 3 and blocks the line, so c waits although it would fit.
    assert [s.request_id for s in so.to_encode] == ["a"] and so.is_empty
    assert a.status is SequenceStatus.ENCODING and c.status is SequenceStatus.WAITING_CROSS_BLOCKS
    assert sched.schedule().is_empty  # still encoding: nothing runs
    sched.mark_encoded("a")
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled_seqs] == ["a"] and so.num_scheduled_tokens == [2]
    sched.update_from_output(["a"], [5])
    so = sched.schedule()
    assert so.num_scheduled_tokens == [1] and a.num_computed_tokens == 2
    with pytest.raises(KeyError):
        sched.mark_encoded("b")


def test_batch_limits():
    sched = Scheduler(BlockManager(64, 64, block_size=4), max_num_seqs=2, max_num_batched_tokens=5)
    for i in range(3):
        sched.add(make_seq(f"r{i}", prompt=(1, 2, 3), max_tokens=3))
    so, _ = step(sched)  # cross blocks reserved + encoded
    so, _ = step(sched)
    assert [s.request_id for s in so.scheduled_seqs] == ["r0"]  # 3 + 3 > 5 tokens
    so, _ = step(sched)
    assert [s.request_id for s in so.scheduled_seqs] == ["r0", "r1"]  # 1 + 3 tokens
    so, _ = step(sched)
    assert len(so.scheduled_seqs) == 2  # max_num_seqs


def test_finish_reasons_free_blocks():
    bm = BlockManager(16, 16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    sched.add(make_seq("stop"))
    sched.add(make_seq("len", max_tokens=3))
    sched.add(make_seq("model", max_total_len=5))
    reasons = {}
    while sched.has_unfinished():
        _, finished = step(sched, stop_at={"stop": 2})
        reasons.update({s.request_id: (s.finish_reason, s.num_output_tokens) for s in finished})
    assert reasons == {"stop": ("stop", 2), "len": ("length", 3), "model": ("length", 3)}
    assert bm.num_free_self_blocks == 16 and bm.num_free_cross_blocks == 16


def test_capacity_errors_name_numbers():
    sched = Scheduler(BlockManager(4, 3, block_size=4), max_num_seqs=4, max_num_batched_tokens=8)
    with pytest.raises(CapacityError, match=r"encoder_len 13 needs 4 cross blocks.*has 3"):
        sched.add(make_seq("x", encoder_len=13))
    with pytest.raises(CapacityError, match=r"max length 32 needs 8 self blocks.*has 4"):
        sched.add(make_seq("y"))
    with pytest.raises(CapacityError, match="max_num_batched_tokens 8"):
        sched.add(make_seq("z", max_tokens=12))  # 14 tokens: 13 slots (4 blocks) fit, 13 > 8 tokens
    assert isinstance(CapacityError("m"), ValueError)
    sched.add(make_seq("ok", max_tokens=6))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add(make_seq("ok", max_tokens=6))


def test_preemption_recomputes_same_tokens():
    def run(num_self_blocks):
        bm = BlockManager(num_self_blocks, 16, block_size=2)
        sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
        preempted, outputs = [], {}
        for i in range(3):
            sched.add(make_seq(f"r{i}", max_tokens=10))
        while sched.has_unfinished():
            so, finished = step(sched)
            preempted += [s.request_id for s in so.preempted]
            outputs.update({s.request_id: s.output_token_ids for s in finished})
            for s in so.preempted:
                assert s.status is SequenceStatus.WAITING and s.block_table == [] and s.cross_block_ids
                assert sched.waiting[0] is s or s in sched.waiting
        assert bm.num_free_self_blocks == num_self_blocks and bm.num_free_cross_blocks == 16
        return preempted, outputs

    no_preempt, reference = run(64)
    assert no_preempt == []
    preempted, outputs = run(6)
    assert outputs == reference  # 12 slots for three sequences of up to 11 fed tokens each
    assert preempted and preempted[0] == "r2"  # the most recently arrived goes first


def test_preempted_goes_to_front_and_keeps_tokens():
    bm = BlockManager(3, 8, block_size=2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    a, b = make_seq("a", max_tokens=4), make_seq("b", max_tokens=4)
    sched.add(a)
    sched.add(b)
    step(sched)
    so, _ = step(sched)  # both prefill: 1 block each
    while not so.preempted:
        so, _ = step(sched)
    assert so.preempted == [b] and sched.waiting[0] is b and b.num_computed_tokens == 0
    assert b.num_output_tokens > 0  # output kept; it re-prefills prompt + output


def test_abort_in_every_state():
    bm = BlockManager(8, 8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=32)
    for rid, enc in (("run", 8), ("wait", 8), ("encoding", 8), ("queued", 12)):
        sched.add(make_seq(rid, encoder_len=enc))
    so = sched.schedule()
    sched.mark_encoded("run")
    sched.mark_encoded("wait")
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled_seqs] == ["run"]
    states = {rid: s.status for rid, s in sched.requests.items()}
    assert states == {"run": SequenceStatus.RUNNING, "wait": SequenceStatus.WAITING,
                      "encoding": SequenceStatus.ENCODING, "queued": SequenceStatus.WAITING_CROSS_BLOCKS}
    for rid in states:
        assert sched.abort(rid)
        assert not sched.abort(rid)
    sched.update_from_output(["run"], [7])  # aborted between schedule and update: ignored
    assert not sched.has_unfinished()
    assert bm.num_free_self_blocks == 8 and bm.num_free_cross_blocks == 8


def check_invariants(sched):
    bm = sched.block_manager
    for pool, attr in ((bm.self_pool, "block_table"), (bm.cross_pool, "cross_block_ids")):
        counts = [0] * pool.num_blocks
        for seq in sched.requests.values():
            for b in getattr(seq, attr):
                counts[b] += 1
        assert counts == pool.ref_counts
        assert pool.num_free == sum(1 for c in counts if c == 0)
        assert len(set(pool._free)) == pool.num_free  # no block listed free twice
        assert all(counts[b] == 0 for b in pool._free)
    for seq in sched.requests.values():
        if seq.status is not SequenceStatus.RUNNING:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        if seq.status is SequenceStatus.WAITING_CROSS_BLOCKS:
            assert seq.cross_block_ids == []
        else:
            assert len(seq.cross_block_ids) == bm.num_blocks_for(seq.encoder_len)
    assert len(sched.running) <= sched.max_num_seqs


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 12)),  # encoder_len, max_tokens
        st.tuples(st.just("step"), st.integers(0, 3), st.integers(0, 100)),  # how many to mark encoded, eos odds
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_self=st.integers(7, 16), num_cross=st.integers(6, 12), block_size=st.integers(1, 4))
def test_property_no_leaks(ops, num_self, num_cross, block_size):
    bm = BlockManager(num_self, num_cross, block_size)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=16)
    ids = []
    for op, x, y in ops:
        if op == "add":
            rid = f"r{len(ids)}"
            ids.append(rid)
            try:
                sched.add(make_seq(rid, encoder_len=x, max_tokens=y, max_total_len=14))
            except CapacityError:
                pass
        elif op == "step":
            so = sched.schedule()
            for seq in list(sched.encoding.values())[:x]:
                sched.mark_encoded(seq.request_id)
            toks = [EOS if (y and fake_token(s) % 100 < y // 10) else fake_token(s) for s in so.scheduled_seqs]
            sched.update_from_output([s.request_id for s in so.scheduled_seqs], toks)
        elif ids:
            sched.abort(ids[x % len(ids)])
        check_invariants(sched)
    # Drain: everything finishes or is aborted, and every block comes back.
    for _ in range(500):
        if not sched.has_unfinished():
            break
        for rid in list(sched.encoding):
            sched.mark_encoded(rid)
        step(sched)
        check_invariants(sched)
    assert not sched.has_unfinished()
    assert bm.num_free_self_blocks == num_self and bm.num_free_cross_blocks == num_cross
    assert sum(bm.self_pool.ref_counts) == 0 and sum(bm.cross_pool.ref_counts) == 0
