"""Alerts: a budget crossing 50, 80 and 100 % of its cap and a balance falling under its
threshold are recorded once each, in the step that charged (or refused) them; two gateways
deliver each one to a real receiver that fails the first attempts, signed, retried until it
is accepted, once (the same id on every attempt), and give up on a receiver that never
accepts; the CLI lists each delivery's state. And the signature's scheme on its own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config import AlertsSection
from proxy.credits.alerts import Attempts, event, sign, verify
from proxy.credits.ledger import AccountKeys, InsufficientCredits, Ledger, as_fields
from proxy.credits.webhooks import Sender, Webhooks
from proxy.store.client import connect_redis
from tests.support.accounts import new_key
from tests.support.config_files import GENEROUS_TIERS, MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.redis_servers import RedisProcess
from tests.support.upstreams import SimulatorFactory

ADMIN = {"Authorization": "Bearer admin-token-for-tests"}
CHAT = "/v2/compat/v1/chat/completions"
PRICES = """
version = "alerts-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""  # max_tokens 10: a request holds about as much as it costs (~110 micro-credits)
BODY = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "Hello!"}]}


async def recorded(redis_url: str, account: str) -> list[dict[str, Any]]:
    redis = connect_redis(redis_url)
    try:
        rows = await redis.xrange(AccountKeys.of(account).alerts[0])
        return [event(account, i.decode(), as_fields(f)) for i, f in rows]
    finally:
        await redis.aclose()


def marks(events: list[dict[str, Any]]) -> list[tuple[str, int | None]]:
    return [(e["type"], e["data"].get("percent")) for e in events]


async def test_each_crossing_is_recorded_once_with_what_charged_it(
        clean_redis: RedisProcess) -> None:
    redis = connect_redis(clean_redis.url)
    ledger = Ledger(redis)
    try:
        await ledger.credit("acct-a", 10_000, {"reason": "test"})
        await ledger.set_budget("acct-a", "month", 1000)
        await ledger.set_alert_below("acct-a", 9_500)
        for cost in (400, 200, 250, 150):  # 40 %, 60 %, 85 %, 100 % of the budget
            hold = await ledger.hold("acct-a", cost, 60)
            assert await ledger.settle("acct-a", hold, cost, {}) == cost
        events = await recorded(clean_redis.url, "acct-a")
        assert marks(events) == [("budget.threshold", 50), ("balance.low", None),
                                 ("budget.threshold", 80), ("budget.threshold", 100)]
        budget = events[0]["data"]["budget"]
        assert (budget["scope"], budget["period"], budget["limit"]["micro_credits"],
                budget["spent"]["micro_credits"]) == ("account", "month", 1000, 600)
        assert events[1]["data"]["balance"]["micro_credits"] == 9_400
        assert events[3]["data"]["refused"] is False
        # Refused now (the cap is used up): already alerted at 100 %, so nothing new.
        with pytest.raises(InsufficientCredits):
            await ledger.hold("acct-a", 10, 60)
        # A top-up lifts the balance over the threshold; falling under it again is new.
        await ledger.credit("acct-a", 1_000, {"reason": "top-up"})
        await ledger.set_budget("acct-a", "month", 5000)
        for cost in (500, 600):  # balance 10,000 -> 9,500 -> 8,900: one crossing
            hold = await ledger.hold("acct-a", cost, 60)
            await ledger.settle("acct-a", hold, cost, {})
        events = await recorded(clean_redis.url, "acct-a")
        assert marks(events[4:]) == [("balance.low", None)], marks(events)
        assert events[4]["data"]["balance"]["micro_credits"] == 8_900
        assert await ledger.reconcile(["acct-a"]) == []
    finally:
        await ledger.close()
        await redis.aclose()


async def test_a_cap_refusing_its_first_request_is_the_100_percent_alert(
        clean_redis: RedisProcess) -> None:
    redis = connect_redis(clean_redis.url)
    ledger = Ledger(redis)
    try:
        await ledger.credit("acct-r", 10_000, {"reason": "test"})
        await ledger.set_budget("acct-r", "day", 1000)
        hold = await ledger.hold("acct-r", 300, 60)
        await ledger.settle("acct-r", hold, 300, {})
        for _ in range(3):  # worst cases of 800 no longer fit: one alert, not three
            with pytest.raises(InsufficientCredits):
                await ledger.hold("acct-r", 800, 60)
        events = await recorded(clean_redis.url, "acct-r")
        assert marks(events) == [("budget.threshold", 100)]
        assert events[0]["data"]["refused"] is True
        assert events[0]["data"]["budget"]["spent"]["micro_credits"] == 300
    finally:
        await ledger.close()
        await redis.aclose()


