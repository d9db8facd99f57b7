"""The operator console (GET /admin/console) in a real browser: Debian's Chromium, driven by
Playwright, against the real gateway after real traffic (charged, refused and failed requests,
a shadow tier loaded). With the admin token typed into it the page must show exactly what the
admin routes return: the fleet, the tiers live and shadow side by side, the top accounts by spend
and by refusals, the errors by type and the last errors; say a refused token's 401 in words;
reload the policies on its button; and ask nothing of any host but the gateway, under the strict
policy its files are served with.

Needs `/usr/bin/chromium` (`apt-get install -y chromium`); without it the test fails, never skips.
"""

from __future__ import annotations

import asyncio
import json
import tomllib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from playwright.async_api import Browser, Page, expect
from redis.asyncio import Redis

from proxy.api import console, page_files
from proxy.app import openapi_document
from proxy.appkeys import DRAIN, TALLY
from proxy.credits.ledger import Ledger
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import funded_key, new_key
from tests.support.browser import Markup, Watched, launched
from tests.support.chat import HELLO
from tests.support.config_files import GENEROUS_TIERS, MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

ASSETS = Path(console.__file__).parent / "console_assets"
ROOT = Path(__file__).resolve().parent.parent.parent
ROUTE = "/v2/compat/v1/chat/completions"
TOKEN = "admin-token-for-the-console-test"
PRICES = """
version = "console-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""
# Basic: two requests a minute, at most 64 tokens each: asking for more is a 403 (counted in the
# minute all the same), and the third request a 429. The shadow allows three, of 128 tokens.
BASIC = """
[tiers.basic]
requests_per_minute = {rate}
max_tokens_per_request = {cap}
families = ["chat"]
models = {{ "*" = ["direct"] }}
"""
# A table's body rows as {row key: {field: text}}, read in the page.
TABLE_JS = """table => Object.fromEntries([...table.tBodies[0].rows]
    .filter(row => row.dataset.key !== undefined).map(row => [row.dataset.key,
        Object.fromEntries([...row.cells].map(td => [td.dataset.field, td.textContent]))]))"""
DEFINITIONS_JS = """list => Object.fromEntries([...list.querySelectorAll('dd')].map(
    dd => [dd.dataset.key, dd.textContent]))"""


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with launched() as started:
        yield started


async def call(gw: TestServer, path: str, headers: dict[str, str],
               body: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.request(
            "GET" if body is None else "POST", gw.make_url(path), headers=headers,
            json=body) as response:
        return response.status, await response.json()


async def admin(gw: TestServer, path: str) -> Any:
    status, body = await call(gw, path, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, body
    return body


async def chat(gw: TestServer, key: str, expected: int, **fields: Any) -> None:
    status, body = await call(gw, ROUTE, {"X-API-Key": key},
                              {"model": MODEL, "messages": HELLO, **fields})
    assert status == expected, body


async def busy_gateway(gateway: GatewayFactory, simulator: SimulatorFactory,
                       redis_url: str) -> TestServer:
    """A gateway whose accounts spent (acct-big more than acct-slow), were refused (acct-slow:
    429 and 403; acct-poor: 402) and failed (404), with a shadow Basic tier judging."""
    gw = await gateway(await simulator(), policies={
        "prices.toml": PRICES, "tiers.toml": GENEROUS_TIERS + BASIC.format(rate=2, cap=64),
        "shadow/tiers.toml": GENEROUS_TIERS + BASIC.format(rate=3, cap=128)})
    big = await funded_key(redis_url, account="acct-big")
    slow = await new_key(redis_url, "basic", account="acct-slow")
    poor = await new_key(redis_url, "max", account="acct-poor")
    redis = Redis.from_url(redis_url)
    try:
        await Ledger(redis).credit("acct-slow", 10**9, {"reason": "console test"})
    finally:
        await redis.aclose()
    for _ in range(3):
        await chat(gw, big, 200)
    await chat(gw, big, 404, model="acme/no-such-model")
    await chat(gw, slow, 403, max_tokens=100)
    await chat(gw, slow, 200)
    await chat(gw, slow, 429)
    await chat(gw, poor, 402)
    await settled(gw)
    await gw.app[TALLY].flush()  # rather than wait for the next second's
    await shadow_settled(gw)
    return gw


async def shadow_settled(gw: TestServer) -> None:
    """Wait until the shadow's tallies stop changing (its verdicts land after the answers)."""
    last = None
    for _ in range(100):
        summary = (await admin(gw, "/admin/shadow"))["summary"]
        if summary == last and summary["disagreements"]:
            return
        last = summary
        await asyncio.sleep(0.1)
    raise AssertionError(f"the shadow's tallies never settled: {last}")


