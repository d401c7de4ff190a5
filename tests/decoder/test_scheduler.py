"""Scheduler: cross-block reservation, admission, priority, decode, recompute preemption, fork, finish, abort."""

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from decoder_svc.core.block_manager import BlockManager
from decoder_svc.core.outputs import ModelRunnerOutput
from decoder_svc.core.sampling_params import SamplingParams
from decoder_svc.core.scheduler import CapacityError, Scheduler
from decoder_svc.core.sequence import Sequence, SequenceStatus

EOS = 0


def make_seq(rid, encoder_len=8, prompt=(1, 2), max_tokens=None, max_total_len=32, priority=0):
    return Sequence(rid, list(prompt), encoder_len, SamplingParams(max_tokens=max_tokens), EOS, max_total_len, priority)


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
    finished = sched.update_from_output(so, ModelRunnerOutput([s.request_id for s in so.scheduled_seqs], toks))
    return so, finished


def test_reserve_cross_hands_out_encodes_and_schedules_nothing():
    sched = Scheduler(BlockManager(16, 8, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq("a"), make_seq("b")
    sched.add(a)
    assert [s.request_id for s in sched.schedule().to_encode] == ["a"]
    sched.mark_encoded("a")  # ready to run ...
    sched.add(b)
    so = sched.reserve_cross()  # ... but a hold step only reserves b's cross blocks
    assert [s.request_id for s in so.to_encode] == ["b"] and so.is_empty and sched.num_encoding == 1
    assert a.status is SequenceStatus.WAITING and not a.block_table
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled_seqs] == ["a"] and not so.to_encode


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
    sched.update_from_output(so, ModelRunnerOutput(["a"], [5]))
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


@pytest.mark.parametrize("priorities, first_victim", [((0, 0, 0), "r2"), ((2, 0, 1), "r0"), ((0, 1, 1), "r2")])
def test_preemption_recomputes_same_tokens(priorities, first_victim):
    def run(num_self_blocks):
        bm = BlockManager(num_self_blocks, 16, block_size=2)
        sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
        preempted, outputs = [], {}
        for i, priority in enumerate(priorities):
            sched.add(make_seq(f"r{i}", max_tokens=10, priority=priority))
        while sched.has_unfinished():
            so, finished = step(sched)
            preempted += [s.request_id for s in so.preempted]
            outputs.update({s.request_id: s.output_token_ids for s in finished})
            for s in so.preempted:
                # Recompute: self blocks dropped, cross KV kept, tokens kept, back in the waiting queue.
                assert s.status is SequenceStatus.WAITING and s.block_table == [] and s.cross_block_ids
                assert s in sched.waiting and s.num_computed_tokens == 0
        assert bm.num_free_self_blocks == num_self_blocks and bm.num_free_cross_blocks == 16
        return preempted, outputs, sched.num_preemptions

    no_preempt, reference, count = run(64)
    assert no_preempt == [] and count == 0
    preempted, outputs, count = run(6)
    assert outputs == reference  # 12 slots for three sequences of up to 11 fed tokens each
    assert preempted and preempted[0] == first_victim  # lowest priority, then latest arrival
    assert count == len(preempted)


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
    assert states == {
        "run": SequenceStatus.RUNNING,
        "wait": SequenceStatus.WAITING,
        "encoding": SequenceStatus.ENCODING,
        "queued": SequenceStatus.WAITING_CROSS_BLOCKS,
    }
    for rid in states:
        assert sched.abort(rid)
        assert not sched.abort(rid)
    sched.update_from_output(so, ModelRunnerOutput(["run"], [7]))  # aborted between schedule and update: ignored
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
    for key, entry in sched.encoder_cache.entries.items():  # encoder cache: holders share exactly the entry's blocks
        assert entry.holders and (entry.ready or entry.leader in entry.holders)
        for rid in entry.holders:
            seq = sched.requests[rid]
            assert seq.cross_block_ids == entry.block_ids and sched.encoder_cache.keys[rid] == key
            assert entry.ready or seq.status is SequenceStatus.ENCODING
    assert set(sched.encoder_cache.keys) <= set(sched.requests)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 24), st.integers(1, 12), st.integers(-1, 2)
        ),  # encoder_len, max_tokens, priority
        st.tuples(st.just("add"), st.integers(1, 8), st.integers(6, 12), st.integers(-1, 2)),
        st.tuples(st.just("add_cached"), st.integers(1, 3), st.integers(1, 12), st.integers(-1, 2)),  # same input x
        st.tuples(
            st.just("step"), st.integers(0, 3), st.integers(0, 100), st.just(0)
        ),  # how many to mark encoded, eos odds
        st.tuples(st.just("step"), st.integers(1, 3), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0)),
        st.tuples(st.just("fork"), st.integers(0, 30), st.integers(0, 1000), st.just(0)),  # parent, child's next token
    ),
    max_size=80,
)


