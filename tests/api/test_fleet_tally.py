"""The console's fleet-wide tally (proxy.observe.fleet_tally) on a real redis-server and a
real Redis Cluster, and GET /admin/overview on a running gateway: what two workers note adds up,
in hour and minute buckets that age out, top lists ordered by amount then account, `top`
checked (422, never a 500), a Redis it cannot reach dropped and counted, and no key, token or
header in the errors it keeps."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from proxy.api.console import read_overview as overview
from proxy.appkeys import TALLY
from proxy.credits.pricing import parse_credits
from proxy.observe.fleet_tally import FleetTally, spend_key
from proxy.observe.metrics import Labels, Metrics
from proxy.observe.trace import Trace
from proxy.store.client import Store, connect_redis
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import funded_key
from tests.support.chat import HELLO
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.processes import free_port
from tests.support.upstreams import SimulatorFactory

ROUTE = "/v2/compat/v1/chat/completions"
NOW = time.time()  # the tallies' clock, fixed; Redis expires their keys by its own
HOUR = 3600.0
TOKEN = "admin-token-for-console-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PRICES = """
version = "console-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def metrics() -> Metrics:
    return Metrics(Labels([MODEL], lambda: {"max"}, ["b0"]), CollectorRegistry())


def answered(account: str | None = None, credits: str | None = None,
             error: str | None = None) -> Trace:
    return Trace(ROUTE, tier="max", account=account, model=MODEL, credits=credits, error=error,
                 charged=parse_credits(credits) if credits else 0)


