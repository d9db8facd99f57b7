"""`ledger_ack_replicas`: a settlement batch and a top-up are done once a replica has them
(WAIT on the same connection); a settlement no replica confirmed is sent again until one does,
and a charge the old primary took unconfirmed is made on the primary the Sentinels name next.
A real primary and replica (redis-server's `--replicaof`), real Sentinels."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.credits.ledger import Ledger, settle_call
from proxy.credits.settler import Settler
from proxy.observe.metrics import Labels, Metrics
from proxy.store.background import stop_task
from proxy.store.client import connect_redis, follow_primary, primary_address
from tests.support.config_files import MODEL
from tests.support.processes import free_port
from tests.support.redis_topologies import HOST, RedisNode, SentinelProcesses


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


async def test_settlements_wait_for_a_replica_and_are_sent_again_until_one_confirms(
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

        # No replica to confirm: the charge stands, and is sent again (a no-op there, its hold
        # ended) with each batch until a replica confirms it.
        replica.kill()
        hold = await ledger.hold("acme", 100, ttl_s=60)
        keys, args = settle_call("acme", hold, 30, 100, "completed", MODEL, {}, {}, 100, 0)
        settler.settle(ledger.settle_script, keys, args)
        await settler.flush()  # WAIT gives up after a second
        await settler.flush()
        assert settler.pending == 1 and settler.unreplicated == 0 and settler.lost == 0
        assert (await ledger.balance("acme")).spent == 70
        replica.start()
        deadline = time.monotonic() + 15
        while settler.pending:
            assert time.monotonic() < deadline, "no replica ever confirmed the charge"
            await settler.flush()
        assert settler.unreplicated == 0 and settler.lost == 0
        with replica.client() as copy:
            assert copy.hget("igw:{acme}:bal", "spent") == "70"
        assert [e["cost"] for e in await ledger.all_entries("acme")
                if e["type"] == "charge"] == [40, 30]  # once each

        # Kept, not sent again, while the same server holds them: one marker and WAIT a flush.
        # A charge, or a guest's usage entry (never sent twice: no hold id makes it
        # idempotent), that no replica confirms for `confirm_for_s` is given up on, at risk.
        replica.kill()
        brief = Settler(ledger.primaries, [ledger.settle_script], metrics, ack_replicas=1,
                        confirm_for_s=0.5)
        hold = await ledger.hold("acme", 100, ttl_s=60)
        keys, args = settle_call("acme", hold, 20, 100, "completed", MODEL, {}, {}, 100, 0)
        brief.settle(ledger.settle_script, keys, args)
        keys, args = settle_call("guest:1", "", 0, 0, "completed", MODEL, {}, {}, 100, 0)
        brief.settle(ledger.settle_script, keys, args, repeatable=False)
        await brief.flush()
        assert (brief.pending, brief.unreplicated) == (2, 0)
        await brief.flush()  # a second later: past confirm_for_s
        assert (brief.pending, brief.unreplicated, brief.lost) == (0, 2, 0)
        assert metrics.registry.get_sample_value("igw_settlements_unreplicated_total") == 2
        assert (await ledger.balance("acme")).spent == 90
        assert await ledger.reconcile(["acme"]) == []
        await brief.drain(1)
    finally:
        await settler.drain(1)
        await ledger.close()
        await redis.aclose()


async def test_a_charge_the_old_primary_took_unconfirmed_is_made_on_the_next(
        tmp_path: Path) -> None:
    """A Sentinel's second, hasty failover: the primary the gateway writes to stays up and a
    primary for a while after the Sentinels named another, which lacks what it took since.
    The gateway follows the Sentinels (every connection, the settler's and admission's pipes
    included) and the charges and the top-up it took unconfirmed are made on the new primary,
    once each."""
    with SentinelProcesses(tmp_path / "sentinel", replicas=1) as sentinels:
        redis = connect_redis(sentinels.url)
        follower = asyncio.create_task(follow_primary(redis))
        ledger = Ledger(redis, ack_replicas=1)
        metrics = Metrics(Labels((), frozenset, ()), CollectorRegistry())
        settler = Settler(ledger.primaries, [ledger.settle_script], metrics, ack_replicas=1)
        try:
            await ledger.credit("acme", 1000, {})
            held = await ledger.hold("acme", 100, ttl_s=60)  # the replica has this hold
            old = sentinels.master()
            new = next(node for node in sentinels.nodes if node is not old)
            with new.client() as client:  # cut off: it keeps what it has so far
                client.execute_command("REPLICAOF", "NO", "ONE")
            unseen = await ledger.hold("acme", 100, ttl_s=60)  # on the old primary only
            for hold, cost in ((held, 40), (unseen, 30)):
                keys, args = settle_call("acme", hold, cost, 100, "completed", MODEL, {}, {},
                                         100, 0)
                settler.settle(ledger.settle_script, keys, args)
            await settler.flush()  # the old primary takes both; no replica confirms them
            assert settler.pending == 2 and (await ledger.balance("acme")).spent == 70
            # A top-up meanwhile: no replica confirms it either; it is sent again each second.
            topup = asyncio.create_task(ledger.credit("acme", 500, {"reason": "top-up"}))
            await asyncio.sleep(0.5)

            for sentinel in sentinels.sentinels:  # the Sentinels now name the other server
                with sentinel.client() as client:
                    client.execute_command("SENTINEL", "REMOVE", sentinels.service)
                    client.execute_command("SENTINEL", "MONITOR", sentinels.service, HOST,
                                           new.port, sentinels.quorum)
            deadline = time.monotonic() + 10
            while primary_address(redis)() != (HOST, new.port):
                assert time.monotonic() < deadline, "the client never followed the Sentinels"
                await asyncio.sleep(0.05)
            with old.client() as client:  # and the old primary becomes its replica
                client.execute_command("REPLICAOF", HOST, str(new.port))
            deadline = time.monotonic() + 15
            while settler.pending:
                assert time.monotonic() < deadline, "the charges were never confirmed"
                await settler.flush()
            assert settler.unreplicated == 0 and settler.lost == 0
            await topup
            balance = await ledger.balance("acme")
            assert (balance.credited, balance.spent, balance.held) == (1500, 70, 0), balance
            credits = [e for e in await ledger.all_entries("acme") if e["type"] == "credit"]
            assert [e["amount"] for e in credits] == [1000, 500], credits  # each once
            charges = [e for e in await ledger.all_entries("acme") if e["type"] == "charge"]
            assert sorted(e["cost"] for e in charges) == [30, 40], charges
            assert await ledger.reconcile(["acme"]) == []
            with old.client() as client:  # what the old primary took was discarded
                assert client.hget("igw:{acme}:bal", "spent") == "70"
        finally:
            await stop_task(follower)
            await settler.drain(1)
            await ledger.close()
            await redis.aclose()
