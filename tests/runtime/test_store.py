"""The store's URLs (one server, Cluster, Sentinel) and the lease that makes background work run
once across the fleet, and a burst past the pool on a Cluster and Sentinel. Real redis-server
processes; the Cluster and Sentinel under the gateway are in test_scale_out.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.store.background import stop_task
from proxy.store.client import POOL_SIZE, Primaries, connect_redis, store_kind, url_problem
from proxy.store.lease import Lease, lease_key
from proxy.store.redis_process import RedisProcess
from tests.support.fleet import REPO
from tests.support.processes import free_port
from tests.support.redis_topologies import ClusterProcesses, SentinelProcesses


def test_store_kinds() -> None:
    assert store_kind("redis://127.0.0.1:6379/0") == "single"
    assert store_kind("unix:///run/redis.sock") == "single"
    assert store_kind("redis+cluster://a:1,b:2") == "cluster"
    assert store_kind("rediss+cluster://a:1") == "cluster"
    assert store_kind("redis+sentinel://a:1,b:2/igw") == "sentinel"


async def test_cluster_url_names_every_seed_node_and_credentials() -> None:
    client = connect_redis("redis+cluster://user:s%40cret@10.0.0.1:7000,[::1]:7001")
    try:
        assert isinstance(client, RedisCluster)
        seeds = {(n.host, int(n.port)) for n in client.nodes_manager.startup_nodes.values()}
        assert seeds == {("10.0.0.1", 7000), ("::1", 7001)}
        node = next(iter(client.nodes_manager.startup_nodes.values()))
        assert node.connection_kwargs["password"] == "s@cret"
        assert node.connection_kwargs["username"] == "user"
    finally:
        await client.aclose()


@pytest.mark.parametrize("url", ["redis+cluster://nohost", "redis+cluster://a:b",
                                 "redis+sentinel://127.0.0.1:26379"])
def test_malformed_store_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        connect_redis(url)


def test_serve_refuses_a_malformed_store_url_before_starting_anything(tmp_path: Path) -> None:
    (tmp_path / "backends.toml").write_text("")
    env = {**os.environ, "GATEWAY_REDIS_URL": "redis+sentinel://127.0.0.1:26379"}
    done = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 1
    assert "cannot use the redis URL: a redis+sentinel:// URL names the service" in done.stderr
    assert not (tmp_path / ".gateway").exists()  # no embedded Redis, no worker was started
    assert url_problem("redis+cluster://10.0.0.1:7000,10.0.0.2:7000") is None
    assert url_problem("ftp://example") is not None


async def test_sentinel_url_asks_the_sentinels_for_the_primary() -> None:
    """No Sentinel answers on the port: the client says the store is unreachable (a
    connection error, which requests turn into 503), rather than hanging or crashing."""
    client = connect_redis(f"redis+sentinel://127.0.0.1:{free_port()}/igw/2", timeout_s=0.5)
    try:
        assert isinstance(client, Redis)
        assert Primaries(client).kind == "sentinel"
        assert client.connection_pool.connection_kwargs["db"] == 2
        with pytest.raises(RedisConnectionError):
            await client.ping()
    finally:
        await client.aclose()


async def test_one_server_is_its_own_primary(clean_redis: RedisProcess) -> None:
    client = connect_redis(clean_redis.url)
    primaries = Primaries(client)
    try:
        assert primaries.kind == "single" and not primaries.failover
        assert primaries.client_for("igw:{a}:bal") is client
        assert primaries.client_for("igw:{b}:bal") is client
    finally:
        await primaries.close()
        await client.aclose()


async def test_one_lease_holder_at_a_time_and_it_passes_on(clean_redis: RedisProcess) -> None:
    redis = connect_redis(clean_redis.url)
    try:
        first, second = Lease(redis, "sweeper"), Lease(redis, "sweeper")
        assert await first.hold(ttl_s=0.3)
        assert not await second.hold(ttl_s=0.3)
        assert await first.hold(ttl_s=0.3)  # its holder renews it
        held = await redis.get(lease_key("sweeper"))
        assert held is not None and held.decode() == first.holder
        await asyncio.sleep(0.4)  # the holder stopped renewing (it died): the lease lapses
        assert await second.hold(ttl_s=0.3)
        assert not await first.hold(ttl_s=0.3)
        await first.release()  # not the holder: changes nothing
        assert not await first.hold(ttl_s=0.3)
        await second.release()  # at shutdown: the next asker need not wait out the expiry
        assert await first.hold(ttl_s=0.3)
    finally:
        await redis.aclose()


async def test_a_lease_is_not_held_while_the_store_is_down() -> None:
    redis = connect_redis(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    try:
        assert not await Lease(redis, "sweeper").hold(ttl_s=1)
    finally:
        await redis.aclose()


async def test_a_cluster_with_no_node_reachable_is_a_connection_error_to_every_caller(
        ) -> None:
    """Commands and pipelines alike (redis-py raises a bare RedisClusterException, which a
    caller handling RedisError missed: a worker's fleet-state reader died of it)."""
    redis = connect_redis(f"redis+cluster://127.0.0.1:{free_port()}", timeout_s=0.2)
    try:
        with pytest.raises(RedisConnectionError):
            await redis.get("k")
        with pytest.raises(RedisConnectionError):
            async with redis.pipeline(transaction=False) as pipe:
                pipe.get("k")
                await pipe.execute()
    finally:
        await redis.aclose()


@pytest.mark.timeout(120)
async def test_a_burst_past_the_pool_waits_for_a_connection_on_a_cluster_and_sentinel(
        tmp_path: Path) -> None:
    """Twice the pool's connections, each held 0.3 s (BLPOP on an empty list) on one node, as
    a new client's first commands: the Cluster's and the Sentinel primary's clients wait for a
    free connection as the one-server pool does, rather than failing at once as an outage
    would (redis-py's MaxConnectionsError: 503 "unreachable" under a burst, seen in
    loadtests.race); and a new Cluster client maps the Cluster once, before the burst's first
    commands run (each remapping it closed the others' connections under them: 503s, and an
    AttributeError, a 500)."""
    for topology in (ClusterProcesses(tmp_path / "cluster", replicas_per_master=0),
                     SentinelProcesses(tmp_path / "sentinel")):
        with topology:
            store = connect_redis(topology.url)
            try:
                waits = await asyncio.gather(
                    *(store.blpop(["igw:{burst}:empty"], timeout=0.3)
                      for _ in range(2 * POOL_SIZE)), return_exceptions=True)
                assert waits == [None] * (2 * POOL_SIZE), {type(w) for w in waits}
            finally:
                await store.aclose()


async def test_stopping_a_redis_loop_ends_it_though_redis_py_swallows_a_cancellation(
        clean_redis: RedisProcess) -> None:
    """redis-py (8.1) can swallow a cancellation that lands inside a blocking command: the
    command returns empty and the loop goes on (redis/redis-py#2028). A stopped background loop
    ends anyway: `stop_task` cancels again. A loop shaped like PrefixShare.run, cancelled at
    60 different moments of its read; a single cancel left such a loop running forever."""
    redis = Redis.from_url(clean_redis.url)
    survived_a_cancel = 0

    async def follow() -> None:
        nonlocal survived_a_cancel
        me = asyncio.current_task()
        assert me is not None
        while True:
            await redis.xread({"stream": "$"}, count=10, block=50)
            survived_a_cancel += me.cancelling() > 0

    try:
        for moment in range(60):
            task = asyncio.create_task(follow())
            await asyncio.sleep(0.001 * moment)
            await asyncio.wait_for(stop_task(task), 5)
            assert task.cancelled()
    finally:
        await redis.aclose()
    print(f"cancellations swallowed by redis-py: {survived_a_cancel} of 60")
