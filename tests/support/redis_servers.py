"""Fixtures (a pytest plugin): the session's real redis-server, and the same emptied for a test;
a three-primary Cluster; and a store client on either, for tests that must hold on both.

Tests that kill Redis start their own `RedisProcess`; Cluster and Sentinel topologies are in
redis_topologies.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from proxy.store.client import Store, connect_redis
from proxy.store.redis_process import RedisProcess
from tests.support.processes import free_port
from tests.support.redis_topologies import ClusterProcesses


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


@pytest.fixture
def three_primaries(tmp_path: Path) -> Iterator[ClusterProcesses]:
    """A Redis Cluster of three primaries, no replicas (~2 s to start)."""
    with ClusterProcesses(tmp_path / "cluster", masters=3, replicas_per_master=0) as started:
        yield started


@pytest.fixture(params=["redis", "cluster"])
async def redis_or_cluster(request: pytest.FixtureRequest, clean_redis: RedisProcess
                           ) -> AsyncIterator[Store]:
    """The gateway's store client on one redis-server, then on a three-primary Cluster."""
    url = clean_redis.url if request.param == "redis" else \
        request.getfixturevalue("three_primaries").url
    redis = connect_redis(url)
    try:
        yield redis
    finally:
        await redis.aclose()
