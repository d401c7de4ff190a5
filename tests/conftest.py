"""Shared pytest fixtures. Keep this file small; add fixtures by topic."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def redis_url():
    """URL of a real redis-server: ``$REDIS_URL`` if set (CI starts one), else a
    ``LocalRedisServer`` started for the session."""
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from shared.redis_server import LocalRedisServer

    with LocalRedisServer() as server:
        yield server.url


@pytest.fixture
def redis_key_prefix(redis_url):
    """A key prefix unique to this test; its keys are deleted afterwards (never FLUSHDB)."""
    import redis

    prefix = f"test-{uuid.uuid4().hex[:12]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
