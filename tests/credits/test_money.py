"""Money promises the attack run broke (issue 9 items 1-6): the upstream always gets the cap the
hold assumed, a 502 is never charged, a cancelled request leaves no hold or claim behind, holds
outlive every request, journals are bounded, and a lost settlement is retried and visible."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from proxy.api.account import summarize
from proxy.config import ConfigError, load_config
from proxy.credits.ledger import AccountKeys, Ledger, lua_script, settle_call
from proxy.credits.settler import Settler
from proxy.observe.metrics import Labels, Metrics
from proxy.store.redis_process import RedisProcess
from proxy.store.script_pipe import REPLY_TIMEOUT_S
from tests.support.accounts import funded_key, journal
from tests.support.chat import HELLO
from tests.support.config_files import MODEL, write_config
from tests.support.gateway import GatewayFactory, settled
from tests.support.processes import free_port
from tests.support.upstreams import SimulatorFactory, sim_requests

PRICES = """
version = "money-v1"
default_max_tokens = 100
journal_max_entries = 100
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""

ROUTES = {
    "compat": ("/v2/compat/v1/chat/completions", {"model": MODEL, "messages": HELLO}),
    "served": ("/v2/served/v1/chat/completions", {"model": MODEL, "messages": HELLO}),
    "native": ("/v2/native/api/chat", {"model": MODEL, "messages": HELLO, "stream": False}),
}


async def call(server: TestServer, path: str, body: Any, headers: dict[str, str]
               ) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            server.make_url(path), json=body, headers=headers) as response:
        return response.status, await response.read()


# -- 1: the cap the hold assumed always goes upstream ---------------------------------------------

@pytest.mark.parametrize("kind", ["vllm", "tgi"])
@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_a_request_without_a_cap_is_capped_at_what_it_held(
    kind: str, route: str, simulator: SimulatorFactory, gateway: GatewayFactory,
    clean_redis: RedisProcess,
) -> None:
    sim = await simulator(kind)
    gw = await gateway(sim, kind=kind, policies={"prices.toml": PRICES})
    key = await funded_key(clean_redis.url)
    path, body = ROUTES[route]
    # The model would write 500 tokens; nothing in the request caps it.
    status, _ = await call(gw, path, body, {"X-API-Key": key, "x-sim-tokens": "500"})
    assert status == 200
    await settled(gw)
    [sent] = [r["body"] for r in await sim_requests(sim)]
    assert sent["max_tokens"] == 100  # prices.toml default_max_tokens: what was held
    [charge] = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    assert charge["completion_tokens"] == 100 and charge["cost"] <= charge["held"]
    assert charge["cost"] == charge["prompt_tokens"] * 1 + 100 * 10


async def test_openai_backends_get_max_completion_tokens(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim, kind="openai", policies={"prices.toml": PRICES})
    key = await funded_key(clean_redis.url)
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 30}
    assert (await call(gw, ROUTES["compat"][0], body, {"X-API-Key": key}))[0] == 200
    [sent] = [r["body"] for r in await sim_requests(sim)]
    assert sent["max_completion_tokens"] == 30 and "max_tokens" not in sent


# -- 2: an answer the style cannot render is a 502, and a 502 is never charged ------------------

async def test_an_unrenderable_answer_is_502_and_free(
    aiohttp_server: Any, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    async def completions(request: web.Request) -> web.Response:
        # Tool-call arguments that are not JSON: common model output, unusable for Ollama.
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "f", "arguments": "{not json"}}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    upstream = await aiohttp_server(app)
    gw = await gateway({"name": "odd", "kind": "openai", "url": str(upstream.make_url("/")),
                        "models": [MODEL]}, policies={"prices.toml": PRICES})
    key = await funded_key(clean_redis.url)
    status, raw = await call(gw, ROUTES["native"][0], ROUTES["native"][1], {"X-API-Key": key})
    assert status == 502 and b"tool-call arguments" in raw
    await settled(gw)
    [charge] = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    assert charge["cost"] == 0 and charge["status"] == "upstream_error"


# -- 3: a client that leaves while the hold or the claim is being made ---------------------------

async def leave_while_redis_stalls(redis: Redis, gw: TestServer, headers: dict[str, str]
                                   ) -> None:
    """Redis stalls 1.5 s; a chat request is sent meanwhile and its client gives up at 0.5 s
    (by then its script is on its way to the stalled Redis, even on a loaded machine: with
    0.6 and 0.2 s, the gateway once had not sent it yet when the client left)."""
    stall = asyncio.create_task(redis.execute_command("DEBUG", "SLEEP", "1.5"))
    await asyncio.sleep(0.05)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
        with pytest.raises(TimeoutError):
            await session.post(gw.make_url(ROUTES["compat"][0]), json=ROUTES["compat"][1],
                               headers=headers)
    await stall


