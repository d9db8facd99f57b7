"""Credits: prices, holds, settlement on every exit path, journal, account API, top-ups."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from proxy.config import Rates
from proxy.credits.ledger import AccountKeys, InsufficientCredits, Ledger
from proxy.credits.pricing import (
    ChatUsage,
    chat_cost,
    chat_hold,
    format_credits,
    parse_credits,
    prompt_upper_bound,
)
from proxy.store.redis_process import RedisProcess
from proxy.styles.wire import carries_tokens
from tests.support.accounts import new_key
from tests.support.chat import CHAT, HELLO, post, sse_payloads
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

# 1 micro-credit per prompt token, 10 per completion token: easy to check by hand.
PRICES = f"""
version = "test-v1"
default_max_tokens = 100
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
[models."{MODEL}"]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""
RATES = Rates(prompt_per_1k_tokens=1000, completion_per_1k_tokens=10000)


# -- pricing arithmetic (pure) -------------------------------------------------------------------

def test_cost_is_exact_integer_rounded_up_once() -> None:
    rates = Rates(prompt_per_1k_tokens=1, completion_per_1k_tokens=3)
    assert chat_cost(rates, ChatUsage(0, 0)) == 0
    assert chat_cost(rates, ChatUsage(1, 0)) == 1  # 0.001 micro rounds up to 1
    assert chat_cost(rates, ChatUsage(1000, 0)) == 1
    assert chat_cost(rates, ChatUsage(1001, 0)) == 2
    assert chat_cost(rates, ChatUsage(500, 500)) == 2  # (500 + 1500) / 1000, once per request
    assert chat_cost(RATES, ChatUsage(21, 16)) == 21 + 160


def test_hold_covers_the_worst_case() -> None:
    body = {"messages": [{"role": "user", "content": "héllo wörld"}], "n": 2}
    bound = prompt_upper_bound(body)
    assert bound >= len("héllo wörld".encode())
    assert chat_hold(RATES, body, 50) == chat_cost(RATES, ChatUsage(bound, 100))


def test_credit_amounts_parse_exactly() -> None:
    assert parse_credits("12.5") == 12_500_000
    assert parse_credits("0.000001") == 1
    assert parse_credits("-3") == -3_000_000
    for bad in ("1.0000001", "abc", "nan", "inf", ""):
        with pytest.raises(ValueError):
            parse_credits(bad)
    assert format_credits(12_500_000) == "12.500000" and format_credits(-1) == "-0.000001"


# -- the ledger against a real redis-server ------------------------------------------------------

@pytest.fixture
async def ledger(clean_redis: RedisProcess) -> Any:
    redis = Redis.from_url(clean_redis.url)
    yield Ledger(redis)
    await redis.aclose()


async def test_hold_settle_release_exactly_once(ledger: Ledger) -> None:
    await ledger.credit("acme", 1000, {"reason": "test"})
    hold = await ledger.hold("acme", 400, ttl_s=60)
    assert (await ledger.balance("acme")).available == 600
    with pytest.raises(InsufficientCredits):
        await ledger.hold("acme", 601, ttl_s=60)
    assert await ledger.settle("acme", hold, 999, {"status": "completed"}) == 400  # capped
    assert await ledger.settle("acme", hold, 10, {"status": "completed"}) is None  # once only
    released = await ledger.hold("acme", 100, ttl_s=60)
    assert await ledger.settle("acme", released, 0, {"status": "upstream_error"}) == 0
    balance = await ledger.balance("acme")
    assert (balance.available, balance.held, balance.spent) == (600, 0, 400)
    assert await ledger.reconcile() == []


async def test_admission_script_refusals_change_nothing(ledger: Ledger) -> None:
    """admit.lua claims the hold and takes the amount before it knows the balance covers it;
    a refusal must give both back (and a hold id seen before must not be held twice)."""
    await ledger.credit("acme", 1000, {})
    keys = AccountKeys.of("acme")

    async def admit(hold_id: str, amount: int) -> list[int]:
        admit_keys = [keys.window("none"), keys.reservation(hold_id), keys.balance,
                      keys.holds, keys.hold_expiry, *keys.budgets, *keys.alerts]
        return [int(v) for v in (await ledger.admit_script(
            keys=admit_keys, args=[0, 0, hold_id, amount, 60, "", 0, 0, ""]))[:4]]

    assert await admit("h1", 300) == [1, -1, 0, 700]
    assert await admit("h1", 300) == [3, -1, 0, 0]  # the same id again: not held twice
    assert await admit("h2", 701) == [2, -1, 0, 700]  # short: refused, with what is there
    balance = await ledger.balance("acme")
    assert (balance.available, balance.held) == (700, 300)
    assert list(await ledger.open_holds("acme")) == ["h1"]
    assert await ledger.reconcile() == []
    # An account that was never credited is refused alike, and left with nothing held.
    with pytest.raises(InsufficientCredits) as refused:
        await ledger.hold("nobody", 1, ttl_s=60)
    assert refused.value.available == 0
    assert await ledger.open_holds("nobody") == {}
    nobody = await ledger.balance("nobody")
    assert (nobody.available, nobody.held, nobody.spent) == (0, 0, 0)