class Receiver:
    """A webhook receiver on loopback: each path refuses the first `fails` attempts of every
    alert with 503 (`fails` -1: all of them), and keeps every attempt."""

    def __init__(self) -> None:
        self.attempts: list[tuple[str, str, str, bytes]] = []  # path, id, signature, body
        self.fails = {"/flaky": 2, "/down": -1, "/other": 0}
        self.seen: Counter[tuple[str, str]] = Counter()

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        alert_id = orjson.loads(body)["id"]
        self.attempts.append((request.path, alert_id, request.headers["Igw-Signature"], body))
        self.seen[request.path, alert_id] += 1
        fails = self.fails[request.path]
        if fails < 0 or self.seen[request.path, alert_id] <= fails:
            return web.Response(status=503)
        return web.Response(status=204)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{name}", self.handle)
        return app


@pytest.mark.timeout(120)
async def test_two_gateways_deliver_each_alert_once_signed_through_a_failing_receiver(
        gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-token-for-tests")
    receiver = Receiver()
    hooks = TestServer(receiver.app())
    await hooks.start_server()
    sim = await simulator(default_completion_tokens=16)
    settings = {"every_s": 0.05, "timeout_s": 5.0, "retry_s": [0.2, 0.2]}  # 3 attempts
    gateways = [await gateway(sim, policies={"prices.toml": PRICES, "tiers.toml": GENEROUS_TIERS},
                              alerts=settings) for _ in range(2)]
    redis = connect_redis(clean_redis.url)
    webhooks = Webhooks(redis)
    try:
        flaky = await webhooks.add(str(hooks.make_url("/flaky")), None)
        down = await webhooks.add(str(hooks.make_url("/down")), None)
        other = await webhooks.add(str(hooks.make_url("/other")), "acct-someone-else")
        key = await new_key(clean_redis.url, "max", account="acct-hooks")
        ledger = Ledger(redis)
        await ledger.credit("acct-hooks", 100_000, {"reason": "test"})
        await ledger.set_budget("acct-hooks", "month", 1000)
        await ledger.set_alert_below("acct-hooks", 99_500)
        statuses = []
        async with aiohttp.ClientSession() as session:
            for n in range(14):  # one after another, over both gateways, into the cap
                async with session.post(gateways[n % 2].make_url(CHAT), json=BODY,
                                        headers={"X-API-Key": key}) as response:
                    statuses.append(response.status)
                await settled(gateways[n % 2])
        assert statuses[0] == 200 and statuses[-1] == 402, statuses
        alerts = await recorded(clean_redis.url, "acct-hooks")
        assert sorted(marks(alerts), key=str) == sorted(
            [("budget.threshold", 50), ("budget.threshold", 80), ("budget.threshold", 100),
             ("balance.low", None)], key=str), marks(alerts)
        ids = {a["id"] for a in alerts}

        async def all_done() -> None:
            due = AccountKeys.of("acct-hooks").alerts[1]
            while True:
                if not await redis.zcard(due) and len(receiver.attempts) >= 6 * len(ids):
                    return
                await asyncio.sleep(0.05)

        await asyncio.wait_for(all_done(), 30)
        await asyncio.sleep(0.5)  # room for a duplicate to show up, if there were one
        by_path: defaultdict[str, Counter[str]] = defaultdict(Counter)
        for path, alert_id, signature, body in receiver.attempts:
            by_path[path][alert_id] += 1
            secret = flaky.secret if path == "/flaky" else down.secret
            assert verify(secret, signature, body), signature
            assert not verify(other.secret, signature, body)
            assert orjson.loads(body)["account"] == "acct-hooks"
        # Every alert: refused twice, then accepted once, by the flaky receiver; tried three
        # times and given up by the one that is down; none sent to another account's.
        assert by_path["/flaky"] == dict.fromkeys(ids, 3), by_path
        assert by_path["/down"] == dict.fromkeys(ids, 3), by_path
        assert "/other" not in by_path
        listed = {a.body["id"]: a for a in await webhooks.alerts("acct-hooks")}
        assert set(listed) == ids
        for alert in listed.values():
            assert alert.deliveries[flaky.id].state == "delivered"
            assert alert.deliveries[flaky.id].attempts == 3
            assert alert.deliveries[down.id].state == "failed"
            assert alert.deliveries[down.id].last == "HTTP 503"
            assert not alert.due

        cli = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "proxy", "webhooks", "alerts", "--account",
                             "acct-hooks", "--config", str(tmp_path / "config")],
            env={**os.environ, "GATEWAY_REDIS_URL": clean_redis.url}, capture_output=True,
            text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.count(f"{flaky.id}: delivered after 3 attempt(s)") == len(ids)
        assert cli.stdout.count(f"{down.id}: failed after 3 attempt(s), last HTTP 503") == \
            len(ids)
        assert "budget.threshold" in cli.stdout and "balance.low" in cli.stdout
        assert flaky.secret not in cli.stdout
        await ledger.close()
    finally:
        await redis.aclose()
        await hooks.close()


def test_the_signature_binds_body_secret_and_time() -> None:
    body = b'{"id":"evt_1"}'
    header = sign("whsec_a", body, now_s=1_000_000)
    assert header.startswith("t=1000000,v1=")
    assert verify("whsec_a", header, body, now_s=1_000_100)
    assert not verify("whsec_b", header, body, now_s=1_000_100)  # another secret
    assert not verify("whsec_a", header, body + b" ", now_s=1_000_100)  # another body
    assert not verify("whsec_a", header, body, now_s=1_000_400)  # too old: a replay
    forged = header.replace("t=1000000", "t=1000350")  # a fresh time on an old signature
    assert not verify("whsec_a", forged, body, now_s=1_000_400)
    assert not verify("whsec_a", "v1=abc", body) and not verify("whsec_a", "", body)


