"""Backpressure by tier: while the engines' own queue is deep, a tier whose queue budget it has
reached gets 503 `pool_saturated` at once (nothing reaches the engine, nothing is held or
charged), and a tier with headroom is still served. Real `serve`, real vLLM simulator."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from proxy.credits.ledger import Ledger
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.config_files import MODEL
from tests.support.fleet import Stack
from tests.support.upstreams import SimulatorFactory, sim_requests

CHAT = "/v2/compat/v1/chat/completions"
TIERS = """
[tiers.guest]
requests_per_minute = 100
families = ["chat"]
models = { "*" = ["direct"] }
queue_budget = 0

[tiers.basic]
requests_per_minute = 100
families = ["chat"]
models = { "*" = ["direct"] }
queue_budget = 2

[tiers.max]
requests_per_minute = 100
families = ["chat"]
models = { "*" = ["direct"] }
"""
PRICES = """
version = "bp-test"
default_max_tokens = 16
[default]
completion_per_1k_tokens = 10000
"""
HELLO = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_saturated_pool_refuses_basic_at_once_and_still_serves_max(
        tmp_path: Path, clean_redis: RedisProcess, simulator: SimulatorFactory,
        stacks: list[Stack]) -> None:
    sim = await simulator("vllm", max_concurrency=1)  # a batch of one: the rest queue
    gateway = Stack(tmp_path, [{"name": "r0", "kind": "vllm", "models": [MODEL],
                                "url": str(sim.make_url("/")).rstrip("/")}],
                    workers=2, redis_url=clean_redis.url, gateway_extra={"access_log": "off"},
                    policies={"tiers.toml": TIERS, "prices.toml": PRICES})
    stacks.append(gateway)
    url = gateway.url
    basic = await new_key(clean_redis.url, "basic", account="acct-basic")
    best = await new_key(clean_redis.url, "max", account="acct-max")
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    for account in ("acct-basic", "acct-max"):
        await ledger.credit(account, 10**9, {"reason": "test"})
    direct = aiohttp.ClientSession()  # other clients of the same engine, straight to it
    session = aiohttp.ClientSession()
    try:
        await asyncio.to_thread(gateway.ready)

        async def chat(key: str) -> aiohttp.ClientResponse:
            return await session.post(url + CHAT, json=HELLO, headers={
                "Authorization": f"Bearer {key}", "Connection": "close"})

        # A stream that stalls after its first token holds the only slot; three more wait.
        hung = await direct.post(sim.make_url("/v1/chat/completions"),
                                 json={**HELLO, "stream": True}, headers={"x-sim-hang-after": "1"})
        await hung.content.readline()
        waiting = [asyncio.create_task(direct.post(
            sim.make_url("/v1/chat/completions"), json=HELLO)) for _ in range(3)]
        for _ in range(100):  # the master reads the queue; every worker follows
            async with session.get(url + "/metrics", headers={"Connection": "close"}) as r:
                text = await r.text()
            if 'igw_engine_waiting{backend="r0"} 3.0' in text:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the engine's queue never showed")
        await asyncio.sleep(1.0)  # both workers have polled since
        seen = len(await sim_requests(sim))
        for _ in range(4):  # whichever worker answers
            refused = await chat(basic)
            assert refused.status == 503, await refused.text()
            error = (await refused.json())["error"]
            assert error["type"] == "pool_saturated" and "basic" in error["message"]
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert len(await sim_requests(sim)) == seen  # never reached the engine
        balance = await ledger.balance("acct-basic")
        assert (balance.held, balance.spent) == (0, 0) and not await ledger.open_holds(
            "acct-basic")
        # Max has no budget: admitted, and it queues at the engine like anyone else.
        served = asyncio.create_task(chat(best))
        for _ in range(50):
            if len(await sim_requests(sim)) == seen + 1:
                break
            await asyncio.sleep(0.05)
        assert len(await sim_requests(sim)) == seen + 1
        hung.close()  # the stall ends: the queue drains
        response = await asyncio.wait_for(served, 20)
        assert response.status == 200, await response.text()
        for task in waiting:
            (await task).close()
        async with session.get(url + "/metrics", headers={"Connection": "close"}) as r:
            assert 'type="pool_saturated"' in await r.text()
    finally:
        await session.close()
        await direct.close()
        await redis.aclose()