async def test_expired_holds_are_swept(ledger: Ledger) -> None:
    await ledger.credit("acme", 100, {})
    # Expiries are whole seconds of Redis' clock (now's second + ttl): a 1 s hold made late in
    # a second was once due at the sweep right after it. 2 s is due no sooner than 1 s on.
    hold = await ledger.hold("acme", 60, ttl_s=2)
    assert await ledger.sweep() == 0  # not yet due (on Redis' clock)
    assert await ledger.reconcile() == []  # open but not overdue: not a problem
    await asyncio.sleep(3.1)
    assert any("past their expiry" in p for p in await ledger.reconcile())  # a lost settlement
    assert await ledger.sweep() == 1
    assert (await ledger.balance("acme")).available == 100
    # A late settle of a swept hold charges nothing: never twice.
    assert await ledger.settle("acme", hold, 60, {}) is None
    assert await ledger.reconcile() == []


async def test_negative_adjustment_never_below_zero(ledger: Ledger) -> None:
    await ledger.credit("acme", 100, {})
    with pytest.raises(InsufficientCredits):
        await ledger.credit("acme", -101, {})
    assert await ledger.credit("acme", -100, {}) == 0


@settings(max_examples=40, deadline=None)
@given(held=st.integers(0, 10**9), used=st.integers(0, 10**9))
def test_any_usage_up_to_the_hold_settles_exactly(redis_server: RedisProcess, held: int,
                                                  used: int) -> None:
    async def run() -> None:
        redis = Redis.from_url(redis_server.url)
        ledger = Ledger(redis)
        account = f"prop-{held}-{used}"
        try:
            await ledger.credit(account, held, {})
            hold = await ledger.hold(account, held, ttl_s=60)
            charged = await ledger.settle(account, hold, used, {})
            balance = await ledger.balance(account)
            assert charged == min(used, held)
            assert (balance.available, balance.held, balance.spent) == (held - charged, 0, charged)
            assert await ledger.reconcile([account]) == []
        finally:
            await redis.aclose()

    asyncio.run(run())


# -- through the gateway -------------------------------------------------------------------------

async def funded(gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
                 credits: int, **options: Any) -> tuple[Any, Any, str, Ledger, Redis]:
    sim = await simulator(**options)
    gw = await gateway(sim, policies={"prices.toml": PRICES})
    key = await new_key(clean_redis.url, "max", account="acme")
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    await ledger.credit("acme", credits, {"reason": "test"})
    return sim, gw, key, ledger, redis


async def charges(ledger: Ledger, account: str = "acme") -> list[dict[str, Any]]:
    """Terminal entries of requests that ran (an idempotent replay releases its hold unused)."""
    entries = [e for e in await ledger.all_entries(account) if e["type"] == "charge"]
    assert all(e["cost"] == 0 for e in entries if e["status"] == "replayed")
    return [e for e in entries if e["status"] != "replayed"]


async def test_charge_matches_the_price_of_reported_usage(
    gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess
) -> None:
    _, gw, key, ledger, redis = await funded(gateway, simulator, clean_redis, 100_000)
    try:
        status, _, raw = await post(gw, {"model": MODEL, "messages": HELLO},
                                    headers={"X-API-Key": key})
        usage = orjson.loads(raw)["usage"]
        assert status == 200
        await settled(gw)
        cost = usage["prompt_tokens"] * 1 + usage["completion_tokens"] * 10
        balance = await ledger.balance("acme")
        assert (balance.spent, balance.held, balance.available) == (cost, 0, 100_000 - cost)
        [entry] = await charges(ledger)
        assert entry["status"] == "completed" and entry["cost"] == cost
        assert entry["price_version"] == "test-v1" and entry["model"] == MODEL
        assert entry["key_id"].startswith("key_") and entry["route"] == "openai"
        assert entry["prompt_tokens"] == usage["prompt_tokens"]
    finally:
        await redis.aclose()


