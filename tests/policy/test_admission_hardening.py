"""What the attack run broke in admission and identity (issue 9 items 7, 9, 10, 11, 15): a busy
connection pool is not an outage, unknown keys cannot flood Redis, IPv6 guests share their /64,
the rate-limit headers come from the counting step itself, a reload reaches every worker, deep
JSON and empty credentials get clear 4xx answers."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from proxy.app import build_app
from proxy.config import load_config
from proxy.identity import apikeys
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.chat import CHAT, HELLO, post
from tests.support.config_files import MODEL, tiers, write_config
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import SimulatorFactory, sim_requests

BODY = {"model": MODEL, "messages": HELLO}
CHAT_ROUTES = ["/v2/compat/v1/chat/completions", "/v2/served/v1/chat/completions",
               "/v2/messages/v1/messages", "/v2/native/api/chat", "/api/native/chat"]


@contextlib.asynccontextmanager
async def key_reads(redis_url: str) -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """A count of the key store's reads (HGETALL of an `igw:key:` hash) since entering, as
    Redis' MONITOR shows them: the other readers of the same Redis (the health prober's
    fleet hash, the slot ledger's heartbeat) never count, however slow the run."""
    redis = Redis.from_url(redis_url)
    seen = 0
    async with redis.monitor() as monitor:

        async def count() -> int:
            nonlocal seen
            # A marker sent on another connection: once MONITOR shows it, it has shown every
            # command Redis ran before it.
            marker = f"mark-{os.urandom(4).hex()}"
            probe = Redis.from_url(redis_url)
            try:
                await probe.echo(marker)
            finally:
                await probe.aclose()
            while marker not in (command := (await monitor.next_command())["command"]):
                seen += command.upper().startswith("HGETALL IGW:KEY:")
            return seen

        yield count
    await redis.aclose()


# -- 7: many concurrent requests on a healthy Redis ---------------------------------------------

