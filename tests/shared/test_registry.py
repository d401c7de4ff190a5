"""The replica registry (``shared.registry``) against a real redis-server: leases, expiry, pruning, identities."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from shared.config import EncoderServiceConfig
from shared.registry import (
    Lease,
    RegistryUnavailableError,
    ReplicaInfo,
    ReplicaRegistry,
    advertise_address,
    host_id,
    new_replica_id,
    shm_namespace_id,
)

TTL_S = 0.5


def _info(role: str = "encoder", **kw) -> ReplicaInfo:
    fields = dict(
        replica_id=new_replica_id(role),
        role=role,
        model="whisper-tiny.en",
        served_names=("whisper-tiny.en",),
        address="127.0.0.1:50061",
        kv_transports=("shm",),
        host_id=host_id(),
        shm_id="abc",
        gpu_ids=(),
    )
    return ReplicaInfo(**{**fields, **kw})


@pytest.fixture
def registry(redis_url, redis_key_prefix):
    reg = ReplicaRegistry(redis_url, redis_key_prefix, ttl_s=TTL_S)
    yield reg
    reg.close()


def _wait_until(predicate, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_register_renew_expire_deregister(registry):
    info = _info(load=3)
    registry.register(info)
    assert registry.replicas("encoder") == [info]
    assert registry.is_alive(info.replica_id)
    time.sleep(TTL_S * 0.6)
    renewed = dataclasses.replace(info, load=7, renewed_at=time.time())
    assert registry.renew(renewed)
    time.sleep(TTL_S * 0.6)  # past the first TTL: alive only through the renewal
    assert registry.replicas("encoder") == [renewed]
    time.sleep(TTL_S + 0.1)
    assert not registry.is_alive(info.replica_id)
    assert registry.replicas("encoder") == []
    assert not registry.renew(renewed)  # gone: the caller registers again
    assert not registry.is_alive(info.replica_id)  # SET XX did not bring it back

    other = _info()
    registry.register(other)
    registry.deregister(other.replica_id, "encoder")
    assert registry.replicas("encoder") == []
    assert registry.dead_members("encoder") == []  # deregistered, not dead


def test_pruning_keeps_dead_decoders_for_the_reaper(registry):
    client = redis.Redis.from_url(registry.redis_url, decode_responses=True)
    encoder, embed, decoder, live = _info("encoder"), _info("embed"), _info("decoder"), _info("decoder")
    for info in (encoder, embed, decoder, live):
        registry.register(info)
    for info in (encoder, embed, decoder):
        client.delete(registry.key(info.replica_id))  # as an expiry would
    assert registry.dead_members("encoder") == [encoder.replica_id]
    assert registry.replicas("encoder") == [] and registry.replicas("embed") == []
    assert registry.dead_members("encoder") == [] and registry.dead_members("embed") == []  # pruned
    assert registry.replicas("decoder") == [live]
    assert registry.dead_members("decoder") == [decoder.replica_id]  # still listed: its requests must be reaped
    assert client.sismember(registry.set_key("decoder"), decoder.replica_id)
    client.close()


def test_renew_lists_an_id_pruned_while_it_was_away(registry):
    client = redis.Redis.from_url(registry.redis_url, decode_responses=True)
    info = _info()
    registry.register(info)
    client.srem(registry.set_key("encoder"), info.replica_id)
    assert registry.renew(info)
    assert registry.replicas("encoder") == [info]
    client.close()


def test_unreachable_redis_raises_unavailable():
    reg = ReplicaRegistry("redis://:secret@127.0.0.1:1/0", ttl_s=TTL_S)
    with pytest.raises(RegistryUnavailableError) as err:
        reg.register(_info())
    assert "127.0.0.1:1" in str(err.value) and "secret" not in str(err.value)
    with pytest.raises(RegistryUnavailableError):
        reg.replicas("encoder")


def test_lease_renews_reregisters_and_stops(registry):
    client = redis.Redis.from_url(registry.redis_url, decode_responses=True)
    load = iter(range(1000))
    lease = Lease(registry, _info(), load_fn=lambda: next(load))
    lease.start()
    try:
        assert registry.is_alive(lease.info.replica_id)
        time.sleep(TTL_S * 3)  # several TTLs: alive only through renewals
        (seen,) = registry.replicas("encoder")
        assert seen.replica_id == lease.info.replica_id and seen.load >= 3 and seen.renewed_at > seen.started_at
        client.delete(registry.key(lease.info.replica_id))
        client.srem(registry.set_key("encoder"), lease.info.replica_id)
        assert _wait_until(lambda: [r.replica_id for r in registry.replicas("encoder")] == [lease.info.replica_id])
    finally:
        lease.stop()
    assert registry.replicas("encoder") == [] and registry.dead_members("encoder") == []
    time.sleep(TTL_S)  # the thread stopped: nothing registers it again
    assert not registry.is_alive(lease.info.replica_id)
    client.close()


def test_lease_start_survives_redis_away():
    reg = ReplicaRegistry("redis://127.0.0.1:1/0", ttl_s=TTL_S)
    lease = Lease(reg, _info())
    lease.start()  # logs, does not raise
    assert lease._thread.is_alive()
    lease.stop()


def _child_shm_id(shm_dir: str, out) -> None:
    out.put(shm_namespace_id(shm_dir))


def test_shm_namespace_id_shared_iff_same_dir(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_child_shm_id, args=(str(a), out)) for _ in range(4)]
    for p in procs:
        p.start()
    ids = {out.get(timeout=60) for _ in procs}
    for p in procs:
        p.join()
    assert len(ids) == 1 and len(ids.pop()) == 32
    assert shm_namespace_id(str(a)) == (a / "encdec-shm-id").read_text()
    assert shm_namespace_id(str(b)) != shm_namespace_id(str(a))
    assert shm_namespace_id(str(tmp_path / "missing")) == ""
    assert sorted(p.name for p in a.iterdir()) == ["encdec-shm-id"]  # no temporary files left


def test_advertise_address(monkeypatch):
    cfg = EncoderServiceConfig(host="0.0.0.0", port=50061)
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert advertise_address(cfg) == "10.1.2.3:50061"
    assert advertise_address(EncoderServiceConfig(host="::1", port=7)) == "[::1]:7"
    assert advertise_address(EncoderServiceConfig(advertise_address="enc.svc:9", port=0)) == "enc.svc:9"
    with pytest.raises(ValueError, match="port 0"):
        advertise_address(EncoderServiceConfig(port=0))


def test_embed_service_registers_while_serving_and_deregisters_on_sigterm(redis_url, tmp_path):
    from helpers.embed_checkpoints import build_classifier

    from encdec.launcher import encoder_service

    model = build_classifier(tmp_path / "bert", "bert", num_labels=2)
    url = urlunsplit(urlsplit(redis_url)._replace(path="/10"))  # a database of its own: no other test's replicas
    reg = ReplicaRegistry(url)
    try:
        args = ["--redis-url", url, "--metrics-port", "0", "--lease-ttl-s", "2"]
        with encoder_service(str(model), args) as address:
            (info,) = reg.replicas("embed")
            assert (info.address, info.model, info.kv_transports, info.gpu_ids) == (address, str(model), (), ())
            assert str(model) in info.served_names and info.host_id == host_id()
            time.sleep(2.5)  # past one TTL: alive through its renewals
            assert reg.is_alive(info.replica_id)
        assert reg.replicas("embed") == [] and reg.dead_members("embed") == []  # SIGTERM: deregistered at once
    finally:
        reg.close()


def test_replica_info_round_trip():
    info = _info(gpu_ids=("GPU-1",), load=2, started_at=1.5)
    assert ReplicaInfo.from_json(info.to_json()) == info
    with pytest.raises(ValueError):
        ReplicaInfo.from_json('{"replica_id": "x"}')
    with pytest.raises(ValueError, match="role"):
        _info(role="gateway")