async def test_short_balance_is_402_and_nothing_runs(
    gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess
) -> None:
    sim, gw, key, _ledger, redis = await funded(gateway, simulator, clean_redis, 500)
    try:
        # Worst case: prompt bound + 100 default completion tokens x 10 > 500 micro-credits.
        status, _, raw = await post(gw, {"model": MODEL, "messages": HELLO},
                                    headers={"X-API-Key": key})
        body = orjson.loads(raw)
        assert status == 402 and body["error"]["type"] == "insufficient_credits"
        assert "0.000500 are available" in body["error"]["message"]
        async with aiohttp.ClientSession() as session, session.get(
                sim.make_url("/_sim/stats")) as response:
            assert (await response.json())["total"] == 0
        # A smaller cap fits the balance.
        status, _, _ = await post(gw, {"model": MODEL, "messages": HELLO, "max_tokens": 20},
                                  headers={"X-API-Key": key})
        assert status == 200
    finally:
        await redis.aclose()


@pytest.mark.parametrize(("headers", "stream", "status", "charged"), [
    ({}, True, "completed", "usage"),
    ({"x-sim-status": "500"}, False, "upstream_error", "nothing"),
    ({"x-sim-status": "503"}, True, "upstream_error", "nothing"),
    ({"x-sim-cut-after": "4"}, True, "cut", "delivered"),
    ({"x-sim-error-after": "4"}, True, "failed", "delivered"),
    ({"x-sim-hang-after": "4"}, True, "timeout", "delivered"),
])
async def test_every_exit_path_ends_the_hold_once(
    gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
    headers: dict[str, str], stream: bool, status: str, charged: str,
) -> None:
    sim = await simulator()
    gw = await gateway(sim, policies={"prices.toml": PRICES}, upstream={"idle_timeout_s": 0.5})
    key = await new_key(clean_redis.url, "max", account="acme")
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    try:
        await ledger.credit("acme", 100_000, {})
        code, _, raw = await post(gw, {"model": MODEL, "messages": HELLO, "stream": stream},
                                  headers={"X-API-Key": key, **headers})
        await settled(gw)
        [entry] = await charges(ledger)
        balance = await ledger.balance("acme")
        assert entry["status"] == status and balance.held == 0
        cost = entry["cost"]
        if charged == "nothing":
            assert cost == 0 and code >= 500
        elif charged == "usage":
            assert entry["estimated"] is False and entry["completion_tokens"] == 16
        else:  # delivered: an estimate from the content chunks that reached the client
            delivered = [p for p in sse_payloads(raw) if carries_tokens(p)]
            assert entry["estimated"] is True
            assert entry["completion_tokens"] == len(delivered) > 0 and cost > 0
        assert balance.spent == cost
    finally:
        await redis.aclose()


async def test_client_disconnect_settles_what_was_delivered(
    gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess
) -> None:
    _, gw, key, ledger, redis = await funded(gateway, simulator, clean_redis, 100_000,
                                             tokens_per_s=20)
    try:
        async with aiohttp.ClientSession() as session:
            response = await session.post(gw.make_url(CHAT), headers={"X-API-Key": key}, json={
                "model": MODEL, "messages": HELLO, "stream": True})
            for _ in range(6):
                await response.content.readline()
            response.close()
        for _ in range(50):
            found = await charges(ledger)
            if found:
                break
            await asyncio.sleep(0.05)
        [entry] = found
        assert entry["status"] == "client_gone" and entry["estimated"] is True
        assert (await ledger.balance("acme")).held == 0
    finally:
        await redis.aclose()


async def test_guests_are_journaled_not_charged(
    gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess
) -> None:
    gw = await gateway(await simulator(), policies={"prices.toml": PRICES})
    assert (await post(gw, {"model": MODEL, "messages": HELLO}))[0] == 200
    await settled(gw)
    redis = Redis.from_url(clean_redis.url)
    try:
        [entry] = await Ledger(redis).all_entries("guest:127.0.0.1")
        assert entry["type"] == "usage" and entry["cost"] == 0 and entry["status"] == "completed"
        assert entry["price"] > 0  # what it would have cost
    finally:
        await redis.aclose()