def test_attempts_back_off_then_give_up() -> None:
    attempts = Attempts()
    assert attempts.due(0)
    attempts.record(False, "HTTP 500", 100.0, (10.0, 60.0))
    assert (attempts.state, attempts.next_at) == ("pending", 110.0)
    assert not attempts.due(105.0) and attempts.due(110.0)
    attempts.record(False, "timeout", 110.0, (10.0, 60.0))
    assert attempts.next_at == 170.0
    attempts.record(False, "HTTP 500", 170.0, (10.0, 60.0))
    assert attempts.state == "failed" and not attempts.due(1e12)
    delivered = Attempts()
    delivered.record(True, "HTTP 200", 5.0, (10.0,))
    assert delivered.state == "delivered" and delivered.attempts == 1


async def test_the_admin_api_registers_endpoints_thresholds_and_lists_alerts(
        gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-token-for-tests")
    sim = await simulator(default_completion_tokens=16)
    gw = await gateway(sim, policies={"prices.toml": PRICES, "tiers.toml": GENEROUS_TIERS},
                       alerts={"every_s": 60.0})  # nothing is sent during this test

    async def call(method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, str], Any]:
        async with aiohttp.ClientSession() as s, s.request(
                method, gw.make_url(path), headers=ADMIN, **kwargs) as r:
            return r.status, dict(r.headers), await r.json()

    status, headers, made = await call("POST", "/admin/webhooks",
                                       json={"url": "https://hooks.example.com/igw?t=1"})
    assert status == 201 and headers["Cache-Control"] == "no-store", made
    assert made["secret"].startswith("whsec_") and made["account"] is None
    status, _, listed = await call("GET", "/admin/webhooks")
    assert listed["data"] == [{k: v for k, v in made.items() if k != "secret"}]
    status, _, refused = await call("POST", "/admin/webhooks", json={"url": "ftp://x"})
    assert status == 422 and refused["error"]["type"] == "validation_error"

    key = await new_key(clean_redis.url, "max", account="acct-api")
    await call("POST", "/admin/accounts/acct-api/credits", json={"amount": "0.001"})
    status, _, set_ = await call("POST", "/admin/accounts/acct-api/alerts",
                                 json={"below": "0.0008"})
    assert status == 201 and set_["below"]["micro_credits"] == 800
    async with aiohttp.ClientSession() as s:
        for _ in range(3):  # ~110 micro-credits each: under 800 on the second
            async with s.post(gw.make_url(CHAT), json=BODY, headers={"X-API-Key": key}) as r:
                assert r.status == 200
    await settled(gw)
    status, _, alerts = await call("GET", "/admin/accounts/acct-api/alerts?limit=5")
    assert status == 200 and [a["type"] for a in alerts["data"]] == ["balance.low"], alerts
    assert alerts["data"][0]["data"]["threshold"]["micro_credits"] == 800
    assert alerts["data"][0]["due"] is True and alerts["data"][0]["deliveries"] == {}
    for bad in ("0", "101", "-1", "x", "1.5", "", "²", "٣", "9" * 5000):  # never a 500
        assert (await call("GET", f"/admin/accounts/acct-api/alerts?limit={bad}"))[0] == 422

    status, _, removed = await call("DELETE", f"/admin/webhooks/{made['id']}")
    assert status == 200 and removed["id"] == made["id"]
    assert (await call("DELETE", f"/admin/webhooks/{made['id']}"))[0] == 404
    assert (await call("GET", "/admin/webhooks"))[2]["data"] == []


async def test_an_endpoint_url_the_client_cannot_use_fails_its_deliveries_only(
        clean_redis: RedisProcess) -> None:
    """A URL the admin API accepts but no HTTP client can send to (a control character in its
    host) makes its deliveries fail, recorded as such; the sender carries on."""
    redis = connect_redis(clean_redis.url)
    ledger = Ledger(redis)
    try:
        await ledger.credit("acct-bad", 10_000, {"reason": "test"})
        await ledger.set_budget("acct-bad", "day", 1)
        with pytest.raises(InsufficientCredits):
            await ledger.hold("acct-bad", 100, 60)  # refused: the 100 % alert
        bad = await Webhooks(redis).add("https://\x82\x1f.example/hook", "acct-bad")
        sender = Sender(redis, AlertsSection(retry_s=(0.01,)))
        try:
            assert await sender.round() == 1
            [alert] = await Webhooks(redis).alerts("acct-bad")
            assert alert.deliveries[bad.id].state == "pending"
            assert alert.deliveries[bad.id].last == "InvalidUrlClientError", alert
        finally:
            await sender.close()
    finally:
        await ledger.close()
        await redis.aclose()