def fork_child(sched, parent, rid, token):
    """A sample of ``parent`` diverging after its computed tokens (as n > 1 / beams would)."""
    child = make_seq(
        rid,
        parent.encoder_len,
        parent.prompt_token_ids,
        parent.sampling_params.max_tokens,
        parent.max_total_len,
        parent.priority,
    )
    kept = parent.all_token_ids[: max(parent.num_computed_tokens, parent.num_prompt_tokens)]
    child.output_token_ids = kept[parent.num_prompt_tokens :]
    if child.num_tokens < child.max_len - 1:
        child.output_token_ids.append(1 + token)
    return sched.fork(parent.request_id, child)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_self=st.integers(4, 10), num_cross=st.integers(6, 12), block_size=st.integers(1, 4))
def test_property_no_leaks(ops, num_self, num_cross, block_size):
    """Random add / step (decode, preempt, finish) / abort / fork: blocks and refcounts always add up."""
    bm = BlockManager(num_self, num_cross, block_size)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=16)
    ids, to_mark = [], []
    for op, x, y, z in ops:
        if op in ("add", "add_cached"):
            rid = f"r{len(ids)}"
            ids.append(rid)
            key = f"input-{x}" if op == "add_cached" else None  # same key, same encoder_len
            try:
                sched.add(
                    make_seq(rid, encoder_len=4 * x if key else x, max_tokens=y, max_total_len=14, priority=z), key
                )
            except CapacityError:
                pass
        elif op == "step":
            so = sched.schedule()
            to_mark += [s.request_id for s in so.to_encode]  # the owner encodes what to_encode lists
            for rid in [r for r in to_mark if r in sched.encoding][:x]:
                to_mark.remove(rid)
                sched.mark_encoded(rid)
            toks = [EOS if (y and fake_token(s) % 100 < y // 10) else fake_token(s) for s in so.scheduled_seqs]
            sched.update_from_output(so, ModelRunnerOutput([s.request_id for s in so.scheduled_seqs], toks))
        elif op == "fork":
            forkable = [
                s for s in sched.requests.values() if s.status in (SequenceStatus.RUNNING, SequenceStatus.WAITING)
            ]
            if forkable:
                parent = forkable[x % len(forkable)]
                rid = f"r{len(ids)}"
                ids.append(rid)
                copies = fork_child(sched, parent, rid, y)
                child = sched.requests[rid]
                event(f"fork -> {child.status.name}")
                for src, dst in copies:
                    assert src in parent.block_table and dst in child.block_table and bm.self_pool.ref_counts[dst] == 1
        elif op == "abort" and ids:
            sched.abort(ids[x % len(ids)])
        check_invariants(sched)
    # Drain: everything finishes or is aborted, and every block comes back.
    for _ in range(500):
        if not sched.has_unfinished():
            break
        for rid in [r for r in to_mark if r in sched.encoding]:
            sched.mark_encoded(rid)
        to_mark = [s.request_id for s in step(sched)[0].to_encode]  # step() marks these itself
        check_invariants(sched)
    assert not sched.has_unfinished()
    assert bm.num_free_self_blocks == num_self and bm.num_free_cross_blocks == num_cross
    assert sum(bm.self_pool.ref_counts) == 0 and sum(bm.cross_pool.ref_counts) == 0
    assert sched.encoder_cache.entries == {} and sched.encoder_cache.keys == {}  # evicted with their last holder
    event(f"preemptions: {min(sched.num_preemptions, 3)}")
    event(f"encoder cache hits: {min(sched.encoder_cache.num_hits, 3)}")


def drain_encoding(sched):
    so = sched.schedule()
    for seq in so.to_encode:
        sched.mark_encoded(seq.request_id)
    return so


def test_priority_orders_cross_blocks_and_admission_ties_fcfs():
    sched = Scheduler(BlockManager(64, 4, block_size=4), max_num_seqs=1, max_num_batched_tokens=64)
    for rid, prio in (("low", 5), ("mid-a", 1), ("high", -2), ("mid-b", 1)):
        sched.add(make_seq(rid, encoder_len=8, priority=prio))
    assert [s.request_id for s in sched.waiting_cross] == ["high", "mid-a", "mid-b", "low"]
    so = drain_encoding(sched)
    assert [s.request_id for s in so.to_encode] == ["high", "mid-a"]  # 2 cross blocks each, 4 in the pool
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled_seqs] == ["high"]  # one seat
    assert [s.request_id for s in sched.waiting] == ["mid-a"]


def test_higher_priority_arrival_is_encoded_past_blocks_promised_to_lower_priority():
    # One seat, 4 self blocks of 4 tokens: "low0" runs (1 block), low1..low3 are encoded and wait for the
    # seat (or for cross blocks), promised 1 block each, so no free block is left unpromised. "high" must still be handed to the
    # encoder at once (lower-priority promises do not hold it back) and run before the waiting lows.
    sched = Scheduler(BlockManager(4, 64, block_size=4), max_num_seqs=1, max_num_batched_tokens=64)
    lows = [make_seq(f"low{i}", encoder_len=4, max_tokens=3, max_total_len=12, priority=5) for i in range(4)]
    for s in lows:
        sched.add(s)
    drain_encoding(sched)
    step(sched)
    assert [s.request_id for s in sched.running] == ["low0"] and sched.waiting  # the rest wait for the seat
    high = make_seq("high", encoder_len=4, max_tokens=3, max_total_len=12, priority=-5)
    sched.add(high)
    so = sched.schedule()
    assert [s.request_id for s in so.to_encode] == ["high"]
    sched.mark_encoded("high")
    finished = []
    for _ in range(40):
        finished += [s.request_id for s in step(sched)[1]]
    assert finished.index("high") < finished.index("low1"), finished
    assert sched.block_manager.num_free_self_blocks == 4


def test_high_priority_arrivals_start_while_lower_ones_contend_for_blocks():
    # 5 low-priority requests fill 5 of 6 self blocks (4 tokens each) and soon preempt one another (recompute);
    # 3 high-priority arrivals must be encoded and start within a step, not one by one as blocks come free.
    bm = BlockManager(6, 64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(5):
        sched.add(make_seq(f"low{i}", encoder_len=2, max_tokens=20, max_total_len=24, priority=10))
    for _ in range(3):
        step(sched)
    for i in range(3):
        sched.add(make_seq(f"high{i}", encoder_len=2, max_tokens=20, max_total_len=24, priority=-10))
    finished, first_step = [], {}
    for k in range(300):
        so, done = step(sched)
        finished += [s.request_id for s in done]
        for s in so.scheduled_seqs:
            first_step.setdefault(s.request_id, k)
        check_invariants(sched)
        if not sched.has_unfinished():
            break
    assert [first_step[f"high{i}"] for i in range(3)] == [1, 1, 1], first_step  # encoded at step 0, running at 1
    assert finished[:3] == ["high0", "high1", "high2"], finished
    assert sorted(finished[3:]) == [f"low{i}" for i in range(5)]
    assert bm.num_free_self_blocks == 6 and bm.num_free_cross_blocks == 64


def test_waiting_higher_priority_preempts_lower_never_equal():
    bm = BlockManager(64, 64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    sched.add(make_seq("a", priority=3))
    sched.add(make_seq("b", priority=3))
    drain_encoding(sched)
    step(sched)
    assert {s.request_id for s in sched.running} == {"a", "b"}
    sched.add(make_seq("c", priority=3))  # equal priority: waits for a seat
    drain_encoding(sched)
    so, _ = step(sched)
    assert so.preempted == [] and sched.waiting[0].request_id == "c"
    sched.add(make_seq("urgent", priority=0))
    drain_encoding(sched)
    so, _ = step(sched)
    assert [s.request_id for s in so.preempted] == ["b"]  # the latest arrival of the lowest priority
    assert "urgent" in [s.request_id for s in so.scheduled_seqs] and "b" not in [
        s.request_id for s in so.scheduled_seqs
    ]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]  # b keeps its place before c
    check_invariants(sched)


def test_cross_blocks_reserved_only_when_first_self_blocks_fit():
    bm = BlockManager(3, 16, block_size=2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    sched.add(make_seq("a", prompt=(1, 2, 3), max_tokens=2))  # prompt needs 2 self blocks
    sched.add(make_seq("b", prompt=(1, 2, 3), max_tokens=2))
    so = sched.schedule()
    # Cross blocks are plentiful, but a's prefill is promised 2 of the 3 self blocks: b must wait.
    assert [s.request_id for s in so.to_encode] == ["a"] and bm.num_free_cross_blocks == 12
    sched.mark_encoded("a")
    so = sched.schedule()
    assert [s.request_id for s in so.scheduled_seqs] == ["a"] and so.to_encode == []
    sched.abort("a")
    assert [s.request_id for s in sched.schedule().to_encode] == ["b"]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(8, 8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    parent = make_seq("p", prompt=(1, 2, 3, 4, 5), max_tokens=8)
    with pytest.raises(KeyError):
        sched.fork("p", make_seq("c0"))
    sched.add(parent)
    sched.schedule()
    with pytest.raises(ValueError, match="ENCODING"):
        sched.fork("p", make_seq("c0"))
    sched.mark_encoded("p")
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(["p"], [7]))  # 5 computed tokens: block 0 full, block 1 holds 1
    child = make_seq("c", prompt=(1, 2, 3, 4, 5), max_tokens=8)
    child.output_token_ids = [8]  # a different sample after the shared prefix
    copies = sched.fork("p", child)
    assert child.block_table[0] == parent.block_table[0] and bm.self_pool.ref_counts[parent.block_table[0]] == 2
    assert copies == [(parent.block_table[1], child.block_table[1])] and child.num_computed_tokens == 5
    assert child.cross_block_ids == parent.cross_block_ids and child.status is SequenceStatus.RUNNING
    with pytest.raises(ValueError, match="computed tokens"):
        sched.fork("p", make_seq("bad", prompt=(9, 9, 9, 9, 9)))
    check_invariants(sched)
    while sched.has_unfinished():
        step(sched)
        check_invariants(sched)
    assert bm.num_free_self_blocks == 8 and bm.num_free_cross_blocks == 8


def test_scheduler_and_block_manager_never_import_torch():
    code = (
        "import sys, decoder_svc.core.scheduler, decoder_svc.core.block_manager, decoder_svc.core.sequence, decoder_svc.core.kv_budget; "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_encoder_cache_shares_cross_kv_of_identical_inputs():
    bm = BlockManager(32, 6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    for rid, key in (("a", "clip-1"), ("b", "clip-1"), ("c", "clip-1"), ("d", "clip-2")):
        sched.add(make_seq(rid, encoder_len=8, max_tokens=4), key)
    so = sched.schedule()
    a, b, c, d = (sched.requests[r] for r in "abcd")
    assert [s.request_id for s in so.to_encode] == ["a", "d"]  # b and c wait for a's encoding instead
    assert b.cross_block_ids == a.cross_block_ids == c.cross_block_ids and b.status is SequenceStatus.ENCODING
    assert all(bm.cross_pool.ref_counts[i] == 3 for i in a.cross_block_ids) and bm.num_free_cross_blocks == 2
    assert sched.encoder_cache.num_hits == 2
    check_invariants(sched)
    sched.mark_encoded("a")
    assert {s.request_id for s in sched.waiting} == {"a", "b", "c"}
    so, _ = step(sched)
    assert {s.request_id for s in so.scheduled_seqs} == {"a", "b", "c"}
    sched.mark_encoded("d")
    sched.add(make_seq("e", encoder_len=8, max_tokens=4), "clip-1")  # while a, b, c hold it: runs at once
    so, _ = step(sched)
    assert "e" in [s.request_id for s in so.scheduled_seqs] and so.to_encode == []
    assert sched.requests["e"].cross_block_ids == a.cross_block_ids and sched.encoder_cache.num_hits == 3
    while sched.has_unfinished():
        step(sched)
        check_invariants(sched)
    assert sched.encoder_cache.entries == {} and bm.num_free_cross_blocks == 6  # evicted with the last holder
    sched.add(make_seq("f", encoder_len=8), "clip-1")
    assert [s.request_id for s in sched.schedule().to_encode] == ["f"]  # nothing cached any more: encoded


def test_encoder_cache_leader_aborted_while_encoding_hands_over():
    bm = BlockManager(32, 4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    for rid in ("lead", "f1", "f2"):
        sched.add(make_seq(rid, encoder_len=8), "same")
    assert [s.request_id for s in sched.schedule().to_encode] == ["lead"]
    sched.abort("lead")  # its Encode never landed: the followers must not read those blocks
    assert [s.status for s in sched.requests.values()] == [SequenceStatus.WAITING_CROSS_BLOCKS] * 2
    assert bm.num_free_cross_blocks == 4 and sched.encoder_cache.entries == {}
    so = sched.schedule()
    assert [s.request_id for s in so.to_encode] == ["f1"]  # the next in line encodes; f2 attaches to it
    assert sched.requests["f2"].cross_block_ids == sched.requests["f1"].cross_block_ids
    check_invariants(sched)
    with pytest.raises(KeyError, match="shares 'f1'"):
        sched.mark_encoded("f2")  # only the leader's Encode writes the blocks
    sched.mark_encoded("f1")
    assert {s.request_id for s in sched.waiting} == {"f1", "f2"}