async def test_account_api_and_admin_top_up(
    gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-token-for-tests")
    _, gw, key, _ledger, redis = await funded(gateway, simulator, clean_redis, 0)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(gw.make_url("/admin/accounts/acme/credits"),
                                    json={"amount": "0.5", "reason": "welcome"},
                                    headers={"Authorization": "Bearer admin-token-for-tests"}
                                    ) as response:
                assert response.status == 201
                assert (await response.json())["available"]["micro_credits"] == 500_000
            async with session.post(gw.make_url("/admin/accounts/acme/credits"),
                                    json={"amount": 0.5}) as response:
                assert response.status == 401
            for _ in range(3):
                assert (await post(gw, {"model": MODEL, "messages": HELLO},
                                   headers={"X-API-Key": key}))[0] == 200
            await settled(gw)
            async with session.get(gw.make_url("/v2/account"),
                                   headers={"X-API-Key": key}) as response:
                account = await response.json()
            async with session.get(gw.make_url("/v2/account/usage?limit=2"),
                                   headers={"Authorization": f"Bearer {key}"}) as response:
                usage = await response.json()
            async with session.get(gw.make_url("/v2/account")) as response:
                assert response.status == 401  # guests have no account
    finally:
        await redis.aclose()
    spent = account["balance"]["spent"]["micro_credits"]
    assert account["tier"] == "max" and account["account"] == "acme"
    assert account["balance"]["available"]["micro_credits"] == 500_000 - spent
    assert account["rate_limit"]["remaining"] < account["rate_limit"]["limit"]
    assert usage["totals"]["requests"] == 3 and usage["totals"]["cost"]["micro_credits"] == spent
    assert list(usage["by_model"]) == [MODEL] and len(usage["by_day"]) == 1
    assert len(usage["entries"]) == 2 and usage["next_before"]


async def test_idempotency_key_replays_with_one_charge(
    gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess
) -> None:
    _sim, gw, key, ledger, redis = await funded(gateway, simulator, clean_redis, 100_000,
                                               tokens_per_s=50)
    try:
        body = {"model": MODEL, "messages": HELLO}
        first = await post(gw, body, headers={"X-API-Key": key, "Idempotency-Key": "order-1"})
        again = await post(gw, body, headers={"X-API-Key": key, "Idempotency-Key": "order-1"})
        assert first[0] == again[0] == 200 and first[2] == again[2]
        assert again[1].get("Idempotent-Replayed") == "true"
        await settled(gw)
        assert len(await charges(ledger)) == 1

        other = await post(gw, {**body, "seed": 3},
                           headers={"X-API-Key": key, "Idempotency-Key": "order-1"})
        assert other[0] == 422 and orjson.loads(other[2])["detail"][0]["loc"] == [
            "header", "Idempotency-Key"]

        # Two at once: a quick first is waited for and replayed; a slow one makes the duplicate
        # a 409 (retry later). Never charged twice.
        both = await asyncio.gather(*(post(gw, body, headers={
            "X-API-Key": key, "Idempotency-Key": "order-2"}) for _ in range(2)))
        assert [s for s, _, _ in both] == [200, 200] and both[0][2] == both[1][2]
        slow = await asyncio.gather(*(post(gw, body, headers={
            "X-API-Key": key, "Idempotency-Key": "order-5", "x-sim-delay-ms": "2500"})
            for _ in range(2)))
        assert sorted(status for status, _, _ in slow) == [200, 409]
        await settled(gw)
        assert len(await charges(ledger)) == 3

        # Streams replay the same bytes.
        stream = {**body, "stream": True}
        s1 = await post(gw, stream, headers={"X-API-Key": key, "Idempotency-Key": "order-3"})
        s2 = await post(gw, stream, headers={"X-API-Key": key, "Idempotency-Key": "order-3"})
        assert s1[2] == s2[2] and s2[2].endswith(b"data: [DONE]\n\n")
        await settled(gw)
        assert len(await charges(ledger)) == 4

        # A failed first attempt gives the key back: the retry runs for real.
        failed = await post(gw, body, headers={"X-API-Key": key, "Idempotency-Key": "order-4",
                                               "x-sim-status": "503"})
        retried = await post(gw, body, headers={"X-API-Key": key, "Idempotency-Key": "order-4"})
        assert failed[0] == 503 and retried[0] == 200 and "Idempotent-Replayed" not in retried[1]
    finally:
        await redis.aclose()


async def test_idempotency_key_is_given_back_when_the_hold_fails(
    gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess
) -> None:
    _, gw, key, ledger, redis = await funded(gateway, simulator, clean_redis, 0)
    try:
        headers = {"X-API-Key": key, "Idempotency-Key": "after-top-up"}
        body = {"model": MODEL, "messages": HELLO}
        assert (await post(gw, body, headers=headers))[0] == 402
        await ledger.credit("acme", 100_000, {})
        assert (await post(gw, body, headers=headers))[0] == 200
        await settled(gw)
    finally:
        await redis.aclose()