async def test_leaving_during_the_hold_leaves_no_hold(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    sim = await simulator()
    gw = await gateway(sim, policies={"prices.toml": PRICES})
    key = await funded_key(clean_redis.url)
    assert (await call(gw, *ROUTES["compat"], {"X-API-Key": key}))[0] == 200  # key now cached
    redis = Redis.from_url(clean_redis.url)
    try:
        # Redis stalls: the admission script is in flight when the client gives up.
        await leave_while_redis_stalls(redis, gw, {"X-API-Key": key})
        await settled(gw)
        ledger = Ledger(redis)
        assert await ledger.open_holds("acme") == {}
        assert (await ledger.balance("acme")).held == 0
        # The hold was placed after the client had gone, and ended with nothing charged.
        _, gone = [e for e in await ledger.all_entries("acme") if e["type"] == "charge"]
        assert gone["status"] == "client_gone" and gone["cost"] == 0
        assert len(await sim_requests(sim)) == 1  # only the first request ever ran
    finally:
        await redis.aclose()


async def test_leaving_during_the_claim_leaves_a_short_lived_claim(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    gw = await gateway(await simulator(), policies={"prices.toml": PRICES},
                       upstream={"first_byte_timeout_s": 5, "max_stream_s": 20,
                                 "connect_timeout_s": 1})
    key = await funded_key(clean_redis.url)
    assert (await call(gw, *ROUTES["compat"], {"X-API-Key": key}))[0] == 200  # key now cached
    redis = Redis.from_url(clean_redis.url)
    try:
        await leave_while_redis_stalls(redis, gw, {"X-API-Key": key, "Idempotency-Key": "k1"})
        await settled(gw)
        claims = [k async for k in redis.scan_iter("igw:{acme}:idem:*")]
        assert claims  # made after the client had gone
        for claim in claims:  # pending for about a request's life (2 x (1 + 5) + 20 + 60 s)
            assert 0 < await redis.ttl(claim) <= 92
        assert await Ledger(redis).open_holds("acme") == {}
    finally:
        await redis.aclose()


async def test_a_result_too_large_to_keep_is_not_run_again(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One run, one charge: an answer too large to replay keeps the key as completed, and a
    retry is told so (409) rather than run and charged again."""
    from proxy.credits import idempotency

    monkeypatch.setattr(idempotency, "INLINE_BYTES", 10)
    monkeypatch.setattr(idempotency, "MAX_STORED_BYTES", 20)
    sim = await simulator()
    gw = await gateway(sim, policies={"prices.toml": PRICES})
    key = await funded_key(clean_redis.url)
    headers = {"X-API-Key": key, "Idempotency-Key": "big"}
    assert (await call(gw, *ROUTES["compat"], headers))[0] == 200
    await settled(gw)
    status, raw = await call(gw, *ROUTES["compat"], headers)
    assert status == 409 and b"too large to keep" in raw
    assert len(await sim_requests(sim)) == 1  # the retry never ran
    assert len([e for e in await journal(clean_redis.url) if e["type"] == "charge"]) == 1


# -- 4: no hold expires under a live request ----------------------------------------------------

def test_check_config_refuses_a_hold_shorter_than_a_request(tmp_path: Any) -> None:
    folder = write_config(tmp_path, [], upstream={"first_byte_timeout_s": 300,
                                                  "max_stream_s": 3000},
                          policies={"prices.toml": "hold_ttl_s = 3600\n"})
    with pytest.raises(ConfigError) as info:
        load_config(folder)
    assert any("hold_ttl_s" in p for p in info.value.problems)


async def test_a_stream_is_ended_before_its_hold_could_expire(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    sim = await simulator(tokens_per_s=20)
    gw = await gateway(sim, policies={"prices.toml": PRICES}, upstream={"max_stream_s": 0.5})
    key = await funded_key(clean_redis.url)
    body = {**ROUTES["compat"][1], "stream": True, "max_tokens": 100}
    status, raw = await call(gw, ROUTES["compat"][0], body,
                             {"X-API-Key": key, "x-sim-tokens": "100"})
    assert status == 200 and b"longer than this gateway allows" in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    await settled(gw)
    [charge] = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    assert charge["status"] == "timeout" and 0 < charge["completion_tokens"] < 100


async def test_hold_expiry_is_on_redis_clock(clean_redis: RedisProcess) -> None:
    redis = Redis.from_url(clean_redis.url)
    try:
        ledger = Ledger(redis)
        await ledger.credit("acme", 100, {})
        hold = await ledger.hold("acme", 10, ttl_s=600)
        now = int((await redis.time())[0])
        assert now + 599 <= (await ledger.open_holds("acme"))[hold] <= now + 601
    finally:
        await redis.aclose()


# -- 5: bounded journals, running totals, and a usage route that counts ---------------------------

async def test_account_journal_is_trimmed_and_still_reconciles(clean_redis: RedisProcess) -> None:
    redis = Redis.from_url(clean_redis.url)
    try:
        ledger = Ledger(redis)
        await ledger.credit("acme", 10**6, {"reason": "start"})
        for _ in range(250):
            hold = await ledger.hold("acme", 10, ttl_s=60)
            await ledger.settle("acme", hold, 7, {}, keep=100)
        assert await redis.xlen(AccountKeys.of("acme").journal) <= 200
        assert (await ledger.balance("acme")).spent == 250 * 7
        assert await ledger.reconcile(["acme"]) == []
    finally:
        await redis.aclose()


async def test_guest_journals_are_bounded_and_expire(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    prices = "guest_journal_max_entries = 10\nguest_journal_ttl_s = 600\n" + PRICES
    gw = await gateway(await simulator(), policies={"prices.toml": prices})
    for _ in range(30):
        assert (await call(gw, *ROUTES["compat"], {}))[0] == 200
    await settled(gw)
    redis = Redis.from_url(clean_redis.url)
    try:
        journal_key = AccountKeys.of("guest:127.0.0.1").journal
        assert await redis.xlen(journal_key) < 30  # approximate trim: about the last 10
        assert 0 < await redis.ttl(journal_key) <= 600
    finally:
        await redis.aclose()


async def test_usage_reads_running_totals_pages_and_is_rate_limited(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    tiers = """
[tiers.guest]
requests_per_minute = 100
families = ["chat"]
models = { "*" = ["direct"] }
[tiers.max]
requests_per_minute = 8
families = ["chat"]
models = { "*" = ["direct"] }
"""
    gw = await gateway(await simulator(), policies={"prices.toml": PRICES, "tiers.toml": tiers})
    key = await funded_key(clean_redis.url)
    for _ in range(3):
        assert (await call(gw, *ROUTES["compat"], {"X-API-Key": key}))[0] == 200
    await settled(gw)
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.make_url("/v2/account/usage?limit=2"),
                               headers={"X-API-Key": key}) as response:
            usage = await response.json()
            assert response.headers["X-RateLimit-Remaining"] == "4"  # 3 chats + this one
        statuses = []
        for _ in range(5):
            async with session.get(gw.make_url("/v2/account/usage"),
                                   headers={"X-API-Key": key}) as response:
                statuses.append(response.status)
    assert statuses == [200, 200, 200, 200, 429]
    assert usage["totals"]["requests"] == 3
    assert usage["by_model"][MODEL]["requests"] == 3 and len(usage["by_day"]) == 1
    page = usage["entries"]
    assert len(page) == 2 and usage["next_before"] == page[-1]["id"]
    assert isinstance(page[0]["cost"], int) and isinstance(page[0]["prompt_tokens"], int)
    assert page[0]["estimated"] is False


# -- 6: a settlement that fails is retried; one that is lost shows in reconcile ------------------

async def test_a_failed_settlement_is_retried_until_redis_answers(
    clean_redis: RedisProcess
) -> None:
    admin = Redis.from_url(clean_redis.url)
    redis = Redis.from_url(clean_redis.url, socket_timeout=0.1)
    try:
        ledger = Ledger(redis)
        await ledger.credit("acme", 1000, {})
        hold = await ledger.hold("acme", 100, ttl_s=60)
        metrics = Metrics(Labels((), frozenset, ()), CollectorRegistry())
        settler = Settler(ledger.primaries, [ledger.settle_script], metrics)
        keys, args = settle_call("acme", hold, 40, 100, "completed", MODEL,
                                 {"prompt_tokens": 1, "completion_tokens": 2}, {}, 100, 0)
        # Redis stops answering for longer than the settler waits for a reply.
        await admin.execute_command("CLIENT", "PAUSE", str(int(REPLY_TIMEOUT_S * 1000) + 500))
        settler.settle(ledger.settle_script, keys, args)
        await settler.flush()  # times out, backs off, retries until it lands
        await settler.drain(1)
        assert settler.lost == 0
        # Each failed attempt is an operator-visible Redis error; nothing was lost.
        errors = metrics.registry.get_sample_value("igw_redis_errors_total",
                                                   {"store": "settlement"})
        assert errors is not None and errors >= 1
        assert metrics.registry.get_sample_value("igw_settlements_lost_total") == 0
        balance = await ledger.balance("acme")
        assert (balance.held, balance.spent) == (0, 40)
        assert await ledger.reconcile(["acme"]) == []
    finally:
        await redis.aclose()
        await admin.aclose()


async def test_holds_are_soft_state_and_charges_survive_a_crash(tmp_path: Any) -> None:
    """Holds and windows are not persisted (admission never waits for an fsync); what moved
    money is. After kill -9 and AOF replay the ledger adds up, with the in-flight hold gone."""
    proc = RedisProcess(tmp_path / "redis", port=free_port(), fsync="always")
    proc.start()
    try:
        redis = Redis.from_url(proc.url)
        ledger = Ledger(redis)
        await ledger.credit("acme", 1000, {})
        settled_hold = await ledger.hold("acme", 100, ttl_s=60)
        assert await ledger.settle("acme", settled_hold, 40, {}) == 40
        running = await ledger.hold("acme", 300, ttl_s=60)  # a request running at the crash
        assert (await ledger.balance("acme")).available == 660
        await redis.aclose()
        proc.kill()
        proc.start()  # AOF replay
        redis = Redis.from_url(proc.url)
        ledger = Ledger(redis)
        balance = await ledger.balance("acme")
        assert (balance.available, balance.held, balance.spent) == (960, 0, 40)
        assert await ledger.open_holds("acme") == {}
        assert await ledger.reconcile(["acme"]) == []
        # The running request finishes: its hold is gone, so it is charged from what is
        # available, never more than it held; a retry of that settlement charges nothing.
        keys, args = settle_call("acme", running, 120, 300, "completed", MODEL,
                                 {"prompt_tokens": 1, "completion_tokens": 2}, {}, 100, 0,
                                 run="")  # not through a pipe: the script asks the server
        assert await ledger.settle_script(keys=keys, args=args) == 120
        assert await ledger.settle_script(keys=keys, args=args) == -1
        [entry] = [e for e in await ledger.all_entries("acme") if e.get("hold") == running]
        assert entry["recovered"] == 1 and entry["cost"] == 120
        balance = await ledger.balance("acme")
        assert (balance.available, balance.held, balance.spent) == (840, 0, 160)
        assert await ledger.reconcile(["acme"]) == []
        await redis.aclose()
    finally:
        proc.stop()


async def test_a_retried_top_up_is_applied_once(clean_redis: RedisProcess) -> None:
    """A top-up whose reply was lost is retried by the client library: same operation id."""
    redis = Redis.from_url(clean_redis.url)
    try:
        ledger = Ledger(redis)
        keys = AccountKeys.of("acme")
        call = {"keys": [keys.balance, keys.journal, keys.ended], "args": [500, b"{}", "op-1"]}
        script = redis.register_script(lua_script("credit"))
        assert await script(**call) == [1, 500]
        assert await script(**call) == [1, 500]  # the retry: nothing changes
        assert (await ledger.balance("acme")).credited == 500
        await redis.sadd("igw:ledger:accounts", "acme")
        assert await ledger.reconcile(["acme"]) == []
    finally:
        await redis.aclose()


def test_all_time_totals_are_the_days_sum() -> None:
    """The settle script keeps totals per day and per model only; the all-time figures are the
    days added up (a field of the retired `all|` scope left by an older version is ignored)."""
    totals = {"d|20000|requests": 2, "d|20000|cost": 30, "d|20000|prompt_tokens": 7,
              "d|20001|requests": 1, "d|20001|cost": 12, "d|20001|audio_ms": 1500,
              "m|tiny|requests": 3, "m|tiny|cost": 42, "all|requests": 99}
    view = summarize(totals)
    assert view["totals"]["requests"] == 3 and view["totals"]["prompt_tokens"] == 7
    assert view["totals"]["cost"] == summarize({"d|1|cost": 42})["totals"]["cost"]
    assert view["totals"]["audio_seconds"] == 1.5
    assert list(view["by_day"]) == ["2024-10-04", "2024-10-05"]
    assert view["by_model"]["tiny"]["requests"] == 3
