"""Shadow policies (policies/shadow/): a stricter tier and other prices judged on every request
beside the live ones, never enforced; what differs counted in the metrics, written into the
access log and tallied (every worker) for /admin/shadow; reloaded and removed like the live
set."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import Redis

from proxy.appkeys import METRICS, SHADOW
from proxy.config import ConfigError, Policies, TierPolicy, TiersPolicy, load_config
from proxy.credits.ledger import AccountKeys, Ledger
from proxy.credits.shadow_windows import Ask, ShadowWindows
from proxy.credits.token_windows import TokenWindow
from proxy.identity.principal import Principal
from proxy.policy.shadow import (
    ADMITTED,
    Rule,
    Seen,
    Verdict,
    after_limits,
    before_limits,
    differences,
    live_decision,
    rule_for,
)
from proxy.store.client import Store
from tests.support.accounts import new_key
from tests.support.config_files import MODEL, write_config
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

ADMIN = "admin-token-for-the-shadow-tests"
CHAT = "/v2/compat/v1/chat/completions"
HELLO = [{"role": "user", "content": "Say hello."}]
LIVE_TIERS = """
[tiers.guest]
requests_per_minute = 1000
families = ["chat"]
models = { "*" = ["direct"] }

[tiers.basic]
requests_per_minute = 1000
families = ["chat"]
models = { "*" = ["direct"] }
"""
# The candidate: Basic at 2 requests a minute, guests without chat.
SHADOW_TIERS = """
[tiers.guest]
requests_per_minute = 1000
families = ["tts"]
models = { "*" = ["direct"] }

[tiers.basic]
requests_per_minute = 2
families = ["chat"]
models = { "*" = ["direct"] }
"""
PRICES = f"""
version = "test-v1"
default_max_tokens = 100
[models."{MODEL}"]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""
# Twice the live prices.
SHADOW_PRICES = PRICES.replace("= 1000", "= 2000").replace("= 10000", "= 20000")


# ---- the decisions, pure ----------------------------------------------------------------------

def _tier(**fields: Any) -> TierPolicy:
    return TierPolicy(**{"requests_per_minute": 10, "families": ["chat"],
                         "models": {"*": ["direct"]}, **fields})


def _policies(**tiers: TierPolicy) -> Policies:
    return Policies(tiers=TiersPolicy(tiers={"guest": _tier(), **tiers}))


def _seen(**fields: Any) -> Seen:
    return Seen(**{"tier": "basic", "family": "chat", "model": MODEL, "mode": "direct",
                   "asked_tokens": None, "waiting": None, **fields})


def _before(policies: Policies, seen: Seen) -> Verdict | None:
    rule: Rule = rule_for(policies, seen)
    return before_limits(rule, seen)


def test_the_checks_before_the_limits_in_the_gateways_order() -> None:
    policies = _policies(basic=_tier(max_tokens_per_request=100, queue_budget=2))
    assert _before(policies, _seen()) is None
    assert _before(policies, _seen(tier="pro")) == Verdict(
        403, "tier", "tier 'pro' is not in the shadow's tiers.toml")
    refused = _before(policies, _seen(family="tts"))
    assert refused is not None and (refused.decision, refused.reason) == (403, "access")
    assert "speech synthesis" in refused.message
    refused = _before(policies, _seen(mode="network"))
    assert refused is not None and "network mode" in refused.message
    assert _before(policies, _seen(asked_tokens=100)) is None
    refused = _before(policies, _seen(asked_tokens=101))
    assert refused is not None and (refused.decision, refused.reason) == (403, "max_tokens")
    assert _before(policies, _seen(waiting=1.5)) is None
    refused = _before(policies, _seen(waiting=2.0))
    assert refused is not None and (refused.decision, refused.reason) == (503, "queue_budget")
    # access before the cap, the cap before the budget
    assert _before(policies, _seen(family="tts", asked_tokens=500, waiting=9)
                         ).reason == "access"  # type: ignore[union-attr]
    assert _before(policies, _seen(asked_tokens=500, waiting=9)
                         ).reason == "max_tokens"  # type: ignore[union-attr]


def test_the_limits_decide_last_and_a_429_beats_what_came_before() -> None:
    tier = _tier()
    window = TokenWindow("*", "tokens", "minute", 50)
    forbidden = Verdict(403, "access", "no")
    assert after_limits("basic", tier, ADMITTED, None, True, None) == Verdict(ADMITTED)
    assert after_limits("basic", tier, ADMITTED, forbidden, False, None).reason == "rate"
    assert after_limits("basic", tier, ADMITTED, forbidden, True, None) == forbidden
    tokens = after_limits("basic", tier, ADMITTED, None, True, window)
    assert (tokens.decision, tokens.reason) == (429, "tokens")
    assert "50 tokens a minute" in tokens.message
    # credits are the account's: refused live for them, refused by the shadow too
    assert after_limits("basic", tier, 402, None, True, None).decision == 402


