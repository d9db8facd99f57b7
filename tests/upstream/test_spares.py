"""Spare slots (proxy.upstream.spares): while a pool is far from full, a worker keeps a few of
its backends' slots between requests, so its requests make no slot-ledger call; the ledger grants
them only while half the pool stays free, they go back when their lease ends, and a request
queued in another gateway gets them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from proxy.config import BackendSpec
from proxy.upstream.pool import Backend
from proxy.upstream.slots import SlotLedger, Taken
from proxy.upstream.spares import LEASE_S, Spares, most_kept
from tests.support.accounts import funded_key, new_key
from tests.support.config_files import MODEL, tiers
from tests.support.gateway import GatewayFactory, settled
from tests.support.redis_servers import RedisProcess
from tests.support.upstreams import SimulatorFactory, sim_requests

CHAT = "/v2/compat/v1/chat/completions"
TIERS = tiers(basic=10_000)  # one key sends every request of a test


def backend(name: str, slots: int) -> Backend:
    return Backend(BackendSpec(name=name, kind="vllm", url="http://127.0.0.1:9",
                               models=[MODEL], max_concurrency=slots))


async def held(redis_url: str) -> dict[str, int]:
    """Slots in flight per backend, fleet-wide, as the ledger counts them."""
    redis = Redis.from_url(redis_url)
    try:
        return {k.decode(): int(v) for k, v in (await redis.hgetall("igw:{slots}:total")).items()}
    finally:
        await redis.aclose()


async def none_held(redis_url: str) -> None:
    """Wait (2 s at most) until the ledger counts no slot in flight."""
    async with asyncio.timeout(2):
        while True:
            if not await held(redis_url):
                return
            await asyncio.sleep(0.02)


async def evalsha_calls(redis_url: str) -> int:
    redis = Redis.from_url(redis_url)
    try:
        stats = await redis.info("commandstats")
    finally:
        await redis.aclose()
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def chat(gw: TestServer, key: str, text: str, tokens: int = 4) -> tuple[int, Any]:
    body = {"model": MODEL, "max_tokens": tokens, "messages": [{"role": "user", "content": text}]}
    async with aiohttp.ClientSession() as s, \
            s.post(gw.make_url(CHAT), headers={"X-API-Key": key}, json=body) as r:
        return r.status, await r.json()


async def basic_key(redis_url: str, account: str) -> str:
    key = await new_key(redis_url, "basic", account=account)
    await funded_key(redis_url, account=account)
    return key


async def test_a_worker_keeps_at_most_one_in_sixteen_of_a_backends_slots_for_a_lease() -> None:
    assert [most_kept(n) for n in (1, 15, 16, 63, 64, 1000)] == [0, 0, 1, 3, 4, 4]
    given: list[tuple[str, int]] = []
    spares = Spares(lambda name, count: given.append((name, count)))
    big, small = backend("big", 64), backend("small", 8)
    assert spares.wanted(big) == 4 and spares.wanted(small) == 0
    assert not spares.keep(big)  # no lease yet: a slot given back goes to the ledger
    spares.granted(big, 2)
    assert spares.wanted(big) == 2
    assert [spares.use(big), spares.use(big), spares.use(big)] == [True, True, False]
    assert [spares.keep(big) for _ in range(5)] == [True, True, True, True, False]  # 4 at most
    assert not spares.keep(small) and not spares.use(small)
    await asyncio.sleep(LEASE_S + 0.05)
    assert given == [("big", 4)]  # the lease ended: the idle ones went back
    assert not spares.keep(big) and not spares.use(big) and not spares
    spares.granted(big, 3)
    spares.give_back_all()
    assert given == [("big", 4), ("big", 3)] and not spares
    await asyncio.sleep(LEASE_S + 0.05)
    assert given == [("big", 4), ("big", 3)]  # nothing twice


async def test_the_ledger_grants_spares_only_on_the_first_backend_while_half_the_pool_is_free(
        clean_redis: RedisProcess) -> None:
    redis = Redis.from_url(clean_redis.url)
    ledger, other = SlotLedger(redis), SlotLedger(redis)
    offer = [("b0", 32, 0), ("b1", 32, 0)]  # 64 slots: spares only while 32 stay free
    try:
        assert await ledger.take("pool", 1, (), "a", offer, spare=4) == Taken(("b0",), 0, 0, 4)
        assert await held(clean_redis.url) == {"b0": 5}
        for _ in range(24):
            assert (await ledger.take("pool", 1, (), "b", [("b1", 32, 0)])).backends == ("b1",)
        # 34 free after its own slot: two spares leave 32.
        got = await ledger.take("pool", 1, (), "a", offer, spare=4)
        assert (got.backends, got.spare) == (("b0",), 2)
        got = await ledger.take("pool", 1, (), "a", offer, spare=4)
        assert (got.backends, got.spare) == (("b0",), 0)
        assert await held(clean_redis.url) == {"b0": 9, "b1": 24}
        # The first is full: the slot is the second's, and no spares (the first's only).
        assert (await ledger.take("pool", 1, (), "c", [("full", 1, 0), *offer])).backends == (
            "full",)
        got = await ledger.take("pool", 1, (), "c", [("full", 1, 0), *offer], spare=4)
        assert (got.backends, got.spare) == (("b0",), 0)
        await ledger.give_back("b0", 40)  # never more than the process holds
        await ledger.give_back("full", 1)
        assert await held(clean_redis.url) == {"b1": 24}
        assert (await other.take("pool", 1, (), "d", offer)).backends == ("b0",)
        await ledger.give_back("b0", 5)  # another process's slot is not this one's to give
        assert await held(clean_redis.url) == {"b0": 1, "b1": 24}
    finally:
        await ledger.close()
        await other.close()
        await redis.aclose()


async def test_requests_make_no_ledger_call_while_the_pool_is_far_from_full(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """Twenty requests one after the other through a gateway whose backend runs 64 at once,
    then through one whose backend runs 8 (no spares: fewer than 16 slots): the first makes
    about two Redis script calls fewer per request (a slot's take and its give-back), and its
    spares go back once their lease ends."""
    sim = await simulator(default_completion_tokens=4)
    url = str(sim.make_url("/")).rstrip("/")
    calls = []
    for slots in (64, 8):
        gw = await gateway({"name": f"b{slots}", "kind": "vllm", "url": url, "models": [MODEL],
                            "max_concurrency": slots}, policies={"tiers.toml": TIERS})
        key = await basic_key(clean_redis.url, f"acct-{slots}")
        assert (await chat(gw, key, "warm"))[0] == 200  # the worker's first take and beat
        await settled(gw)
        before = await evalsha_calls(clean_redis.url)
        for i in range(20):
            assert (await chat(gw, key, f"request {i}"))[0] == 200
        await settled(gw)
        calls.append(await evalsha_calls(clean_redis.url) - before)
        await none_held(clean_redis.url)  # the spares given back once their lease ended
    assert calls[1] - calls[0] >= 30, calls
    assert len(await sim_requests(sim)) == 42


async def test_a_request_queued_in_another_gateway_gets_the_slots_kept_spare(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine of batch 16 that queues one request (the gateway's [routing] engine_queue; an
    18th in flight would be refused by it): one gateway keeps a slot spare after its short
    request, while the other sends 17 long ones at once; the 17th waits for the spare, gets it
    when its lease ends, and the engine never sees 18."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "ops")
    sim = await simulator(tokens_per_s=100, max_concurrency=16, max_queued=17)
    spec = {"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
            "models": [MODEL], "max_concurrency": 16}
    keeper = await gateway(spec, policies={"tiers.toml": TIERS})
    other = await gateway(spec, policies={"tiers.toml": TIERS})
    key = await basic_key(clean_redis.url, "acct-spare")
    first = await chat(keeper, key, "first", tokens=1)
    assert first[0] == 200, first
    assert await held(clean_redis.url) == {"b0": 1}  # its slot, kept spare
    async with aiohttp.ClientSession() as s, s.get(keeper.make_url("/admin/backends"),
                                                   headers={"Authorization": "Bearer ops"}) as r:
        assert (await r.json())["data"][0]["slots"] == {
            "max": 17, "batch": 16, "in_use": 1, "spare": 1}
    done = await asyncio.gather(*(chat(other, key, f"burst {i}", tokens=40) for i in range(17)))
    assert [status for status, _ in done] == [200] * 17, done
    assert {r["outcome"] for r in await sim_requests(sim)} == {"completed"}
    await none_held(clean_redis.url)


async def test_spares_never_leak_nor_overfill_the_engine_when_clients_leave_at_any_moment(
        simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess) -> None:
    """Two gateways on an engine of batch 32 that queues one more (the gateway's [routing]
    engine_queue) and refuses a 34th in flight, both keeping spares: waves of
    requests on both, some cut off at every point (while admitted, while taking a slot, while
    streaming), some running to the end. The engine never refuses one, every slot (spares
    too) is back in the ledger soon after, and both gateways still serve."""
    sim = await simulator(tokens_per_s=200, max_concurrency=32, max_queued=33,
                          default_completion_tokens=8)
    spec = {"name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
            "models": [MODEL], "max_concurrency": 32}
    gateways = [await gateway(spec, policies={"tiers.toml": TIERS}) for _ in range(2)]
    key = await basic_key(clean_redis.url, "acct-waves")

    async def cut(gw: TestServer, text: str, after_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(after_s):
                await chat(gw, key, text)

    for wave, cut_s in enumerate((0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)):
        tries = [cut(gateways[i % 2], f"wave {wave} cut {i}", cut_s) for i in range(12)]
        tries += [cut(gateways[i % 2], f"wave {wave} whole {i}", 30) for i in range(12)]
        await asyncio.gather(*tries)
    await none_held(clean_redis.url)
    assert {r["outcome"] for r in await sim_requests(sim)} <= {"completed", "cancelled"}
    for gw in gateways:
        assert (await chat(gw, key, "after"))[0] == 200
