"""Budgets (spend caps that reset) through a real gateway, a real Redis and a vLLM simulator:
concurrent requests never take an account past its cap, the refusal is its own 402 with the
reset, a key's budget binds that key only and never passes its account's, a postpaid account
runs on its budget alone, `/v2/account` and the CLI show them; and the periods' boundaries,
the same in the admission script as in Python."""

from __future__ import annotations

import asyncio
import datetime
import os
import random
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from redis.asyncio import Redis

from proxy.credits.budgets import period_end, period_index
from proxy.credits.ledger import InsufficientCredits, Ledger, lua_script
from tests.support.accounts import new_key
from tests.support.config_files import GENEROUS_TIERS, MODEL
from tests.support.fleet import REPO
from tests.support.gateway import GatewayFactory, settled
from tests.support.redis_servers import RedisProcess
from tests.support.upstreams import SimulatorFactory

ADMIN = {"Authorization": "Bearer admin-token-for-tests"}
CHAT = "/v2/compat/v1/chat/completions"
BODY = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "Hello!"}]}
PRICES = """
version = "budget-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""  # a request holds ~1,030 micro-credits and costs ~200


@pytest.fixture
async def gw(gateway: GatewayFactory, simulator: SimulatorFactory,
             monkeypatch: pytest.MonkeyPatch) -> TestServer:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-token-for-tests")
    sim = await simulator(ttft_ms=200, default_completion_tokens=16)
    return await gateway(sim, policies={"prices.toml": PRICES, "tiers.toml": GENEROUS_TIERS})


async def call(gw: TestServer, method: str, path: str, **kwargs: Any
               ) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.request(method, gw.make_url(path),
                                                       **kwargs) as r:
        return r.status, dict(r.headers), await r.json()


async def budget(gw: TestServer, account: str, **body: Any) -> tuple[int, Any]:
    status, _, answer = await call(gw, "POST", f"/admin/accounts/{account}/budgets",
                                   headers=ADMIN, json=body)
    return status, answer


def next_month(now: datetime.datetime) -> str:
    year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
    return f"{year:04d}-{month:02d}-01T00:00:00Z"


async def test_concurrent_requests_never_pass_a_monthly_budget(
        gw: TestServer, clean_redis: RedisProcess) -> None:
    key = await new_key(clean_redis.url, "max", account="acct-cap")
    await call(gw, "POST", "/admin/accounts/acct-cap/credits", headers=ADMIN,
               json={"amount": "100"})
    status, set_ = await budget(gw, "acct-cap", period="month", amount="0.003")
    assert status == 201 and set_["budgets"][0]["limit"]["micro_credits"] == 3000
    done = await asyncio.gather(*(call(gw, "POST", CHAT, json=BODY, headers={"X-API-Key": key})
                                  for _ in range(12)))
    statuses = sorted(status for status, _, _ in done)
    assert set(statuses) == {200, 402} and statuses.count(200) >= 2, statuses
    reset = next_month(datetime.datetime.now(datetime.UTC))
    for status, headers, answer in done:
        if status == 402:
            assert answer["error"]["type"] == "budget_exceeded"  # not insufficient_credits
            assert "monthly budget" in answer["error"]["message"]
            assert headers["X-Budget-Reset"] == reset
    await settled(gw)
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    try:
        charged = sum(int(e["cost"]) for e in await ledger.all_entries("acct-cap")
                      if e["type"] == "charge")
        assert 0 < charged <= 3000  # never past the cap, however many ran at once
        assert await ledger.reconcile(["acct-cap"]) == []
    finally:
        await ledger.close()
        await redis.aclose()
    status, _, account = await call(gw, "GET", "/v2/account", headers={"X-API-Key": key})
    [view] = account["budgets"]
    assert (view["scope"], view["period"], view["resets_at"]) == ("account", "month", reset)
    assert view["spent"]["micro_credits"] == charged and view["held"]["micro_credits"] == 0
    assert view["remaining"]["micro_credits"] == 3000 - charged


async def test_a_keys_budget_binds_that_key_and_never_passes_its_accounts(
        gw: TestServer, clean_redis: RedisProcess) -> None:
    tight = await new_key(clean_redis.url, "max", account="acct-keys")
    other = await new_key(clean_redis.url, "max", account="acct-keys")
    await call(gw, "POST", "/admin/accounts/acct-keys/credits", headers=ADMIN,
               json={"amount": "100"})
    tight_id = (await call(gw, "GET", "/v2/account", headers={"X-API-Key": tight}))[2]["key_id"]
    assert (await budget(gw, "acct-keys", period="week", amount="1"))[0] == 201
    status, refused = await budget(gw, "acct-keys", period="week", amount="2", key_id=tight_id)
    assert status == 409 and "at most its account's" in refused["error"]["message"]
    status, frozen = await budget(gw, "acct-keys", period="week", amount="0", key_id=tight_id)
    assert status == 201 and {(b["scope"], b["limit"]["micro_credits"])
                              for b in frozen["budgets"]} == {("account", 10**6), ("key", 0)}
    assert (await budget(gw, "acct-keys", period="week", amount="0",
                         key_id="key_000000000000"))[0] == 404
    status, _, answer = await call(gw, "POST", CHAT, json=BODY, headers={"X-API-Key": tight})
    assert status == 402 and answer["error"]["type"] == "budget_exceeded"
    assert f"key {tight_id}'s weekly budget has 0.000000 left" in answer["error"]["message"]
    assert (await call(gw, "POST", CHAT, json=BODY, headers={"X-API-Key": other}))[0] == 200
    # The CLI shows the same budgets.
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "proxy", "accounts", "show", "acct-keys", "--config", str(REPO)],
        env={**os.environ, "GATEWAY_REDIS_URL": clean_redis.url}, capture_output=True,
        text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "budget: account per week 1.000000" in shown.stdout
    assert f"budget: key {tight_id} per week 0.000000" in shown.stdout


async def test_a_postpaid_account_runs_on_its_budget_alone(
        gw: TestServer, clean_redis: RedisProcess) -> None:
    key = await new_key(clean_redis.url, "max", account="acct-post")  # never credited
    assert (await call(gw, "POST", CHAT, json=BODY, headers={"X-API-Key": key}))[0] == 402
    status, set_ = await budget(gw, "acct-post", period="day", amount="0.0025", postpaid=True)
    assert status == 201 and set_["postpaid"] is True
    statuses = [(await call(gw, "POST", CHAT, json=BODY, headers={"X-API-Key": key}))[0]
                for _ in range(15)]
    assert statuses[0] == 200 and statuses[-1] == 402, statuses
    await settled(gw)
    status, _, account = await call(gw, "GET", "/v2/account", headers={"X-API-Key": key})
    assert account["postpaid"] is True
    owed = -account["balance"]["available"]["micro_credits"]
    assert 0 < owed == account["budgets"][0]["spent"]["micro_credits"] <= 2500


def test_budget_cli_sets_and_refuses(clean_redis: RedisProcess) -> None:
    env = {**os.environ, "GATEWAY_REDIS_URL": clean_redis.url}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxy", "credits", "budget", *args,
                               "--config", str(REPO)],
                              env=env, capture_output=True, text=True, timeout=60)

    done = cli("--account", "acct-cli", "--period", "month", "--amount", "25")
    assert done.returncode == 0, done.stderr
    assert "budget: account per month 25.000000  spent 0.000000" in done.stdout
    assert "resets" in done.stdout
    refused = cli("--account", "acct-cli", "--period", "month", "--amount", "30", "--key",
                  "key_0123456789ab")
    assert refused.returncode != 0 and "at most its account's" in refused.stderr
    removed = cli("--account", "acct-cli", "--period", "month")
    assert removed.returncode == 0 and "budget:" not in removed.stdout


async def test_the_admission_script_and_python_agree_on_every_boundary(
        clean_redis: RedisProcess) -> None:
    """A budget resets when its period's number changes: at UTC midnight, Monday 00:00 and
    the first of the month (leap years included), the same in Lua as in Python."""
    redis = Redis.from_url(clean_redis.url)
    probe = redis.register_script(lua_script("periods").split("\n", 4)[-1] + """