@pytest.mark.parametrize(("admitted", "status", "error", "expected"), [
    (True, 200, None, ADMITTED), (True, 502, "upstream_error", ADMITTED),
    (False, 403, "forbidden", 403), (False, 429, "rate_limited", 429),
    (False, 503, "pool_saturated", 503), (False, 402, "insufficient_credits", 402),
    (False, 402, "budget_exceeded", 402),
    (False, 422, "validation_error", None), (False, 503, "service_unavailable", None),
    (False, 400, "invalid_request_error", None), (False, 499, None, None),
])
def test_which_requests_are_judged(admitted: bool, status: int, error: str | None,
                                   expected: int | None) -> None:
    assert live_decision(admitted, status, error) == expected


def test_differences_name_the_settings_that_changed() -> None:
    assert differences(_tier(), _tier()) == []
    assert differences(_tier(), _tier(requests_per_minute=2, queue_budget=3)) == [
        "queue_budget", "requests_per_minute"]
    assert "families" in differences(_tier(), None)


# ---- the folder -------------------------------------------------------------------------------

def test_a_shadow_folder_holds_tiers_and_prices_checked_like_the_live_ones(
        tmp_path: Path) -> None:
    backends = [{"name": "b0", "kind": "vllm", "url": "http://127.0.0.1:9", "models": [MODEL]}]
    folder = write_config(tmp_path / "a", backends, policies={
        "tiers.toml": LIVE_TIERS, "prices.toml": PRICES, "shadow/tiers.toml": SHADOW_TIERS})
    config = load_config(folder)
    assert config.shadow is not None and config.shadow.files == ("tiers.toml",)
    assert config.shadow.policies.tiers.tiers["basic"].requests_per_minute == 2
    assert config.shadow.policies.prices == config.policies.prices  # the live one's
    assert config.policies.tiers.tiers["basic"].requests_per_minute == 1000  # untouched
    first = config.shadow.fingerprint

    (folder / "policies" / "shadow" / "prices.toml").write_text(SHADOW_PRICES)
    config = load_config(folder)
    assert config.shadow is not None and config.shadow.files == ("prices.toml", "tiers.toml")
    assert config.shadow.fingerprint != first

    (folder / "policies" / "shadow" / "requests.toml").write_text("[chat]\n")
    (folder / "policies" / "shadow" / "tiers.toml").write_text(
        SHADOW_TIERS.replace("requests_per_minute = 2", "requests_per_minute = -2"))
    with pytest.raises(ConfigError) as raised:
        load_config(folder)
    problems = raised.value.problems
    assert any(p.startswith("policies/shadow/requests.toml: a shadow set holds only "
                            "tiers.toml and prices.toml") for p in problems), problems
    assert any(p.startswith("policies/shadow/tiers.toml: tiers.basic.requests_per_minute")
               for p in problems), problems

    for path in (folder / "policies" / "shadow").iterdir():
        path.unlink()
    assert load_config(folder).shadow is None  # an empty folder is no shadow


# ---- end to end -------------------------------------------------------------------------------

async def fund(redis_url: str, account: str) -> None:
    redis = Redis.from_url(redis_url)
    try:
        await Ledger(redis).credit(account, 10**9, {"reason": "test"})
    finally:
        await redis.aclose()


