"""Fixtures (a pytest plugin): the session's real redis-server, and the same emptied for a test.

Tests that kill Redis start their own `RedisProcess`; Cluster and Sentinel topologies are in
redis_topologies.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from proxy.store.redis_process import RedisProcess
from tests.support.processes import free_port


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One real redis-server for the session (tests that kill Redis start their own)."""
    proc = RedisProcess(tmp_path_factory.mktemp("redis"), port=free_port(), fsync="everysec")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
async def clean_redis(redis_server: RedisProcess) -> RedisProcess:
    """The session's redis-server, emptied: no keys, limits or balances from earlier tests."""
    redis = Redis.from_url(redis_server.url)
    await redis.flushdb()
    await redis.aclose()
    return redis_server
