"""Holds are soft state: they must never come back from a restart of the ledger's Redis, even once
an AOF rewrite (or a replica's full sync) has captured them in a snapshot whose releases were
never logged. A real redis-server with `appendfsync always`, rewritten, then killed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from proxy.config import ModelPrice, PricesPolicy, TierPolicy
from proxy.credits.admission import Admitter
from proxy.credits.ledger import Ledger
from proxy.credits.meter import Metering, Result
from proxy.credits.settler import Settler
from proxy.identity.principal import Principal
from proxy.observe.metrics import Labels, Metrics
from proxy.store.client import connect_redis
from proxy.store.redis_process import RedisProcess
from tests.support.processes import free_port

MODEL = "acme/small-chat"
PRICES = PricesPolicy(default=ModelPrice(prompt_per_1k_tokens=1000,
                                         completion_per_1k_tokens=1000), hold_ttl_s=3600)
TIER = TierPolicy(requests_per_minute=1000, families=["chat"], models={"*": ["direct"]})
ALICE = Principal(kind="key", account="alice", tier="max", key_id="key_a")
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class Books:
    """A worker's ledger objects on one Redis (made again after each restart)."""

    def __init__(self, url: str) -> None:
        self.redis = connect_redis(url)
        self.ledger = Ledger(self.redis)
        metrics = Metrics(Labels([MODEL], lambda: {"max"}, []), CollectorRegistry())
        self.admitter = Admitter(self.ledger, self.redis)
        self.settler = Settler(self.ledger.primaries, [self.ledger.settle_script], metrics)
        self.metering = Metering(self.admitter, self.settler, self.ledger.settle_script, metrics)

    async def close(self) -> None:
        await self.admitter.close()
        await self.settler.drain(timeout_s=5)
        await self.ledger.close()
        await self.redis.aclose()


@pytest.fixture
async def ledger_redis(tmp_path: Path) -> AsyncIterator[RedisProcess]:
    server = RedisProcess(tmp_path / "ledger", port=free_port())
    server.start()
    yield server
    server.stop()


async def rewrite_aof(books: Books) -> None:
    await books.redis.bgrewriteaof()
    for _ in range(200):
        await asyncio.sleep(0.05)
        info = await books.redis.info("persistence")
        if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
            return
    raise AssertionError("the AOF rewrite did not finish")


def answered(prompt: int, completion: int) -> Result:
    result = Result()
    result.answered(usage={"prompt_tokens": prompt, "completion_tokens": completion})
    result.delivered()
    return result


async def test_a_settled_hold_stays_ended_after_a_rewrite_and_a_crash(
        ledger_redis: RedisProcess) -> None:
    books = Books(ledger_redis.url)
    try:
        await books.ledger.credit("alice", 1_000_000, {"by": "test"})
        running = books.metering.chat(PRICES, ALICE, MODEL, "direct", "openai", "r1", BODY,
                                      32_000)
        await running.admit(TIER)  # held while the request runs ...
        assert (await books.ledger.balance("alice")).held > 0
        await rewrite_aof(books)  # ... and the rewrite snapshots the open hold
        running.settle(answered(10, 5))  # it ends: charged 15, the rest released
        await books.settler.flush()
        assert (await books.ledger.balance("alice")).held == 0
    finally:
        await books.close()

    ledger_redis.kill()  # a crash: the AOF is the snapshot and the charge logged after it
    ledger_redis.start()

    books = Books(ledger_redis.url)
    try:
        balance = await books.ledger.balance("alice")
        assert (balance.available, balance.held, balance.spent) == (1_000_000 - 15, 0, 15)
        assert await books.ledger.open_holds("alice") == {}
        assert await books.ledger.reconcile(["alice"]) == []
        # The account works as before: a new request holds, pays and releases.
        again = books.metering.chat(PRICES, ALICE, MODEL, "direct", "openai", "r2", BODY, 100)
        await again.admit(TIER)
        again.settle(answered(1, 1))
        await books.settler.flush()
        balance = await books.ledger.balance("alice")
        assert (balance.available, balance.held, balance.spent) == (1_000_000 - 17, 0, 17)
        assert await books.ledger.reconcile(["alice"]) == []
    finally:
        await books.close()


async def test_a_hold_open_at_the_crash_is_forgotten_and_its_request_still_pays(
        ledger_redis: RedisProcess) -> None:
    books = Books(ledger_redis.url)
    try:
        await books.ledger.credit("alice", 1_000_000, {"by": "test"})
        running = books.metering.chat(PRICES, ALICE, MODEL, "direct", "openai", "r1", BODY,
                                      1000)
        await running.admit(TIER)
        await rewrite_aof(books)
        ledger_redis.kill()
        ledger_redis.start()
        # The hold came back in the snapshot; the next touch of the account forgets it, and the
        # request that was running then is charged from what is available (never more).
        assert (await books.ledger.balance("alice")).held == 0
        assert await books.ledger.open_holds("alice") == {}
        running.settle(answered(10, 5))
        await books.settler.flush()
        balance = await books.ledger.balance("alice")
        assert (balance.available, balance.held, balance.spent) == (1_000_000 - 15, 0, 15)
        assert await books.ledger.reconcile(["alice"]) == []
    finally:
        await books.close()
