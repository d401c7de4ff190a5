"""Reaping a lost decoder (real redis-server): the one-script failing of its requests, two reapers at once, the
outage guard (``decoder_svc.replicas.lost_replicas``)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from decoder_svc.replicas.lost_replicas import LostDecoderReaper, RedisUptime, lost_error
from decoder_svc.replicas.request_state import InvalidTransitionError, RequestState, RequestStateStore
from decoder_svc.session.request_session import ended_elsewhere
from shared.registry import ReplicaInfo, ReplicaRegistry

TTL_S = 0.3


def _info(replica_id: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id, "decoder", "m", ("m",), "127.0.0.1:1", ("shm",), "h", "s", ())


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(redis_url, redis_key_prefix):
    with RequestStateStore(redis_url, key_prefix=redis_key_prefix, finished_ttl_s=60) as s:
        yield s


@pytest.fixture
def registry(redis_url, redis_key_prefix):
    r = ReplicaRegistry(redis_url, key_prefix=redis_key_prefix, ttl_s=TTL_S)
    yield r
    r.close()


def _lose(registry: ReplicaRegistry, replica_id: str) -> None:
    """Registers ``replica_id`` and lets its lease expire (a kill -9: never deregistered)."""
    registry.register(_info(replica_id))
    deadline = time.monotonic() + 5
    while registry.is_alive(replica_id):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert replica_id in registry.dead_members("decoder")


def _records(store: RequestStateStore, owner: str, prefix: str) -> dict[str, RequestState]:
    """One record per state owned by ``owner``; returns id -> state."""
    ids = {}
    for state in RequestState:
        rid = f"{prefix}-{state.name.lower()}"
        store.create(rid, "m", owner=owner)
        path = {
            RequestState.QUEUED: [],
            RequestState.ENCODING: [RequestState.ENCODING],
            RequestState.DECODING: [RequestState.ENCODING, RequestState.DECODING],
            RequestState.FINISHED: [RequestState.ENCODING, RequestState.DECODING, RequestState.FINISHED],
            RequestState.ABORTED: [RequestState.ABORTED],
            RequestState.FAILED: [RequestState.FAILED],
        }[state]
        for step in path:
            store.set_state(rid, step, **({"finish_reason": "stop"} if step is RequestState.FINISHED else {}))
        ids[rid] = state
    return ids


def test_fail_lost_owner_fails_only_its_running_requests(store, registry, redis_url, redis_key_prefix):
    lost = _records(store, "decoder-lost", "l")
    other = _records(store, "decoder-live", "o")
    live = ReplicaRegistry(redis_url, key_prefix=redis_key_prefix, ttl_s=30)
    live.register(_info("decoder-live"))  # a lease that stays
    live.close()
    _lose(registry, "decoder-lost")
    planted = redis.Redis.from_url(redis_url)  # another owner's running request planted in the lost one's index
    planted.sadd(store.owner_key("decoder-lost"), next(r for r, s in other.items() if not s.is_terminal))
    planted.close()
    before = {rid: store.get(rid) for rid in lost}
    error = lost_error("decoder-lost")
    failed = store.fail_lost_owner("decoder-lost", error, registry.key("decoder-lost"), registry.set_key("decoder"))
    assert failed == 3  # queued, encoding, decoding
    for rid, state in lost.items():
        rec = store.get(rid)
        if state.is_terminal:  # untouched: state, error, expiry as they were
            assert rec == before[rid]
        else:
            assert (
                rec.state is RequestState.FAILED
                and rec.error == error == "decoder decoder-lost lost (its lease expired)"
            )
            assert rec.updated_at > before[rid].updated_at and 0 < store.ttl_s(rid) <= 60
            with pytest.raises(InvalidTransitionError) as info:  # the lost decoder's later writes are refused
                store.set_state(rid, RequestState.DECODING)
            assert ended_elsewhere(info.value)
    assert {rid: store.get(rid).state for rid in other} == other  # another owner's: untouched
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert client.exists(store.owner_key("decoder-lost")) == 0
        assert client.smembers(registry.set_key("decoder")) == {"decoder-live"}
    finally:
        client.close()
    assert registry.dead_members("decoder") == []
    assert store.fail_lost_owner("decoder-lost", error, registry.key("decoder-lost"), registry.set_key("decoder")) == 0


def test_a_lease_back_in_time_is_not_reaped(store, registry):
    store.create("q", "m", owner="decoder-late")
    _lose(registry, "decoder-late")
    registry.register(_info("decoder-late"))  # it renewed (registered again) before the script ran
    key, members = registry.key("decoder-late"), registry.set_key("decoder")
    assert store.fail_lost_owner("decoder-late", "lost", key, members) == -1
    assert store.get("q").state is RequestState.QUEUED and store.owned("decoder-late") == {"q"}


def test_two_reapers_at_once_fail_each_request_once(store, registry, redis_url, redis_key_prefix):
    ids = [f"r{i}" for i in range(300)]
    for rid in ids:
        store.create(rid, "m", owner="decoder-x")
    store.set_state_many([(rid, RequestState.ENCODING, {}) for rid in ids[::2]])
    _lose(registry, "decoder-x")
    results: list[int] = []
    barrier = threading.Barrier(2)

    def run(name: str) -> None:
        s = RequestStateStore(redis_url, key_prefix=redis_key_prefix, finished_ttl_s=60)
        reg = ReplicaRegistry(redis_url, key_prefix=redis_key_prefix, ttl_s=TTL_S)
        clock = _Clock()
        uptime = RedisUptime(clock)
        reaper = LostDecoderReaper(s, reg, name, TTL_S, uptime)
        uptime.observe(True)
        clock.now += reaper.guard_s  # Redis has answered long enough
        barrier.wait()
        results.append(reaper.reap_once())
        s.close()
        reg.close()

    threads = [threading.Thread(target=run, args=(f"decoder-{n}",)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [0, 300]
    assert all(r.state is RequestState.FAILED for r in store.get_many(ids))


def test_outage_guard_waits_for_redis_to_answer_for_two_leases(store, registry):
    clock = _Clock()
    uptime = RedisUptime(clock)
    reaper = LostDecoderReaper(store, registry, "decoder-me", TTL_S, uptime)
    assert reaper.guard_s == pytest.approx(2 * TTL_S) and reaper.interval_s == pytest.approx(min(TTL_S / 4, 0.5))
    store.create("q", "m", owner="decoder-gone")
    _lose(registry, "decoder-gone")
    registry.register(_info("decoder-me"))
    assert reaper.reap_once() == 0  # the first answer after start-up: the count starts now
    clock.now += reaper.guard_s / 2
    assert reaper.reap_once() == 0 and store.get("q").state is RequestState.QUEUED
    uptime.observe(False)  # the health probe saw Redis fail: the count starts again
    clock.now += reaper.guard_s
    assert reaper.reap_once() == 0 and uptime.up_for() == 0
    clock.now += reaper.guard_s - 0.01
    assert reaper.reap_once() == 0 and store.get("q").state is RequestState.QUEUED
    clock.now += 0.02
    assert reaper.reap_once() == 1
    rec = store.get("q")
    assert rec.state is RequestState.FAILED and rec.error == lost_error("decoder-gone")


def test_a_reaper_never_reaps_its_own_replica(store, registry):
    clock = _Clock()
    uptime = RedisUptime(clock)
    reaper = LostDecoderReaper(store, registry, "decoder-self", TTL_S, uptime)
    store.create("mine", "m", owner="decoder-self")
    _lose(registry, "decoder-self")  # its own lease expired (it stalled): it registers again, never reaps itself
    uptime.observe(True)
    clock.now += 10
    assert reaper.reap_once() == 0 and store.get("mine").state is RequestState.QUEUED