def shown(value: Any) -> str:
    """A JSON value as the page writes it (a number as JavaScript's String() does)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S")


def fleet_rows(backends: dict[str, Any]) -> dict[str, dict[str, str]]:
    rows = {}
    for b in backends["data"]:
        engine = b["engine"] or {}
        rows[b["name"]] = {
            "name": b["name"], "kind": b["kind"], "family": shown(b["family"]),
            "state": b["state"], "healthy": "yes" if b["healthy"] else "no",
            "ejected_until": "—" if b["ejected_until"] is None else utc(b["ejected_until"]),
            "waiting": shown(engine.get("waiting")), "running": shown(engine.get("running")),
            "kv_cache_usage": shown(engine.get("kv_cache_usage")),
            "slots": f"{shown(b['slots']['in_use'])} / {shown(b['slots']['max'])}",
            "outstanding": shown(b["outstanding"]), "restarts": shown(b["restarts"])}
    return rows


def setting(fields: dict[str, Any] | None, name: str) -> str:
    if fields is None or name not in fields:
        return "—"
    value = fields[name]
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return shown(value)


def micro(value: int) -> str:
    return f"{'-' if value < 0 else ''}{abs(value) // 10**6}.{abs(value) % 10**6:06d}"


async def table(page: Page, selector: str) -> dict[str, dict[str, str]]:
    rows: dict[str, dict[str, str]] = await page.locator(selector).evaluate(TABLE_JS)
    return rows


async def marked_rows(page: Page, selector: str) -> list[str]:
    """The keys of a table's highlighted rows (what differs)."""
    keys: list[str] = await page.locator(f"{selector} tr.differs").evaluate_all(
        "rows => rows.map(row => row.dataset.key)")
    return keys


async def sign_in(page: Page, token: str) -> None:
    await page.fill("#token", token)
    await page.click("#token-form button[type=submit]")


async def fresh_load(page: Page) -> dict[str, Any]:
    """Click Refresh; the three answers the page's own reads got."""
    answers: dict[str, Any] = {}
    paths = ("/admin/backends", "/admin/overview", "/admin/shadow")
    async with page.expect_response(lambda r: urlsplit(r.url).path == paths[0]) as fleet, \
            page.expect_response(lambda r: urlsplit(r.url).path == paths[1]) as overview, \
            page.expect_response(lambda r: urlsplit(r.url).path == paths[2]) as shadow:
        await page.click("#refresh")
    for path, caught in zip(paths, (fleet, overview, shadow), strict=True):
        answers[path] = await (await caught.value).json()
    await expect(page.locator("#refresh")).to_be_enabled()  # rendered
    return answers