async def metric(gw: TestServer, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`, as /metrics shows them."""
    gw.app[METRICS].flush()
    async with aiohttp.ClientSession() as session, session.get(gw.make_url("/metrics")) as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def _read(path: Path, route: str | None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [line for line in map(orjson.loads, path.read_bytes().splitlines())
            if route is None or line["route"] == route]


async def _shadow_lines(path: Path, count: int, route: str | None = None
                        ) -> list[dict[str, Any]]:
    """The log's lines (of `route` only, if given) once there are `count` of them."""
    lines: list[dict[str, Any]] = []
    for _ in range(200):
        lines = _read(path, route)
        if len(lines) >= count:
            return lines
        await asyncio.sleep(0.02)
    raise AssertionError(f"{len(lines)} access-log lines, not {count}")


async def _call(gw: TestServer, method: str, path: str, *, key: str | None = None,
                body: dict[str, Any] | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key or ADMIN}"}
    async with aiohttp.ClientSession() as session, session.request(
            method, gw.make_url(path), json=body, headers=headers) as response:
        return response.status, await response.json()


async def _judged(gw: TestServer, requests: int) -> dict[str, Any]:
    """/admin/shadow once every request so far has been judged and tallied."""
    for _ in range(100):
        await gw.app[SHADOW].flush()
        status, shown = await _call(gw, "GET", "/admin/shadow")
        assert status == 200, shown
        if shown["summary"]["requests"] >= requests:
            return shown
        await asyncio.sleep(0.02)
    raise AssertionError(f"judged {shown['summary']}")


async def test_a_stricter_shadow_tier_is_judged_counted_logged_and_never_enforced(
        simulator: SimulatorFactory, gateway: GatewayFactory, tmp_path: Path,
        clean_redis: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", ADMIN)
    sim = await simulator("vllm")
    gw = await gateway(sim, settings={"access_log": "access.jsonl"}, policies={
        "tiers.toml": LIVE_TIERS, "prices.toml": PRICES, "shadow/tiers.toml": SHADOW_TIERS,
        "shadow/prices.toml": SHADOW_PRICES})
    key = await new_key(clean_redis.url, "basic", account="acct-basic")
    await fund(clean_redis.url, "acct-basic")
    for _ in range(4):
        status, _ = await _call(gw, "POST", CHAT, key=key, body={
            "model": MODEL, "messages": HELLO, "max_tokens": 16})
        assert status == 200  # live: 1000 a minute; the shadow's 2 are never enforced
    status, _ = await _call(gw, "POST", CHAT, key="igw_sk_nope", body={})  # not judged
    assert status == 401
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(CHAT), json={"model": MODEL, "messages": HELLO}) as response:
        assert response.status == 200  # a guest: live chat; the shadow's guests have none
    await settled(gw)

    lines = await _shadow_lines(tmp_path / "config" / "access.jsonl", 6)
    keyed = [line for line in lines if line.get("account") == "acct-basic"]
    assert [line["shadow"]["decision"] for line in keyed] == [200, 200, 429, 429]
    assert keyed[2]["shadow"]["reason"] == "rate"
    assert keyed[2]["shadow"]["message"] == "the basic tier allows 2 requests per minute"
    for line in keyed[:2]:  # admitted by both: the shadow's price is twice the live one's
        assert line["shadow"]["credits"] != line["credits"]
        assert float(line["shadow"]["credits"]) == pytest.approx(2 * float(line["credits"]),
                                                                 abs=1e-6)
    assert "credits" not in keyed[2]["shadow"]  # refused: charged nothing
    guest = next(line for line in lines if line.get("tier") == "guest")
    assert guest["shadow"] == {"decision": 403, "reason": "access",
                               "message": "the guest tier does not include chat"}
    assert "shadow" not in next(line for line in lines if line["status"] == 401)

    shown = await _judged(gw, 5)
    assert shown["loaded"] is True and shown["files"] == ["prices.toml", "tiers.toml"]
    assert shown["since"] is not None
    basic = next(t for t in shown["tiers"] if t["name"] == "basic")
    assert basic["differs"] == ["requests_per_minute"]
    assert basic["live"]["requests_per_minute"] == 1000
    assert basic["shadow"]["requests_per_minute"] == 2
    summary = shown["summary"]
    assert summary["requests"] == 5 and summary["disagreements"] == 3
    tally = summary["by_tier"]["basic"]
    assert sorted((d["live"], d["shadow"], d["reason"], d["count"])
                  for d in tally["decisions"]) == [("admitted", "429", "rate", 2),
                                                   ("admitted", "admitted", "", 2)]
    live_paid = sum(round(float(line["credits"]) * 1e6) for line in keyed)
    assert tally["live_micro_credits"] == live_paid
    assert tally["shadow_micro_credits"] == sum(
        round(float(line["shadow"]["credits"]) * 1e6) for line in keyed[:2])

    assert await metric(gw, "igw_shadow_decisions_total", tier="basic", live="admitted",
                        shadow="429", reason="rate") == 2
    assert await metric(gw, "igw_shadow_decisions_total", tier="guest", live="admitted",
                        shadow="403", reason="access") == 1
    assert await metric(gw, "igw_shadow_credits_total", tier="basic", policy="live") == \
        pytest.approx(live_paid / 1e6)

    # Removed at run time: the folder goes, a reload, and nothing is judged any more.
    for path in (tmp_path / "config" / "policies" / "shadow").iterdir():
        path.unlink()
    status, answer = await _call(gw, "POST", "/admin/reload")
    assert status == 200, answer
    status, shown = await _call(gw, "GET", "/admin/shadow")
    assert shown["loaded"] is False and shown["summary"]["requests"] == 0
    assert all(t["shadow"] is None and t["differs"] == [] for t in shown["tiers"])
    status, _ = await _call(gw, "POST", CHAT, key=key, body={"model": MODEL, "messages": HELLO})
    assert status == 200
    lines = await _shadow_lines(tmp_path / "config" / "access.jsonl", 7, CHAT)
    assert "shadow" not in lines[-1] and lines[-1]["status"] == 200


async def test_shadow_token_windows_and_a_live_refusal_the_shadow_would_admit(
        simulator: SimulatorFactory, gateway: GatewayFactory, tmp_path: Path,
        clean_redis: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shadow counts the tokens each request it admits used, in windows of its own; and a
    request the live tier refuses (403), the shadow's admits (a looser candidate)."""
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", ADMIN)
    live = LIVE_TIERS + '\n[tiers.pro]\nrequests_per_minute = 100\nfamilies = ["tts"]\n' \
                        'models = { "*" = ["direct"] }\n'
    shadow = LIVE_TIERS + '\n[tiers.pro]\nrequests_per_minute = 100\nfamilies = ["chat"]\n' \
                          'models = { "*" = ["direct"] }\ntokens_per_minute = 40\n'
    sim = await simulator("vllm")
    gw = await gateway(sim, settings={"access_log": "access.jsonl"}, policies={
        "tiers.toml": live, "prices.toml": PRICES, "shadow/tiers.toml": shadow})
    key = await new_key(clean_redis.url, "pro", account="acct-pro")
    await fund(clean_redis.url, "acct-pro")
    for _ in range(3):
        status, answer = await _call(gw, "POST", CHAT, key=key, body={
            "model": MODEL, "messages": HELLO, "max_tokens": 16})
        assert status == 403, answer  # live: pro has no chat
    lines = await _shadow_lines(tmp_path / "config" / "access.jsonl", 3)
    # Refused live, nothing ran, no tokens used: the shadow admits every one.
    assert [line["shadow"]["decision"] for line in lines] == [200, 200, 200]
    shown = await _judged(gw, 3)
    assert shown["summary"]["by_tier"]["pro"]["decisions"] == [
        {"live": "403", "shadow": "admitted", "reason": "", "count": 3}]

    # Now the live tier runs chat too (a reload): each request uses ~23 tokens of the
    # shadow's 40 a minute, so the second no longer fits.
    (tmp_path / "config" / "policies" / "tiers.toml").write_text(
        live.replace('families = ["tts"]', 'families = ["chat"]'))
    status, answer = await _call(gw, "POST", "/admin/reload")
    assert status == 200, answer
    for _ in range(2):
        status, answer = await _call(gw, "POST", CHAT, key=key, body={
            "model": MODEL, "messages": HELLO, "max_tokens": 16})
        assert status == 200, answer
    await settled(gw)
    lines = await _shadow_lines(tmp_path / "config" / "access.jsonl", 5, CHAT)
    used = lines[3]["units"]["prompt_tokens"] + lines[3]["units"]["completion_tokens"]
    assert 20 < used <= 40, lines[3]
    assert lines[3]["shadow"]["decision"] == 200
    assert lines[4]["shadow"] == {"decision": 429, "reason": "tokens",
                                  "message": "the pro tier allows 40 tokens a minute"}


# ---- the windows in Redis: one server and a Cluster -------------------------------------------

async def test_shadow_windows_count_each_account_apart_in_one_write_per_primary(
        redis_or_cluster: Store) -> None:
    """Accounts spread over a Cluster's primaries, judged in one batch: each account's request
    rate and token window counted on its own (a request over the rate counts nothing, one
    refused before the limits counts in the rate only), and the live windows never touched."""
    tier = _tier(requests_per_minute=3, tokens_per_minute=100)
    window = TokenWindow("*", "tokens", "minute", 100)
    store = redis_or_cluster
    ledger = Ledger(store)
    windows = ShadowWindows(ledger, store)
    accounts = [f"acct-{i}" for i in range(12)]  # over every primary of the Cluster
    try:
        def ask(account: str, tokens: int, check: bool = True) -> Ask:
            return Ask(Principal("key", account, "basic"), "basic", tier, (window,), tokens, 0,
                       check)

        first = await windows.count([ask(a, 60) for a in accounts])
        assert first == [(True, None)] * len(accounts)
        # 60 + 60 is over 100 tokens: refused for tokens, and not counted in them
        second = await windows.count([ask(a, 60) for a in accounts])
        assert second == [(True, window)] * len(accounts)
        # refused before the limits (no tokens checked), then over the rate of 3
        third = await windows.count([ask(a, 60, check=False) for a in accounts])
        assert third == [(True, None)] * len(accounts)
        fourth = await windows.count([ask(a, 0) for a in accounts])
        assert fourth == [(False, None)] * len(accounts)
        for account in accounts:
            keys = AccountKeys.of(account)
            assert await store.zcard(keys.shadow_window("basic")) == 3
            buckets = await store.hgetall(keys.shadow_tokens("basic", window.suffix))
            assert sum(int(v) for v in buckets.values()) == 60
            assert not await store.exists(keys.window("basic"))  # the live one's
            assert not await store.exists(keys.token_window("basic", window.suffix))
    finally:
        await windows.close()
        await ledger.close()
