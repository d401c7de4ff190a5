"""The local redis-server of ``encdec up`` and the tests caps its memory and never evicts (issue 34 item 9): full,
it refuses writes and every record written before is still there (real redis-server)."""

from __future__ import annotations

import pytest
import redis

from decoder_svc.replicas.request_state import RedisUnavailableError, RequestStateStore
from encdec.redis_server import MAXMEMORY, LocalRedisServer


def test_local_redis_has_maxmemory_and_noeviction():
    with LocalRedisServer() as server:
        config = redis.Redis.from_url(server.url).config_get("maxmemory*")
    assert config["maxmemory-policy"] == "noeviction"
    assert int(config["maxmemory"]) == int(MAXMEMORY.removesuffix("mb")) * 2**20


def test_a_full_local_redis_refuses_new_records_and_keeps_every_old_one():
    with LocalRedisServer(extra_args=("--maxmemory", "2mb")) as server:  # the last --maxmemory wins
        store = RequestStateStore(server.url)
        created = 0
        with pytest.raises(RedisUnavailableError, match="is full") as err:
            for created in range(100_000):  # noqa: B007 - the count is read after the loop
                store.create(f"r{created}", "m")
        assert isinstance(err.value.__cause__, redis.exceptions.OutOfMemoryError)  # UNAVAILABLE, not INTERNAL
        assert created > 100
        assert all(store.get(f"r{i}") is not None for i in range(created))  # nothing evicted
        store.close()