async def test_a_flood_on_a_healthy_store_is_limited_exactly_never_503(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    gw = await gateway(await simulator(), policies={"tiers.toml": tiers(guest=20, basic=20)})
    basic = await new_key(clean_redis.url, "basic", account="flooder")
    paying = await new_key(clean_redis.url, "max", account="payer")
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(headers: dict[str, str]) -> int:
            async with session.post(gw.make_url(CHAT), json=BODY, headers=headers) as response:
                await response.read()
                return response.status

        basic_flood = [one({"X-API-Key": basic}) for _ in range(200)]
        guest_flood = [one({}) for _ in range(200)]
        keyed = [one({"X-API-Key": paying}) for _ in range(40)]
        statuses = await asyncio.gather(*basic_flood, *guest_flood, *keyed)
    basic_seen = Counter(statuses[:200])
    guest_seen = Counter(statuses[200:400])
    assert basic_seen == {200: 20, 429: 180}, basic_seen  # exact: no fallback, no 503
    assert guest_seen == {200: 20, 429: 180}, guest_seen
    assert Counter(statuses[400:]) == {200: 40}  # the guests did not starve the paying key


# -- 10: the headers come from the counting step -------------------------------------------------

async def test_remaining_is_distinct_under_concurrency(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    gw = await gateway(await simulator(), policies={"tiers.toml": tiers(basic=50)})
    key = await new_key(clean_redis.url, "basic", account="counted")
    results = await asyncio.gather(*(post(gw, BODY, headers={"X-API-Key": key})
                                     for _ in range(30)))
    remaining = sorted(int(h["X-RateLimit-Remaining"]) for _, h, _ in results)
    assert remaining == list(range(20, 50))


async def test_a_refused_request_still_counts_and_429_wins(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    sim = await simulator()
    gw = await gateway(sim, policies={"tiers.toml": tiers(basic=3)})
    key = await new_key(clean_redis.url, "basic", account="sloppy")
    bad = {"model": MODEL, "messages": "not a list"}
    statuses = [(await post(gw, bad, headers={"X-API-Key": key}))[0] for _ in range(4)]
    assert statuses == [422, 422, 422, 429]  # every identified attempt counts; 429 first
    assert (await post(gw, BODY, headers={"X-API-Key": key}))[0] == 429
    assert await sim_requests(sim) == []


# -- 9: unknown keys, and IPv6 guests --------------------------------------------------------

async def test_unknown_keys_are_cached_and_budgeted_per_address(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    auth = "[clients]\nkey_lookups_per_minute = 5\n"
    gw = await gateway(await simulator(), policies={"auth.toml": auth})
    minted = apikeys.generate("igw", os.urandom(32))  # well formed, checksum right, in no store
    async with key_reads(clean_redis.url) as reads:
        for _ in range(20):
            assert (await post(gw, BODY, headers={"X-API-Key": minted}))[0] == 401
        assert await reads() == 1  # then cached as unknown
        statuses = [(await post(gw, BODY, headers={
            "X-API-Key": apikeys.generate("igw", os.urandom(32))}))[0] for _ in range(8)]
        assert statuses == [401] * 4 + [429] * 4  # 5 reads per minute from this address
        assert await reads() == 5


async def test_a_key_that_exists_is_served_whatever_its_address_sent(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    """A scanner behind a shared address (a NAT, a corporate proxy) spends the address's
    budget of unknown keys; a real key from the same address, never seen by this gateway,
    is still looked up and served (it carries the store's seal)."""
    auth = "[clients]\nkey_lookups_per_minute = 5\n"
    gw = await gateway(await simulator(), policies={"auth.toml": auth})
    statuses = [(await post(gw, BODY, headers={"X-API-Key": apikeys.generate(
        "igw", os.urandom(32))}))[0] for _ in range(10)]
    assert statuses == [401] * 5 + [429] * 5  # the scanner: locked out
    key = await new_key(clean_redis.url, "max", account="behind-the-nat")
    assert (await post(gw, BODY, headers={"X-API-Key": key}))[0] == 200


async def test_ipv6_guests_share_their_64(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    auth = '[clients]\ntrusted_proxies = ["127.0.0.1/32"]\n'
    gw = await gateway(await simulator(),
                       policies={"auth.toml": auth, "tiers.toml": tiers(guest=2)})

    async def as_guest(address: str) -> int:
        return (await post(gw, BODY, headers={"X-Forwarded-For": address}))[0]

    assert await as_guest("2001:db8:1:2::a") == 200
    assert await as_guest("2001:db8:1:2:ffff::b") == 200  # same /64: same bucket
    assert await as_guest("2001:db8:1:2::c") == 429
    assert await as_guest("2001:db8:1:3::a") == 200  # the next /64 is someone else


# -- 15: an empty credential is not a guest ---------------------------------------------------

@pytest.mark.parametrize("value", ["Bearer", "Bearer ", "Bearer    "])
async def test_an_empty_bearer_is_401(value: str, simulator: SimulatorFactory,
                                      gateway: GatewayFactory) -> None:
    sim = await simulator()
    gw = await gateway(sim)
    status, _, raw = await post(gw, BODY, headers={"Authorization": value})
    assert status == 401 and b"invalid_api_key" in raw
    assert await sim_requests(sim) == []


# -- 11: deep JSON is a clear 400, on every chat route, before any credential is needed -------

@pytest.mark.parametrize("path", CHAT_ROUTES)
@pytest.mark.parametrize("depth", [65, 255, 5000])
async def test_deep_json_is_400_not_500(path: str, depth: int, simulator: SimulatorFactory,
                                        gateway: GatewayFactory) -> None:
    gw = await gateway(await simulator())
    nested = b"[" * depth + b"]" * depth
    raw = b'{"model": "' + MODEL.encode() + b'", "messages": ' + nested + b"}"
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(path), data=raw, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400, await r.text()
        if depth < 1000:  # deeper still, the JSON parser itself refuses it
            assert b"nests deeper" in await r.read()


async def test_tools_as_deep_as_allowed_are_priced_without_recursion(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    gw = await gateway(await simulator())
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(28):  # 5 levels of request around it: 61 in all
        schema = {"type": "object", "properties": {"x": schema}}
    tool = {"type": "function", "function": {"name": "deep", "parameters": schema}}
    status, _, _ = await post(gw, {**BODY, "tools": [tool]})
    assert status == 200


# -- 10: a reload asked of one worker reaches every worker -------------------------------------

async def test_admin_reload_reaches_every_worker(
    aiohttp_server: Any, simulator: SimulatorFactory, tmp_path: Path, clean_redis: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "reload-token")
    sim = await simulator()
    folder = write_config(tmp_path, [{"name": "b0", "kind": "vllm",
                                      "url": str(sim.make_url("/")).rstrip("/"),
                                      "models": [MODEL]}],
                          policies={"tiers.toml": tiers(guest=1000)})
    workers: list[TestServer] = [
        await aiohttp_server(build_app(load_config(folder), redis_url=clean_redis.url))
        for _ in range(2)]
    await asyncio.sleep(0.3)  # both subscribed
    (folder / "policies" / "tiers.toml").write_text(tiers(guest=2))
    async with aiohttp.ClientSession() as session, session.post(
            workers[0].make_url("/admin/reload"),
            headers={"Authorization": "Bearer reload-token"}) as response:
        assert response.status == 200
    seen = []
    for _ in range(50):  # the other worker hears it over Redis pub/sub
        seen.append((await post(workers[1], BODY))[0])
        if seen[-1] == 429:
            break
        await asyncio.sleep(0.05)
    assert seen[-1] == 429, seen  # worker 1 now enforces the new 2/min as well
