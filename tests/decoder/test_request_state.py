"""RequestStateStore against a real redis-server."""

from __future__ import annotations

import time

import pytest
import redis

from decoder_svc.replicas.request_state import (
    InvalidTransitionError,
    RequestExistsError,
    RequestRecord,
    RequestState,
    RequestStateStore,
    UnknownRequestError,
)
from encdec.redis_server import free_port
from shared.errors import UnavailableError
from shared.redis_url import redact_url


@pytest.fixture
def store(redis_url, redis_key_prefix):
    with RequestStateStore(redis_url, key_prefix=redis_key_prefix, finished_ttl_s=60) as s:
        yield s


def test_ping(store):
    assert store.ping()


def test_ping_refused_by_redis_names_it_without_the_password(redis_url):
    bad_db = redis_url.rsplit("/", 1)[0] + "/99999"  # the server has 16 databases
    with RequestStateStore(bad_db) as store, pytest.raises(UnavailableError, match="DB index is out of range"):
        store.ping()
    with (
        RequestStateStore(bad_db.replace("redis://", "redis://:s3cret@")) as store,
        pytest.raises(UnavailableError) as info,
    ):
        store.ping()  # a password this server does not want, then the bad database
    assert "s3cret" not in str(info.value) and "redis://:***@127.0.0.1" in str(info.value)
    assert redact_url("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact_url("rediss://host:6380/1") == "rediss://host:6380/1"


def test_ping_names_an_unreachable_redis():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with (
        RequestStateStore(url) as store,
        pytest.raises(UnavailableError, match=f"cannot reach Redis at {url}.*--redis-url"),
    ):
        store.ping()


def test_full_lifecycle(store):
    t0 = time.time()
    rec = store.create("req-1", "whisper-tiny.en")
    assert rec.state is RequestState.QUEUED
    got = store.get("req-1")
    assert isinstance(got, RequestRecord)
    assert got.request_id == "req-1" and got.model == "whisper-tiny.en"
    assert got.state is RequestState.QUEUED and got.prompt_tokens == 0 and got.finish_reason == ""
    assert t0 - 1 <= got.created_at == got.updated_at <= time.time() + 1
    assert store.ttl_s("req-1") is None  # live records do not expire

    assert store.set_state("req-1", RequestState.ENCODING) is RequestState.QUEUED
    assert store.set_state("req-1", RequestState.DECODING, prompt_tokens=3) is RequestState.ENCODING
    store.set_state("req-1", RequestState.DECODING, completion_tokens=7)  # counter update
    assert store.ttl_s("req-1") is None
    store.set_state("req-1", RequestState.FINISHED, completion_tokens=12, finish_reason="stop")
    got = store.get("req-1")
    assert got.state is RequestState.FINISHED
    assert (got.prompt_tokens, got.completion_tokens, got.finish_reason, got.error) == (3, 12, "stop", "")
    assert got.updated_at >= got.created_at


@pytest.mark.parametrize("terminal", [RequestState.FINISHED, RequestState.ABORTED, RequestState.FAILED])
def test_terminal_states_get_expiry(store, terminal):
    store.create("r", "m")
    store.set_state("r", RequestState.DECODING)
    store.set_state("r", terminal, error="boom" if terminal is RequestState.FAILED else "")
    ttl = store.ttl_s("r")
    assert ttl is not None and 0 < ttl <= 60


def test_terminal_record_expires(redis_url, redis_key_prefix):
    with RequestStateStore(redis_url, key_prefix=redis_key_prefix, finished_ttl_s=0.2) as s:
        s.create("r", "m")
        s.set_state("r", RequestState.ABORTED, finish_reason="abort")
        assert s.get("r").state is RequestState.ABORTED
        time.sleep(0.5)
        assert s.get("r") is None


@pytest.mark.parametrize(
    "path, bad",
    [
        ([RequestState.DECODING, RequestState.FINISHED], RequestState.DECODING),
        ([RequestState.ABORTED], RequestState.QUEUED),
        ([RequestState.FAILED], RequestState.FINISHED),
        ([], RequestState.FINISHED),  # QUEUED cannot finish without decoding
        ([RequestState.DECODING], RequestState.ENCODING),
    ],
)
def test_refused_transitions(store, path, bad):
    store.create("r", "m")
    for s in path:
        store.set_state("r", s)
    before = store.get("r")
    with pytest.raises(InvalidTransitionError, match=f"to {bad.name}"):
        store.set_state("r", bad, completion_tokens=99)
    assert store.get("r") == before  # nothing written


def test_duplicate_create_refused(store):
    store.create("dup", "m1")
    with pytest.raises(RequestExistsError, match="dup"):
        store.create("dup", "m2")
    assert store.get("dup").model == "m1"


def test_unknown_id(store):
    assert store.get("nope") is None
    with pytest.raises(UnknownRequestError):
        store.set_state("nope", RequestState.ENCODING)
    assert store.delete("nope") is False


def test_a_lost_record_is_written_anew_by_any_write_given_it_as_created(store):
    """Issue 34: Redis came back empty while requests were queued: their next write (ENCODING, DECODING) writes
    the record whole from the record as created, owner set included, instead of failing the request as
    "record vanished"; the final write then finds it."""
    record = store.create("lost", "m1", "replica-a")
    store.delete("lost")  # what a restart without persistence does to it
    with pytest.raises(UnknownRequestError):  # no record as created given: as before
        store.set_state("lost", RequestState.ENCODING)
    assert store.set_state("lost", RequestState.ENCODING, record) is None  # written anew
    again = store.get("lost")
    assert (again.state, again.model, again.owner, again.created_at) == (
        RequestState.ENCODING,
        "m1",
        "replica-a",
        record.created_at,
    )
    assert "lost" in store.owned("replica-a")  # the lost-replica reaper still finds it
    store.delete("lost")
    store.set_state_many([("lost", RequestState.DECODING, {"completion_tokens": 3})], {"lost": record})
    assert store.get("lost").state is RequestState.DECODING and store.get("lost").completion_tokens == 3
    assert store.set_state("lost", RequestState.FINISHED, record) is RequestState.DECODING
    assert "lost" not in store.owned("replica-a")


def test_delete(store):
    store.create("d", "m")
    assert store.delete("d") is True
    assert store.get("d") is None
    store.create("d", "m")  # the id is free again


def test_bad_fields_rejected(store):
    store.create("f", "m")
    with pytest.raises(ValueError, match="unknown request field"):
        store.set_state("f", RequestState.ENCODING, tokens=1)
    with pytest.raises(ValueError, match="completion_tokens"):
        store.set_state("f", RequestState.ENCODING, completion_tokens=-1)
    with pytest.raises(ValueError, match="finish_reason"):
        store.set_state("f", RequestState.ENCODING, finish_reason="eos")
    with pytest.raises(ValueError):
        store.create("", "m")


def test_batched_updates_one_round_trip(store, monkeypatch):
    ids = [f"b{i}" for i in range(20)]
    for i in ids:
        store.create(i, "m")
    calls = []
    orig = redis.client.Pipeline.execute
    monkeypatch.setattr(redis.client.Pipeline, "execute", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    prev = store.set_state_many([(i, RequestState.DECODING, {"prompt_tokens": n}) for n, i in enumerate(ids)])
    recs = store.get_many(ids + ["missing"])
    assert len(calls) == 2
    assert prev == [RequestState.QUEUED] * 20
    assert [r.prompt_tokens for r in recs[:-1]] == list(range(20)) and recs[-1] is None
    assert all(r.state is RequestState.DECODING for r in recs[:-1])


def test_batch_applies_valid_updates_and_raises_first_error(store):
    store.create("ok", "m")
    with pytest.raises(UnknownRequestError, match="ghost"):
        store.set_state_many([("ok", RequestState.ENCODING, {}), ("ghost", RequestState.ENCODING, {})])
    assert store.get("ok").state is RequestState.ENCODING


def test_keys_use_prefix(store, redis_url, redis_key_prefix):
    store.create("k", "m")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert client.exists(f"{redis_key_prefix}:request:k") == 1
    finally:
        client.close()


def test_local_redis_server_start_stop():
    from encdec.redis_server import LocalRedisServer, find_redis_server

    assert find_redis_server()
    with LocalRedisServer() as server:
        assert server.url.startswith(f"redis://:{server.password}@127.0.0.1:")  # a generated password
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("save")["save"] in ("", b"")
        client.close()
        pid = server.pid
    assert not server.is_running() and pid is not None
    server.stop()  # idempotent