local out = {}
for i = 1, #ARGV do
  for _, p in ipairs({'d', 'w', 'm'}) do out[#out + 1] = period_index(p, tonumber(ARGV[i])) end
end
return out""")
    moments = [datetime.datetime(2026, 11, 30, 23, 59, 59), datetime.datetime(2026, 12, 1),
               datetime.datetime(2026, 11, 29, 23, 59, 59),  # a Sunday
               datetime.datetime(2026, 11, 30), datetime.datetime(2028, 2, 29, 12),
               datetime.datetime(2028, 3, 1), datetime.datetime(2026, 12, 31, 23, 59, 59),
               datetime.datetime(2027, 1, 1)]
    stamps = [int(m.replace(tzinfo=datetime.UTC).timestamp()) for m in moments]
    stamps += [random.Random(7).randrange(0, 4_000_000_000) for _ in range(200)]
    try:
        got = [int(v) for v in await probe(args=stamps)]
    finally:
        await redis.aclose()
    expected = [period_index(code, s) for s in stamps for code in "dwm"]
    assert got == expected
    # Midnight, Monday and the first of the month each begin a new number.
    assert period_index("m", stamps[1]) == period_index("m", stamps[0]) + 1
    assert period_index("w", stamps[3]) == period_index("w", stamps[2]) + 1
    assert period_end("w", period_index("w", stamps[2])).weekday() == 0  # a Monday
    assert period_end("m", period_index("m", stamps[4])) == datetime.datetime(
        2028, 3, 1, tzinfo=datetime.UTC)
    assert period_end("d", period_index("d", stamps[6])) == datetime.datetime(
        2027, 1, 1, tzinfo=datetime.UTC)


async def test_an_expired_hold_stops_counting_against_its_budget(
        clean_redis: RedisProcess) -> None:
    """A crashed worker's hold, swept when it expires, gives its budget room back; and holds
    forgotten with a Redis restart (soft state) take their budget holds with them."""
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    try:
        await ledger.credit("acct-sweep", 10**6, {})
        await ledger.set_budget("acct-sweep", "day", 500)
        await ledger.hold("acct-sweep", 400, ttl_s=1)
        with pytest.raises(InsufficientCredits):  # the budget's room is held
            await ledger.hold("acct-sweep", 200, ttl_s=60)
        await asyncio.sleep(2.1)
        assert await ledger.sweep() == 1
        _, spent, held = await ledger.budgets("acct-sweep")
        assert set(held.values()) <= {"0"} and spent == {}, held
        await ledger.hold("acct-sweep", 450, ttl_s=60)  # room again
        assert await ledger.reconcile(["acct-sweep"]) == []
    finally:
        await ledger.close()
        await redis.aclose()


async def test_a_free_request_under_a_budget_settles(clean_redis: RedisProcess) -> None:
    """A hold of nothing (a model priced at 0) counted against a budget: ending it gives the
    budget back 0, which Lua writes as "-0" unless told otherwise, and Redis refuses "-0" as
    an integer: the settlement failed on every retry, then the sweep (seen in a schemathesis
    run)."""
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    try:
        await ledger.credit("acct-free", 1000, {})
        await ledger.set_budget("acct-free", "month", 500)
        hold = await ledger.hold("acct-free", 0, ttl_s=60)
        assert await ledger.settle("acct-free", hold, 0, {}) == 0
        await ledger.hold("acct-free", 0, ttl_s=1)
        await asyncio.sleep(2.1)
        assert await ledger.sweep() == 1
        assert await ledger.reconcile(["acct-free"]) == []
    finally:
        await ledger.close()
        await redis.aclose()
