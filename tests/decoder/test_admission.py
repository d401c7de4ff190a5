"""``decoder_svc.session.admission.AdmissionQueue``: limits, priority, the estimated wait and deadlines, on a fake clock."""

from __future__ import annotations

import grpc
import pytest

from decoder_svc.session.admission import DEADLINE_MARGIN_S, AdmissionQueue, DeadlineExceededError
from shared.errors import ResourceExhaustedError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_queue_full_refuses_at_once_and_names_the_count():
    q = AdmissionQueue(3, 30.0, Clock())
    tickets = [q.admit(0, None) for _ in range(3)]
    with pytest.raises(ResourceExhaustedError) as info:
        q.admit(0, None)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3 requests are waiting" in str(info.value) and "another replica" in str(info.value)
    assert "max_waiting_requests=3" in str(info.value)
    q.started(tickets[0])  # one left the queue: room for one more
    q.admit(0, None)
    assert q.stats()["num_queued_requests"] == 3
    assert q.num_refused["queue_full"] == 1


def test_higher_priority_enters_and_displaces_the_worst_waiting_one():
    q = AdmissionQueue(2, 30.0, Clock())
    failed: dict[int, BaseException] = {}
    a, b = q.admit(0, None), q.admit(0, None)
    a.bind(lambda exc: failed.setdefault(0, exc))
    b.bind(lambda exc: failed.setdefault(1, exc))
    assert a.check_encode() is None  # a is being encoded: never displaced
    with pytest.raises(ResourceExhaustedError):  # same or lower priority: refused
        q.admit(0, None)
    with pytest.raises(ResourceExhaustedError):
        q.admit(5, None)
    high = q.admit(-1, None)  # only a and b are queued, none ahead of it
    assert list(failed) == [1] and "displaced" in str(failed[1])  # b (not encoding) made room
    assert isinstance(b.check_encode(), ResourceExhaustedError)  # and it is never encoded
    assert q.stats()["num_queued_requests"] == 2 and q.num_refused["displaced"] == 1
    # A ticket displaced before its session bound a callback gets the refusal at bind.
    c = q.admit(-2, None)
    assert q.stats()["num_queued_requests"] == 2  # high (not encoding, worse than c) made room; a is encoding
    got = []
    high.bind(got.append)
    assert got and isinstance(got[0], ResourceExhaustedError)
    q.leave(c)
    q.leave(a)
    assert q.stats()["num_queued_requests"] == 0


def test_estimated_wait_from_departures_and_the_open_gap():
    clock = Clock()
    q = AdmissionQueue(100, 5.0, clock)
    assert q.stats()["estimated_queue_wait_s"] == 0.0  # nothing measured: only the count bounds a cold start
    tickets = [q.admit(0, None) for _ in range(5)]
    for t in tickets:  # one start every 0.5 s while the queue was busy; the first (warm-up) is no sample
        clock.now += 0.5
        q.started(t)
    assert q.stats() == {
        "num_queued_requests": 0,
        "oldest_queue_wait_s": 0.0,
        "estimated_queue_wait_s": 0.0,  # nothing waits: an idle decoder admits at once
        "max_waiting_requests": 100,
    }
    waiting = [q.admit(0, None) for _ in range(3)]
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(3 * 0.5)  # the work ahead: 3 x the median gap
    clock.now += 2.5  # no departure for 2.5 s: the queue is not expected to move sooner than it has not
    stats = q.stats()
    assert stats["oldest_queue_wait_s"] == pytest.approx(2.5)
    assert stats["estimated_queue_wait_s"] == pytest.approx(2.5)
    clock.now += 10.0  # stalled: the estimate passes max_queue_time_s and new requests are refused
    with pytest.raises(ResourceExhaustedError) as info:
        q.admit(0, None)
    assert "estimated" in str(info.value) and "max_queue_time_s=5" in str(info.value)
    assert q.num_refused["queue_time"] == 1
    urgent = q.admit(-1, None)  # nothing of its priority waits: it enters
    for t in [*waiting, urgent]:
        q.leave(t)  # ended without a token: not a service-rate sample
    assert q.stats()["estimated_queue_wait_s"] == 0.0


def test_one_slow_request_never_wedges_an_idle_decoder():
    """Issue 34 item 0: a 70 s request (a huge upload, an encoder stopped for a while) left a gap sample that
    kept every later request out ("0 requests are waiting, an estimated 35.8 s") with nothing queued."""
    clock = Clock()
    q = AdmissionQueue(32, 30.0, clock)
    for _ in range(2):  # warm-up, then one ordinary request (a 0.3 s sample)
        t = q.admit(0, None)
        clock.now += 0.3
        q.started(t)
    slow = q.admit(0, None)
    clock.now += 70.0
    q.started(slow)  # a 70 s sample
    for _ in range(5):  # an idle decoder admits at once, every time
        t = q.admit(0, None)
        clock.now += 0.2
        q.started(t)
    burst = [q.admit(0, None) for _ in range(16)]  # the median, not the 70 s outlier, prices the work ahead
    assert q.stats()["estimated_queue_wait_s"] < 16 * 0.5
    for t in burst:
        q.leave(t)


