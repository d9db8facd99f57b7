"""The slot ledger's count of a process's slots follows the process's own (proxy.upstream.holdings):
each heartbeat sets it, so what a lost give-back leaves counted, or a ledger Redis that lost its
data forgot, is right again within a beat (2 s), on a real Redis."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from proxy.appkeys import UPSTREAMS
from proxy.upstream.holdings import Holdings
from proxy.upstream.slots import BEAT_S, SlotLedger
from tests.support.accounts import funded_key, new_key
from tests.support.config_files import MODEL, tiers
from tests.support.gateway import GatewayFactory
from tests.support.redis_servers import RedisProcess
from tests.support.upstreams import SimulatorFactory

CHAT = "/v2/compat/v1/chat/completions"
TOTAL, HELD = "igw:{slots}:total", "igw:{slots}:held"


async def counted(redis: Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in (await redis.hgetall(TOTAL)).items()}


async def until_counted(redis: Redis, expected: dict[str, int], within_s: float) -> None:
    async with asyncio.timeout(within_s):
        while True:
            if await counted(redis) == expected:
                return
            await asyncio.sleep(0.05)


async def stream(gw: TestServer, key: str, text: str) -> int:
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(CHAT), headers={"X-API-Key": key},
            json={"model": MODEL, "stream": True,
                  "messages": [{"role": "user", "content": text}]}) as response:
        await response.read()
        return response.status


async def two_long_streams(simulator: SimulatorFactory, gateway: GatewayFactory,
                           redis_url: str) -> tuple[TestServer, list[asyncio.Task[int]]]:
    """A backend of 4 slots (too few for spares) running two 4-second streams."""
    sim = await simulator(tokens_per_s=10, default_completion_tokens=40)
    gw = await gateway({"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")),
                        "models": [MODEL], "max_concurrency": 4},
                       policies={"tiers.toml": tiers(basic=10_000)})
    key = await new_key(redis_url, "basic", account="acct-held")
    await funded_key(redis_url, account="acct-held")
    running = [asyncio.create_task(stream(gw, key, f"long {i}")) for i in range(2)]
    return gw, running


def test_the_count_is_withheld_while_a_take_is_on_its_way() -> None:
    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

    held = Holdings()
    held.granted([Named("b0"), Named("b1")])  # type: ignore[list-item]
    held.granted([Named("b0")])  # type: ignore[list-item]
    held.released("b1")
    assert held.count({"b1": 2, "b2": 0}) == (0, {"b0": 2, "b1": 2})
    held.asking = 1  # its grant would be in the ledger's count before this one's
    assert held.count({}) is None


async def test_a_count_that_a_later_take_overtook_is_not_applied(
        clean_redis: RedisProcess) -> None:
    """The ledger counts the takes each process ran: a beat counted before a take that the
    ledger ran first (their calls overtook one another) leaves the count as it is."""
    redis = Redis.from_url(clean_redis.url)
    ledger = SlotLedger(redis)
    try:
        assert (await ledger.take("pool", 1, (), "a", [("b0", 4, 0)])).backends == ("b0",)
        assert await ledger.beat(held=(0, {})) == -1  # counted before that take: skipped
        assert await counted(redis) == {"b0": 1}
        assert await ledger.beat(held=(1, {"b0": 1})) == 0
        await redis.hincrby(TOTAL, "b0", 2)  # two give-backs lost
        await redis.hincrby(HELD, f"b0|{ledger.process}", 2)
        assert await ledger.beat(held=(1, {"b0": 1})) == 2
        assert await counted(redis) == {"b0": 1}
        assert await ledger.beat(held=(1, {"b1": 3})) == 4  # b0's one gone, b1's three
        assert await counted(redis) == {"b1": 3}
        assert await ledger.beat() == -1  # unknown: only a beat
    finally:
        await ledger.close()
        await redis.aclose()


async def test_what_a_lost_give_back_left_counted_is_corrected_at_the_next_beat(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="proxy")  # whatever an earlier test set it to
    redis = Redis.from_url(clean_redis.url)
    try:
        gw, running = await two_long_streams(simulator, gateway, clean_redis.url)
        await until_counted(redis, {"b0": 2}, 2)
        # Three give-backs of this process that never reached the ledger (its Redis
        # unreachable a moment): the engine has two free slots, the ledger counts none.
        process = gw.app[UPSTREAMS].dispatcher.ledger.process  # type: ignore[union-attr]
        await redis.hincrby(TOTAL, "b0", 3)
        await redis.hincrby(HELD, f"b0|{process}", 3)
        assert await counted(redis) == {"b0": 5}
        await until_counted(redis, {"b0": 2}, BEAT_S + 1)  # the requests still run
        async with asyncio.timeout(1):  # logged once the beat's reply is in
            while True:
                if "was 3 off" in caplog.text:
                    break
                await asyncio.sleep(0.01)
        assert await asyncio.gather(*running) == [200, 200]
        await until_counted(redis, {}, 2)
    finally:
        await redis.aclose()


async def test_a_ledger_redis_that_lost_its_data_counts_the_running_requests_again(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    redis = Redis.from_url(clean_redis.url)
    try:
        _, running = await two_long_streams(simulator, gateway, clean_redis.url)
        await until_counted(redis, {"b0": 2}, 2)
        await redis.flushall()  # as a restart without persistence leaves it
        assert await counted(redis) == {}
        await until_counted(redis, {"b0": 2}, BEAT_S + 1)  # the two streams, counted again
        assert await asyncio.gather(*running) == [200, 200]
        await until_counted(redis, {}, 2)
    finally:
        await redis.aclose()


async def test_slots_are_exactly_counted_through_a_burst_of_cut_requests(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    """Requests cut at every point and whole ones: after them the ledger counts nothing, and
    the beats between found nothing to correct."""
    sim = await simulator(tokens_per_s=200, default_completion_tokens=8, max_concurrency=8)
    gw = await gateway({"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")),
                        "models": [MODEL], "max_concurrency": 8},
                       policies={"tiers.toml": tiers(basic=10_000)})
    key = await new_key(clean_redis.url, "basic", account="acct-cut")
    await funded_key(clean_redis.url, account="acct-cut")

    async def cut(after_s: float, text: str) -> Any:
        try:
            async with asyncio.timeout(after_s):
                return await stream(gw, key, text)
        except TimeoutError:
            return None

    for wave, after_s in enumerate((0.001, 0.005, 0.02, 0.1, 5.0)):
        await asyncio.gather(*(cut(after_s, f"wave {wave} {i}") for i in range(12)))
    held = gw.app[UPSTREAMS].dispatcher.held
    redis = Redis.from_url(clean_redis.url)
    try:
        await until_counted(redis, {}, 2)
        assert held.count({}) == (held.asked, {})
    finally:
        await redis.aclose()
