"""Request ownership in Redis (real redis-server): the owner index, the terminal upsert after Redis lost the
records, and Abort forwarded to the owner over pub/sub (``decoder_svc.replicas.replica_control``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import redis

from decoder_svc.replicas.replica_control import ReplicaControl
from decoder_svc.replicas.request_state import (
    InvalidTransitionError,
    RequestState,
    RequestStateStore,
    UnknownRequestError,
)
from decoder_svc.session.request_session import ended_elsewhere
from encdec.redis_server import LocalRedisServer
from shared.registry import ReplicaInfo, ReplicaRegistry


@pytest.fixture
def store(redis_url, redis_key_prefix):
    with RequestStateStore(redis_url, key_prefix=redis_key_prefix, finished_ttl_s=60) as s:
        yield s


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def test_create_names_the_owner_and_indexes_it(store, client):
    rec = store.create("r1", "m", owner="decoder-a")
    assert rec.owner == "decoder-a"
    assert store.get("r1").owner == "decoder-a"
    assert client.smembers(store.owner_key("decoder-a")) == {"r1"}
    store.create("r2", "m")  # no owner: no index
    assert store.get("r2").owner == "" and client.exists(store.owner_key("")) == 0


@pytest.mark.parametrize("terminal", [RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED])
def test_terminal_write_leaves_the_owner_index(store, terminal):
    store.create("a", "m", owner="decoder-a")
    store.create("b", "m", owner="decoder-a")
    for state in (RequestState.ENCODING, RequestState.DECODING, RequestState.QUEUED, RequestState.DECODING):
        store.set_state("a", state)  # non-terminal writes (a preemption among them) keep it indexed
        assert store.owned("decoder-a") == {"a", "b"}
    if terminal is RequestState.FINISHED:
        store.set_state("a", terminal, finish_reason="stop")
    else:
        store.set_state("a", terminal)
    assert store.owned("decoder-a") == {"b"}
    with pytest.raises(InvalidTransitionError) as info:  # a refused write changes nothing
        store.set_state("a", RequestState.DECODING)
    assert info.value.current is terminal and ended_elsewhere(info.value)
    assert store.owned("decoder-a") == {"b"}
    assert store.delete("b") and store.owned("decoder-a") == set()


def test_index_and_record_are_written_in_one_script(store, client):
    """Batched: 50 creates and their terminal writes, each atomic with its index update."""
    ids = [f"x{i}" for i in range(50)]
    for i in ids:
        store.create(i, "m", owner="decoder-b")
    store.set_state_many([(i, RequestState.ENCODING, {}) for i in ids])
    store.set_state_many([(i, RequestState.FAILED, {"error": "e"}) for i in ids[:20]])
    assert store.owned("decoder-b") == set(ids[20:])
    assert all(r.state is RequestState.FAILED for r in store.get_many(ids[:20]))


def test_terminal_upsert_after_redis_restart_without_persistence():
    """Redis restarted empty while requests ran: each write given the record as created leaves a whole record
    (final or not: issue 34); a write without the created record still finds none."""
    with LocalRedisServer() as server:
        with RequestStateStore(server.url, finished_ttl_s=60) as store:
            t0 = time.time()
            created = {i: store.create(i, "whisper-tiny.en", owner="decoder-a") for i in ("f", "x", "g", "d")}
            store.set_state("f", RequestState.ENCODING)
            store.set_state("f", RequestState.DECODING, prompt_tokens=3)
            server.stop()
            server.start()  # same port and password, no data
            assert store.get("f") is None
            previous = store.set_state_many(
                [
                    ("f", RequestState.FINISHED, {"finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 7}),
                    ("x", RequestState.ABORTED, {"finish_reason": "abort", "completion_tokens": 2}),
                    ("g", RequestState.FAILED, {"error": "encoder gone"}),
                ],
                created,
            )
            assert previous == [None, None, None]  # written anew
            f, x, g = store.get_many(["f", "x", "g"])
            assert (f.state, f.finish_reason, f.prompt_tokens, f.completion_tokens) == (
                RequestState.FINISHED,
                "stop",
                3,
                7,
            )
            assert f.owner == "decoder-a" and f.model == "whisper-tiny.en" and f.request_id == "f"
            assert f.created_at == pytest.approx(created["f"].created_at) and f.created_at <= t0 + 1
            assert f.updated_at >= f.created_at
            assert (x.state, x.finish_reason, x.completion_tokens) == (RequestState.ABORTED, "abort", 2)
            assert (g.state, g.error) == (RequestState.FAILED, "encoder gone")
            assert 0 < store.ttl_s("f") <= 60 and 0 < store.ttl_s("g") <= 60
            assert store.owned("decoder-a") == set()
            with pytest.raises(UnknownRequestError):  # without the created record: nothing to write it from
                store.set_state("d", RequestState.DECODING)
            with pytest.raises(UnknownRequestError):  # terminal without the created record
                store.set_state("d", RequestState.FAILED, error="e")
            assert store.get("d") is None
            store.set_state("d", RequestState.DECODING, created["d"])  # non-terminal too: the queued one goes on
            assert store.get("d").state is RequestState.DECODING and store.owned("decoder-a") == {"d"}
            store.set_state("d", RequestState.FAILED, created["d"], error="e")
            assert store.get("d").state is RequestState.FAILED
            with pytest.raises(InvalidTransitionError):  # terminal now: the upsert never overwrites
                store.set_state("d", RequestState.FINISHED, created["d"], finish_reason="stop")


class _Owner:
    """A ReplicaControl subscribed on its own event loop thread, aborting the ids in ``running``."""

    def __init__(self, url: str, prefix: str, replica_id: str, store, registry) -> None:
        self.running: set[str] = set()
        self.asked: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.control = ReplicaControl(url, replica_id, store, registry, prefix)
        self.control.start(self.loop, self.abort)

    def abort(self, request_id: str) -> bool:
        assert threading.current_thread() is self.thread  # runs on the event loop, as Sessions.abort must
        self.asked.append(request_id)
        if request_id in self.running:
            self.running.discard(request_id)
            return True
        return False

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.control.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def _info(replica_id: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id, "decoder", "m", ("m",), "127.0.0.1:1", ("shm",), "h", "s", ())


def test_abort_is_forwarded_to_the_live_owner(redis_url, redis_key_prefix, store):
    registry = ReplicaRegistry(redis_url, key_prefix=redis_key_prefix, ttl_s=30)
    owner = _Owner(redis_url, redis_key_prefix, "decoder-a", store, registry)
    asking = ReplicaControl(redis_url, "decoder-b", store, registry, redis_key_prefix)
    try:
        assert owner.control.wait_subscribed(5)
        registry.register(_info("decoder-a"))
        for i in ("run", "gone", "done", "mine"):
            store.create(i, "m", owner="decoder-b" if i == "mine" else "decoder-a")
        owner.running.add("run")
        store.set_state("done", RequestState.FAILED, error="e")

        assert asyncio.run(asking.abort_elsewhere("run")) is True and owner.asked == ["run"]
        assert asyncio.run(asking.abort_elsewhere("gone")) is False and owner.asked[-1] == "gone"  # not running
        assert asyncio.run(asking.abort_elsewhere("done")) is False  # terminal: not asked
        assert asyncio.run(asking.abort_elsewhere("mine")) is False  # owned by the asking replica itself
        assert asyncio.run(asking.abort_elsewhere("unknown")) is False
        assert owner.asked == ["run", "gone"]

        registry.deregister("decoder-a", "decoder")  # its lease gone: not forwarded
        owner.running.add("run")
        assert asyncio.run(asking.abort_elsewhere("run")) is False and owner.asked == ["run", "gone"]
        registry.register(_info("decoder-a"))
        owner.close()  # alive in the registry, nobody on the channel: PUBLISH reaches no one
        t0 = time.monotonic()
        assert asking.forward_abort("decoder-a", "run") is False and time.monotonic() - t0 < 1.0
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        assert client.keys(f"{redis_key_prefix}:reply:*") == []  # replies expire or were popped
        client.close()
    finally:
        owner.close()
        asking.stop()
        registry.close()


def test_owner_subscribes_again_after_a_redis_restart():
    with LocalRedisServer() as server:
        url = server.url
        store = RequestStateStore(url)
        registry = ReplicaRegistry(url, ttl_s=30)
        owner = _Owner(url, "encdec", "decoder-a", store, registry)
        asking = ReplicaControl(url, "decoder-b", store, registry)
        try:
            assert owner.control.wait_subscribed(5)
            server.stop()
            server.start()  # empty: records, registry and subscriptions gone
            registry.register(_info("decoder-a"))
            store.create("r", "m", owner="decoder-a")
            owner.running.add("r")
            deadline = time.monotonic() + 10
            while not asking.forward_abort("decoder-a", "r"):  # False until it subscribed again
                assert time.monotonic() < deadline, "the owner never subscribed again"
                time.sleep(0.2)
            assert owner.asked[-1] == "r" and "r" not in owner.running
        finally:
            owner.close()
            asking.stop()
            registry.close()
            store.close()


def test_hostile_control_messages_are_ignored_and_aborts_still_arrive(redis_url, redis_key_prefix, store):
    """Whoever can PUBLISH on a decoder's control channel (anyone holding the Redis password) cannot silence it:
    bytes that are not UTF-8, JSON of every wrong shape and a reply list outside the prefix are logged and
    dropped, and the next forwarded Abort is still answered."""
    registry = ReplicaRegistry(redis_url, key_prefix=redis_key_prefix, ttl_s=30)
    owner = _Owner(redis_url, redis_key_prefix, "decoder-a", store, registry)
    asking = ReplicaControl(redis_url, "decoder-b", store, registry, redis_key_prefix)
    client = redis.Redis.from_url(redis_url)
    try:
        assert owner.control.wait_subscribed(5)
        registry.register(_info("decoder-a"))
        channel = owner.control.channel("decoder-a")
        hostile = [b"\xff\xfe\x80", b"not json", b"[]", b"5", b"null", b'{"op": "abort"}', b"{}"]
        hostile.append(json.dumps({"op": "abort", "request_id": "x", "reply_to": "elsewhere:key"}).encode())
        hostile.append(
            json.dumps({"op": "shutdown", "request_id": "x", "reply_to": f"{redis_key_prefix}:reply:1"}).encode()
        )
        for data in hostile:
            client.publish(channel, data)
        store.create("run", "m", owner="decoder-a")
        owner.running.add("run")
        deadline = time.monotonic() + 10
        while not asking.forward_abort("decoder-a", "run"):  # resubscribed after the undecodable message
            assert time.monotonic() < deadline, "the control channel stayed deaf after hostile messages"
            time.sleep(0.2)
        assert owner.asked == ["run"] and not client.exists("elsewhere:key")
    finally:
        client.close()
        owner.close()
        asking.stop()
        registry.close()