def test_a_stall_then_recovery_readmits_at_once():
    clock = Clock()
    q = AdmissionQueue(32, 5.0, clock)
    for _ in range(4):  # a busy queue: departures every 0.2 s
        t = q.admit(0, None)
        clock.now += 0.2
        q.started(t)
    stuck = [q.admit(0, None) for _ in range(2)]
    clock.now += 20.0  # the encoder stops delivering
    with pytest.raises(ResourceExhaustedError):
        q.admit(0, None)
    for t in stuck:  # it delivers again
        q.started(t)
    t = q.admit(0, None)  # idle: admitted at once
    again = q.admit(0, None)  # one ahead: the median gap, not the 20 s stall
    assert q.stats()["estimated_queue_wait_s"] < 1.0
    q.leave(t)
    q.leave(again)


def test_old_gaps_age_out_and_warm_up_is_no_sample():
    from decoder_svc.session.admission import GAP_WINDOW_S

    clock = Clock()
    q = AdmissionQueue(32, 5.0, clock)
    first = q.admit(0, None)
    clock.now += 60.0  # the first request after start-up: model warm-up
    q.started(first)
    waiting = [q.admit(0, None) for _ in range(3)]
    assert q.stats()["estimated_queue_wait_s"] == 0.0  # no sample: warm-up does not count, nothing has stalled
    for t in waiting:
        clock.now += 4.0
        q.started(t)  # 3 samples of 4 s
    ahead = [q.admit(0, None) for _ in range(2)]
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(8.0)
    for t in ahead:
        q.leave(t)
    clock.now += GAP_WINDOW_S + 1  # long idle: the old samples no longer speak for the service rate
    ahead = [q.admit(0, None) for _ in range(2)]
    assert q.stats()["estimated_queue_wait_s"] == 0.0


def test_deadline_shorter_than_the_wait_is_refused_and_late_encodes_are_dropped():
    clock = Clock()
    q = AdmissionQueue(100, 60.0, clock)
    for t in [q.admit(0, None) for _ in range(3)]:
        clock.now += 1.0
        q.started(t)
    q.admit(0, None)
    q.admit(0, None)  # two queued, 1 s a start: a new one waits ~3 s
    with pytest.raises(DeadlineExceededError) as info:
        q.admit(0, 1.0)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "estimated wait" in str(info.value)
    with pytest.raises(DeadlineExceededError):
        q.admit(0, -0.5)  # already passed
    assert q.num_refused["deadline"] == 2
    ticket = q.admit(0, 10.0)
    assert ticket.time_left() is not None
    assert ticket.check_encode() is None and ticket.encoding
    late = q.admit(-1, 4.0)  # a higher priority waits less
    clock.now += 4.0 - DEADLINE_MARGIN_S / 2
    err = late.check_encode()
    assert isinstance(err, DeadlineExceededError) and "not encoded" in str(err)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_waiting_requests"):
        AdmissionQueue(0, 1.0)
    with pytest.raises(ValueError, match="max_queue_time_s"):
        AdmissionQueue(1, float("nan"))


def test_requests_sent_one_at_a_time_do_not_price_a_burst_as_serial():
    """A break test (issue 34): after ~30 requests sent one at a time (each sample was a whole 0.5 s time to first
    token), a burst of 16 (max-num-seqs: one batch) had 6 refused at "an estimated 5.2 s"; the slowest admitted
    took 1.1 s. The gap that opens a busy period is no sample now."""
    clock = Clock()
    q = AdmissionQueue(32, 5.0, clock)
    for _ in range(30):
        t = q.admit(0, None)
        clock.now += 0.5
        q.started(t)
        clock.now += 0.3
    burst = [q.admit(0, None) for _ in range(16)]  # none refused
    assert q.stats()["estimated_queue_wait_s"] == 0.0
    clock.now += 1.0
    for t in burst:  # one batch: the first tokens come together
        q.started(t)
    for t in [q.admit(0, None) for _ in range(16)]:  # the batch's gaps of ~0 price the next burst
        assert t is not None
    assert q.stats()["estimated_queue_wait_s"] < 1.0


def test_batched_departures_price_each_request_at_its_share_of_the_batch():
    """Issue 34 break test (--max-queue-time-s not kept: 13 of 32 admitted waited over 30 s): the first tokens of a
    batch come out of one step, so the gaps between them are ~0 and their median priced every request at 0 s. A
    batch of 16 every 8 s is 0.5 s a request: with 16 ahead a new request waits ~8 s, over max_queue_time_s 5."""
    clock = Clock()
    q = AdmissionQueue(100, 5.0, clock)
    queued = [q.admit(0, None) for _ in range(64)]
    for batch in range(3):  # the first batch opens the busy period (no sample); two more are measured
        clock.now += 8.0
        for t in queued[16 * batch : 16 * (batch + 1)]:
            q.started(t)
            clock.now += 0.001  # one step's first tokens, delivered one after another
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(16 * 0.5, rel=0.01)
    with pytest.raises(ResourceExhaustedError, match="estimated 8"):
        q.admit(0, None)