async def test_the_console_shows_what_the_admin_routes_return(
        gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
        browser: Browser, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    gw = await busy_gateway(gateway, simulator, clean_redis.url)
    page = await browser.new_page()
    watched = Watched(page)
    await page.goto(str(gw.make_url("/admin/console")))
    await expect(page.locator("#token-form")).to_be_visible()
    await expect(page.locator("#console")).to_be_hidden()
    await sign_in(page, TOKEN)
    await expect(page.locator("#console")).to_be_visible()
    # Every file the page asked for answered and tallied (its icon is its own: no favicon.ico,
    # a 404 the errors would count): from here on only its reads reach the gateway, and none
    # of them changes a figure.
    await page.wait_for_load_state("networkidle")
    await gw.app[TALLY].flush()
    own = await fresh_load(page)
    fleet, overview = await admin(gw, "/admin/backends"), await admin(gw, "/admin/overview")
    shadow = await admin(gw, "/admin/shadow")

    # The fleet: every backend's state and figures, as this worker sees them; nothing queued.
    for answer in (fleet, own["/admin/backends"]):
        assert await table(page, "#backends") == fleet_rows(answer)
    assert [b["state"] for b in fleet["data"]] == ["ready"]
    assert await table(page, "#queues") == {} and fleet["queues"] == {}

    # Spend and refusals per account, errors by type and the last errors, as the overview has
    # them (and as the traffic made them).
    for answer in (overview, own["/admin/overview"]):
        assert await table(page, "#top-spend") == {
            row["account"]: {"account": row["account"], "credits": row["credits"]}
            for row in answer["top_spend"]}
        assert await table(page, "#top-refused") == {
            row["account"]: {"account": row["account"], "refusals": str(row["refusals"])}
            for row in answer["top_refused"]}
        assert await table(page, "#errors-by-type") == {
            kind: {"type": kind, "status": str(seen["status"]), "count": str(seen["count"])}
            for kind, seen in answer["errors"]["by_type"].items()}
        assert await table(page, "#recent-errors") == {
            str(i): {"time": utc(e["ts"]), "status": str(e["status"]), "type": e["type"],
                     "route": e["route"], "model": shown(e["model"]),
                     "request_id": e["request_id"]}
            for i, e in enumerate(answer["errors"]["recent"])}
    spend = {row["account"]: row["micro_credits"] for row in overview["top_spend"]}
    assert list(spend) == ["acct-big", "acct-slow"] and spend["acct-slow"] > 0
    assert [(r["account"], r["refusals"]) for r in overview["top_refused"]] == \
        [("acct-slow", 2), ("acct-poor", 1)]
    assert {kind: seen["count"] for kind, seen in overview["errors"]["by_type"].items()} == \
        {"forbidden": 1, "insufficient_credits": 1, "not_found": 1, "rate_limited": 1}

    # The tiers, live and shadow side by side, the shadow's settings that differ marked; what it
    # decided, as the page's own read had it (and as it stands now).
    assert own["/admin/shadow"] == shadow and shadow["loaded"]
    # A setting per row, a tier per column by priority; a changed setting "live → shadow".
    tiers = await table(page, "#tiers")
    by_priority = sorted(shadow["tiers"], key=lambda t: (t["live"]["priority"], t["name"]))
    assert await page.locator("#tiers th").all_inner_texts() == [
        "Setting", *(t["name"] for t in by_priority)]
    expected: dict[str, dict[str, str]] = {}
    cells = []
    for tier in by_priority:
        for name in dict.fromkeys([*(tier["live"] or {}), *(tier["shadow"] or {})]):
            row = expected.setdefault(name, {"field": name})
            live = setting(tier["live"], name)
            changed = name in tier["differs"]
            key = f"tier:{tier['name']}"
            row[key] = f"{live} → {setting(tier['shadow'], name)}" if changed else live
            if changed:
                cells.append(f"{name}/{key}")
    assert tiers == expected
    assert await marked_rows(page, "#tiers") == [f for f in expected if any(
        c.startswith(f"{f}/") for c in cells)]
    assert sorted(await page.locator("#tiers td.differs").evaluate_all(
        "cells => cells.map(c => `${c.parentElement.dataset.key}/${c.dataset.field}`)")) == \
        sorted(cells)
    assert {"requests_per_minute/tier:basic", "max_tokens_per_request/tier:basic"} <= set(cells)
    assert tiers["requests_per_minute"]["tier:basic"] == "2 → 3"
    summary = shadow["summary"]
    assert await page.locator("#shadow-summary").evaluate(DEFINITIONS_JS) == {
        "version": str(shadow["version"]), "requests": str(summary["requests"]),
        "disagreements": str(summary["disagreements"])}
    assert await table(page, "#shadow-tiers") == {
        tier: {"tier": tier, "requests": str(seen["requests"]),
               "disagreements": str(seen["disagreements"]),
               "live_credits": micro(seen["live_micro_credits"]),
               "shadow_credits": micro(seen["shadow_micro_credits"])}
        for tier, seen in summary["by_tier"].items()}
    assert await table(page, "#decisions") == {
        f"{tier}/{i}": {"tier": tier, "live": shown(d["live"]), "shadow": shown(d["shadow"]),
                        "reason": shown(d["reason"]), "count": str(d["count"])}
        for tier, seen in summary["by_tier"].items() for i, d in enumerate(seen["decisions"])}
    disagreed = [f"{tier}/{i}" for tier, seen in summary["by_tier"].items()
                 for i, d in enumerate(seen["decisions"]) if d["live"] != d["shadow"]]
    assert disagreed and await marked_rows(page, "#decisions") == disagreed

    # "Reload policies": the version goes up, the page says so and shows it.
    version = shadow["version"]
    await page.click("#reload")
    result = page.locator("#reload-result")
    await expect(result).to_have_text(f"Policies reloaded: version {version + 1}.")
    await expect(page.locator("#shadow-summary dd[data-key=version]")).to_have_text(
        str(version + 1))
    # A policy file that does not parse: refused in words, the policies in force kept.
    tiers_file = tmp_path / "config" / "policies" / "tiers.toml"
    good = tiers_file.read_text()
    tiers_file.write_text(good + "\n[tiers.basic\n")
    await page.click("#reload")
    await expect(result).to_contain_text("Not reloaded; the policies in force stay. The "
                                         "gateway answered 422 (policy reload refused:")
    tiers_file.write_text(good)
    assert (await admin(gw, "/admin/shadow"))["version"] == version + 1

    # The token stays in the tab until signing out; a wrong one is the gateway's 401, in words.
    assert await page.evaluate("sessionStorage.length") == 1
    await page.click("#sign-out")
    await expect(page.locator("#token-form")).to_be_visible()
    assert await page.evaluate("sessionStorage.length") == 0
    assert await page.locator("#backends tr").count() == 0
    await sign_in(page, TOKEN + "-wrong")
    message = page.locator("#message")
    await expect(message).to_contain_text("The gateway refused this token (401 unauthorized: "
                                          "admin credentials required)")
    await expect(page.locator("#token-form")).to_be_visible()
    await expect(page.locator("#console")).to_be_hidden()
    assert await page.evaluate("sessionStorage.length + localStorage.length") == 0
    watched.assert_stayed_home(gw, TOKEN)


async def test_an_outage_is_said_in_words_and_the_figures_stay(
        gateway: GatewayFactory, simulator: SimulatorFactory, browser: Browser,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", TOKEN)
    gw = await gateway(await simulator())
    page = await browser.new_page()
    watched = Watched(page)
    await page.goto(str(gw.make_url("/admin/console")))
    await sign_in(page, TOKEN)
    await expect(page.locator("#console")).to_be_visible()
    # No shadow loaded: the live tiers alone.
    await expect(page.locator("#shadow-note")).to_have_text(
        "No shadow policies loaded: the live tiers alone.")
    live = (await admin(gw, "/admin/shadow"))["tiers"]
    assert await page.locator("#tiers thead th").all_text_contents() == ["Setting", *(
        t["name"] for t in sorted(live, key=lambda t: (t["live"]["priority"], t["name"])))]
    assert not await page.locator("#tiers .differs").count()
    await expect(page.locator("#shadow-judged")).to_be_hidden()
    await expect(page.locator("#top-spend")).to_contain_text("No account has spent anything")
    rows = await table(page, "#backends")
    # The gateway starts draining: a refresh is a 503 on every read, said as such; the
    # figures already shown stay.
    await gw.app[DRAIN].drain(deadline_s=1)
    await page.click("#refresh")
    unavailable = ("The gateway cannot answer right now (503: the gateway is shutting down; "
                   "retry shortly). Try again in 1 s.")
    await expect(page.locator("#message")).to_have_text(
        f"The fleet: {unavailable} Accounts and errors: {unavailable} Tiers: {unavailable}")
    assert await table(page, "#backends") == rows and rows
    await expect(page.locator("#console")).to_be_visible()
    watched.assert_stayed_home(gw, TOKEN)


# ---- without a browser: the files, their headers, their packaging -----------------------------

async def test_the_files_are_served_as_the_dashboards_are(
        gateway: GatewayFactory, simulator: SimulatorFactory) -> None:
    gw = await gateway(await simulator())
    async with aiohttp.ClientSession() as session:
        for path, name, content_type in (
                ("/admin/console", "index.html", "text/html"),
                ("/admin/console/app.js", "app.js", "text/javascript"),
                ("/admin/console/style.css", "style.css", "text/css"),
                ("/admin/console/icon.svg", "icon.svg", "image/svg+xml")):
            async with session.get(gw.make_url(path)) as response:  # no credentials needed
                assert response.status == 200
                assert response.headers["Content-Type"] == f"{content_type}; charset=utf-8"
                assert await response.read() == (ASSETS / name).read_bytes()
                headers = response.headers
            assert headers["Content-Security-Policy"] == page_files.CSP
            for header, value in page_files.HEADERS.items():
                assert headers[header] == value, header
            async with session.head(gw.make_url(path)) as response:
                assert response.status == 200 and await response.read() == b""
            async with session.get(gw.make_url(path),
                                   headers={"If-None-Match": f'W/{headers["ETag"]}'}) as r:
                assert r.status == 304 and await r.read() == b""
                assert r.headers["ETag"] == headers["ETag"]
            paths = openapi_document()["paths"]
            documented = paths[path]["get"]
            assert list(documented["responses"]["200"]["content"]) == [content_type]
            assert documented["security"] == paths["/dashboard"]["get"]["security"]  # none


def test_the_page_runs_only_its_own_files_and_ships_in_the_package() -> None:
    markup = Markup()
    markup.feed((ASSETS / "index.html").read_text())
    assert markup.scripts == [("/admin/console/app.js", False)]  # no inline script
    assert markup.inline == []  # nor inline handlers or styles (the policy would refuse them)
    assert sorted(markup.links) == ["/admin/console/app.js", "/admin/console/icon.svg",
                                    "/admin/console/style.css"]
    script = (ASSETS / "app.js").read_text()
    assert "localStorage" not in script and "innerHTML" not in script
    for asset in ASSETS.iterdir():
        text = asset.read_text().replace('"http://www.w3.org/2000/svg"', "")  # a name
        assert "http://" not in text and "https://" not in text and "//" + "cdn" not in text
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["proxy.api"]
    for asset in ASSETS.iterdir():
        relative = f"console_assets/{asset.name}"
        assert any(fnmatch(relative, pattern) for pattern in patterns), relative