async def test_two_workers_tallies_add_up_in_buckets_that_age_out(
        redis_or_cluster: Store) -> None:
    """On one Redis and on a Cluster (the tally's keys share one slot there)."""
    store = redis_or_cluster
    clock_a, clock_b = Clock(), Clock()
    a, b = FleetTally(store, metrics(), clock_a), FleetTally(store, metrics(), clock_b)
    for _ in range(3):
        a.note(answered("acct-big", "0.500000"), 200, "req-a")
    b.note(answered("acct-big", "0.250001"), 200, "req-b")
    b.note(answered("acct-small", "0.000350"), 200, "req-c")
    b.note(answered("acct-tie", "0.000350"), 200, "req-d")
    b.note(answered(None, None), 200, "req-guest")  # a guest: no account, nothing charged
    # Refusals: 402, 403, 429 and 503 pool_saturated; a 503 of an outage is not one.
    for status, error in ((429, "rate_limited"), (429, "rate_limited"), (402,
                          "insufficient_credits"), (403, "forbidden"), (503, "pool_saturated")):
        a.note(answered("acct-refused", error=error), status, "req-refused")
    b.note(answered("acct-big", error="rate_limited"), 429, "req-e")
    b.note(answered("acct-outage", error="unavailable"), 503, "req-f")
    # Older buckets: 23 hours ago still counts; 24 hours ago (and 60 minutes) no longer does.
    clock_a.now = NOW - 23 * HOUR
    a.note(answered("acct-old", "1.000000"), 200, "req-old")
    clock_a.now = NOW - 24 * HOUR
    a.note(answered("acct-older", "9.000000"), 200, "req-older")
    a.note(answered("acct-older", error="forbidden"), 403, "req-older")
    await a.flush()
    await b.flush()
    await a.flush()  # nothing more noted: nothing written

    seen = await overview(store, 10, NOW)
    assert seen["window_s"] == 86400
    assert seen["top_spend"] == [
        {"account": "acct-big", "credits": "1.750001", "micro_credits": 1_750_001},
        {"account": "acct-old", "credits": "1.000000", "micro_credits": 1_000_000},
        {"account": "acct-small", "credits": "0.000350", "micro_credits": 350},  # ties: by name
        {"account": "acct-tie", "credits": "0.000350", "micro_credits": 350}]
    assert seen["top_refused"] == [{"account": "acct-refused", "refusals": 5},
                                   {"account": "acct-big", "refusals": 1}]
    top = await overview(store, 1, NOW)
    assert [row["account"] for row in top["top_spend"]] == ["acct-big"]
    assert [row["account"] for row in top["top_refused"]] == ["acct-refused"]

    # Errors: the last hour's by type, most first; the older hour's are not in it.
    errors = seen["errors"]
    assert errors["window_s"] == 3600
    assert errors["by_type"] == {"rate_limited": {"count": 3, "status": 429},
                                 "forbidden": {"count": 1, "status": 403},
                                 "insufficient_credits": {"count": 1, "status": 402},
                                 "pool_saturated": {"count": 1, "status": 503},
                                 "unavailable": {"count": 1, "status": 503}}
    # The last errors, newest first by write: b's (written last), then a's.
    assert [e["request_id"] for e in errors["recent"]] == \
        ["req-f", "req-e", "req-older", *["req-refused"] * 5]
    assert errors["recent"][0] == {"ts": round(NOW, 3), "status": 503, "type": "unavailable",
                                   "route": ROUTE, "model": MODEL, "request_id": "req-f"}
    # Each hour's key ends 25 hours after the hour began.
    ttl = await store.ttl(spend_key(int(NOW // HOUR)))
    assert abs(ttl - ((int(NOW // HOUR) + 25) * HOUR - time.time())) <= 2


async def test_only_the_last_fifty_errors_are_kept(clean_redis: RedisProcess) -> None:
    redis = connect_redis(clean_redis.url)
    try:
        tally = FleetTally(redis, metrics(), Clock())
        for i in range(30):
            tally.note(answered(error="not_found"), 404, f"first-{i}")
        await tally.flush()
        for i in range(40):
            tally.note(answered(error="not_found"), 404, f"second-{i}")
        await tally.flush()
        recent = (await overview(redis, 10, NOW))["errors"]["recent"]
    finally:
        await redis.aclose()
    assert [e["request_id"] for e in recent] == \
        [f"second-{i}" for i in reversed(range(40))] + [f"first-{i}" for i in range(29, 19, -1)]


async def test_a_store_it_cannot_reach_drops_the_writes_and_says_so_once(
        caplog: pytest.LogCaptureFixture) -> None:
    redis = connect_redis(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    counted = metrics()
    tally = FleetTally(redis, counted, Clock())
    try:
        with caplog.at_level(logging.WARNING, logger="proxy"):
            for _ in range(2):
                tally.note(answered("acct", "1.000000", error=None), 200, "r")
                await tally.flush()  # never raises
    finally:
        await redis.aclose()
    assert tally.failed == 2
    assert counted.registry.get_sample_value("igw_redis_errors_total",
                                             {"store": "console tally"}) == 2
    warnings = [r for r in caplog.records if "console's tally" in r.getMessage()]
    assert len(warnings) == 1


# ---- GET /admin/overview on a running gateway -------------------------------------------------

async def call(gw: TestServer, path: str, headers: dict[str, str] | None = None,
               json: Any = None, params: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as session, session.request(
            "POST" if json is not None else "GET", gw.make_url(path), headers=headers,
            json=json, params=params) as response:
        return response.status, await response.json(), response.headers


async def test_overview_counts_the_gateways_answers_and_keeps_no_secret(
        gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    gw = await gateway(await simulator(), policies={"prices.toml": PRICES})
    key = await funded_key(clean_redis.url, account="acct-spends")
    for _ in range(2):
        status, _, _ = await call(gw, ROUTE, {"X-API-Key": key},
                                  {"model": MODEL, "messages": HELLO})
        assert status == 200
    # An async task: charged by the worker that runs it, counted in the spend all the same.
    status, task, _ = await call(gw, ROUTE, {"X-API-Key": key},
                                 {"model": MODEL, "messages": HELLO, "async": True})
    assert status == 202
    for _ in range(200):
        status, record, _ = await call(gw, task["poll_url"], {"X-API-Key": key})
        if record["status"] != "running":
            break
        await asyncio.sleep(0.02)
    assert record["status"] == "completed", record
    secret = "igw_sk_" + "s3cret" * 6
    status, _, headers = await call(gw, ROUTE, {"X-API-Key": secret, "X-Request-Id": "req-401"},
                                    {"model": MODEL, "messages": HELLO})
    assert status == 401 and headers["X-Request-Id"] == "req-401"
    status, _, _ = await call(gw, "/admin/overview", {"Authorization": f"Bearer {TOKEN}x"})
    assert status == 401  # a wrong admin token: refused, and counted like any error
    await settled(gw)
    await gw.app[TALLY].flush()  # rather than wait for the next second's

    status, seen, _ = await call(gw, "/admin/overview?top=5", ADMIN)
    assert status == 200
    _, account, _ = await call(gw, "/v2/account", {"X-API-Key": key})
    spent = account["balance"]["spent"]
    assert seen["top_spend"] == [{"account": "acct-spends", "credits": spent["credits"],
                                  "micro_credits": spent["micro_credits"]}]
    assert spent["micro_credits"] > 0 and seen["top_refused"] == []
    assert seen["errors"]["by_type"] == {"invalid_api_key": {"count": 2, "status": 401}}
    recent = seen["errors"]["recent"]
    assert [e["route"] for e in recent] == ["/admin/overview", ROUTE]
    assert recent[1]["request_id"] == "req-401" and recent[1]["model"] is None
    assert all(set(e) == {"ts", "status", "type", "route", "model", "request_id"}
               for e in recent)
    stored = b"".join(await gw.app[TALLY].redis.lrange("igw:{console}:recent", 0, -1))
    assert secret.encode() not in stored and TOKEN.encode() not in stored
    assert key.encode() not in stored


async def test_a_bad_top_is_the_callers_422(gateway: GatewayFactory, simulator: SimulatorFactory,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    gw = await gateway(await simulator())
    for top in ("0", "101", "-1", "x", "1.5", "", "\u00b2", "\u0663", "9" * 5000):
        status, body, _ = await call(gw, "/admin/overview", ADMIN, params={"top": top})
        assert status == 422, (top, body)
        assert body["error"]["type"] == "validation_error"
        assert body["detail"] == [{"loc": ["query", "top"], "msg": "an integer 1-100",
                                   "type": "int_parsing"}]
        status, body, _ = await call(gw, "/admin/overview", params={"top": top})
        assert status == 401  # credentials first, as on every admin route
    for top in ("1", "100", "007"):
        status, body, _ = await call(gw, "/admin/overview", ADMIN, params={"top": top})
        assert status == 200, (top, body)