def test_full_seats_are_priced_by_the_measured_service_time():
    """Issue 34 break test (--max-queue-time-s 30 not kept): with every batch seat held by requests that decode for
    long and nothing queued, the old estimate had no departure gap to go by and priced each new request at 0, so
    up to max_waiting_requests entered and waited a whole service time or more. Finished requests now measure the
    service time (first token to end), and a request that must wait for seats is priced by it."""
    clock = Clock()
    q = AdmissionQueue(32, 5.0, clock, seats=4)
    cold = [q.admit(0, None) for _ in range(4)]  # a cold burst of `seats` requests all enter
    assert q.stats()["estimated_queue_wait_s"] == 0.0
    clock.now += 0.5
    for t in cold:
        q.started(t)
    clock.now += 8.0
    for t in cold:  # each decoded for 8 s after its first token
        q.leave(t, finished=True)
    assert q.stats()["estimated_queue_wait_s"] == 0.0  # idle: admits at once
    running = [q.admit(0, None) for _ in range(4)]  # the seats fill again
    clock.now += 0.5
    for t in running:
        q.started(t)
    clock.now += 2.0  # they have run 2 s of their ~8: a seat frees in ~6 s
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(6.0)
    with pytest.raises(ResourceExhaustedError, match="estimated 6.0 s"):
        q.admit(0, None)
    clock.now += 3.0  # 3 s to go: the next one enters, the one after it waits for a second seat (+8 / 4 s)
    first = q.admit(0, None)
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(3.0 + 2.0)
    clock.now += 2.5
    q.leave(running[0], finished=True)  # a seat frees
    q.started(first)
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(0.5)  # the oldest has run 7.5 s of its ~8
    for t in [first, *running[1:]]:
        q.leave(t, finished=True)
    assert q.stats()["estimated_queue_wait_s"] == 0.0


def test_aborted_and_failed_requests_are_no_service_sample():
    clock = Clock()
    q = AdmissionQueue(32, 5.0, clock, seats=1)
    t = q.admit(0, None)
    q.started(t)
    clock.now += 0.1
    q.leave(t)  # aborted after 0.1 s: no sample, else it would price every seat at 0.1 s
    t = q.admit(0, None)
    q.started(t)
    clock.now += 0.02  # nothing finished: expected to run as long again (a 0.1 s sample would say 0.08 s)
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(0.02)
    clock.now += 60.0
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(60.02)  # held a minute: a new one waits for it
    with pytest.raises(ResourceExhaustedError, match="estimated 60.0 s"):
        q.admit(0, None)
    q.leave(t, finished=True)
    assert q.stats()["estimated_queue_wait_s"] == 0.0
    with pytest.raises(ValueError, match="seats"):
        AdmissionQueue(1, 1.0, seats=0)


def test_a_mix_of_short_and_long_requests_prices_the_held_seats_by_their_residual_time():
    """Many short requests finished, and long ones hold the seats: a seat frees when a long one ends, which the
    median of all services (a short one's) does not say; the finished services longer than what the running ones
    have decoded do. One that outran every finished request is expected to run as long again."""
    clock = Clock()
    q = AdmissionQueue(32, 30.0, clock, seats=2)
    for service in [0.1] * 6 + [10.0] * 2:
        t = q.admit(0, None)
        q.started(t)
        clock.now += service
        q.leave(t, finished=True)
    held = [q.admit(0, None) for _ in range(2)]
    for t in held:
        q.started(t)
    clock.now += 4.0  # past every short one: a long one, due at ~10 s
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(6.0)
    clock.now += 16.0  # 20 s: longer than any finished request, expected to run as long again
    assert q.stats()["estimated_queue_wait_s"] == pytest.approx(20.0)
    for t in held:
        q.leave(t)


def test_held_seats_count_beside_a_measured_departure_gap():
    """A departure gap measured earlier says nothing of seats held now: with every seat held by long requests and
    nothing queued, the estimate is the wait for a seat, not the empty queue's 0."""
    clock = Clock()
    q = AdmissionQueue(32, 30.0, clock, seats=2)
    first = [q.admit(0, None) for _ in range(3)]
    for t in first:  # a busy queue: two departures 0.5 s apart are gap samples
        clock.now += 0.5
        q.started(t)
    for t in first:
        clock.now += 4.0
        q.leave(t, finished=True)  # services of 4.5-10 s
    held = [q.admit(0, None) for _ in range(2)]
    for t in held:
        q.started(t)
    clock.now += 1.0
    assert q.stats()["estimated_queue_wait_s"] > 1.0  # before: 0.0 (no queue, the gap branch)
    for t in held:
        q.leave(t)
