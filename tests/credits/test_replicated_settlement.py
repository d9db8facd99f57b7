"""`ledger_ack_replicas`: a settlement batch and a top-up are done once a replica has them
(WAIT on the same connection), and one that no replica confirmed in time is counted. A real
primary and replica (redis-server's `--replicaof`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.credits.ledger import Ledger, settle_call
from proxy.credits.settler import Settler
from proxy.observe.metrics import Labels, Metrics
from proxy.store.client import connect_redis
from tests.support.config_files import MODEL
from tests.support.processes import free_port
from tests.support.redis_topologies import RedisNode


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RedisNode, RedisNode]]:
    primary = RedisNode(tmp_path / "primary", free_port())
    primary.start()
    replica = RedisNode(tmp_path / "replica", free_port(),
                        ["--replicaof", "127.0.0.1", str(primary.port)], role="replica")
    replica.start()
    try:
        deadline = time.monotonic() + 10
        with primary.client() as client:
            while client.info("replication").get("connected_slaves", 0) < 1:
                assert time.monotonic() < deadline, "the replica did not connect"
                time.sleep(0.05)
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


async def test_settlements_wait_for_a_replica_and_count_when_none_confirms(
        pair: tuple[RedisNode, RedisNode]) -> None:
    primary, replica = pair
    redis = connect_redis(f"redis://127.0.0.1:{primary.port}/0")
    ledger = Ledger(redis, ack_replicas=1)
    metrics = Metrics(Labels((), frozenset, ()), CollectorRegistry())
    settler = Settler(ledger.primaries, [ledger.settle_script], metrics, ack_replicas=1)
    try:
        await ledger.credit("acme", 1000, {})  # a top-up waits for the replica too
        with replica.client() as copy:
            assert copy.hget("igw:{acme}:bal", "credited") == "1000"  # already there
        hold = await ledger.hold("acme", 100, ttl_s=60)
        keys, args = settle_call("acme", hold, 40, 100, "completed", MODEL, {}, {}, 100, 0)
        settler.settle(ledger.settle_script, keys, args)
        await settler.flush()
        assert settler.unreplicated == 0 and settler.lost == 0
        with replica.client() as copy:  # the batch was done only once the replica had it
            assert copy.hget("igw:{acme}:bal", "spent") == "40"

        replica.kill()  # no replica to confirm: the charge stands, counted as unreplicated
        hold = await ledger.hold("acme", 100, ttl_s=60)
        keys, args = settle_call("acme", hold, 30, 100, "completed", MODEL, {}, {}, 100, 0)
        settler.settle(ledger.settle_script, keys, args)
        await settler.flush()  # WAIT gives up after a second
        assert settler.unreplicated == 1 and settler.lost == 0
        assert metrics.registry.get_sample_value("igw_settlements_unreplicated_total") == 1
        assert (await ledger.balance("acme")).spent == 70
        assert await ledger.reconcile(["acme"]) == []
    finally:
        await settler.drain(1)
        await ledger.close()
        await redis.aclose()
