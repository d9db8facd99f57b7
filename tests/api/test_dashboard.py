"""The usage dashboard (GET /dashboard) in a real browser: Debian's Chromium, driven by
Playwright, against the real gateway after real traffic. The page must show exactly what the
account API returns for the key typed into it, one bar per model, readable 401/429/503
messages, forget the key on sign-out, and ask nothing of any host but the gateway.

Needs `/usr/bin/chromium` (`apt-get install -y chromium`); without it the test fails, never skips.
"""

from __future__ import annotations

import tomllib
from collections.abc import AsyncIterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from playwright.async_api import Browser, Page, expect
from redis.asyncio import Redis

from proxy.api import dashboard
from proxy.app import openapi_document
from proxy.appkeys import DRAIN
from proxy.credits.ledger import Ledger
from proxy.credits.pricing import format_credits
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.browser import Markup, Watched, launched
from tests.support.chat import HELLO
from tests.support.config_files import GENEROUS_TIERS, MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

OTHER_MODEL = "acme/other-chat"
TTS_MODEL = "acme/csm-1b"
ASSETS = Path(dashboard.__file__).parent / "dashboard_assets"
ROOT = Path(__file__).resolve().parent.parent.parent
PRICES = f"""
version = "dashboard-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
[models."{OTHER_MODEL}"]
prompt_per_1k_tokens = 3000
completion_per_1k_tokens = 30000
[models."{TTS_MODEL}"]
per_1k_characters = 16000
"""
# A tier whose one request a minute the dashboard's two reads overrun: a real 429.
SLOW_TIER = """
[tiers.basic]
requests_per_minute = 1
families = ["chat"]
models = { "*" = ["direct"] }
"""
# A table's body rows as {row key: {field: text}}, read in the page.
TABLE_JS = """table => Object.fromEntries([...table.tBodies[0].rows].map(row => [
    row.dataset.key ?? row.dataset.id,
    Object.fromEntries([...row.querySelectorAll('td')].map(td => [td.dataset.field,
                                                                   td.textContent]))]))"""
DEFINITIONS_JS = """list => Object.fromEntries([...list.querySelectorAll('dd')].map(
    dd => [dd.dataset.key, dd.textContent]))"""


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    async with launched() as started:
        yield started


async def get_json(gateway: TestServer, path: str, key: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(
            gateway.make_url(path), headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def post(gateway: TestServer, path: str, body: dict[str, Any], key: str) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            gateway.make_url(path), json=body, headers={"X-API-Key": key}) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def busy_gateway(gateway: GatewayFactory, simulator: SimulatorFactory,
                       redis_url: str) -> TestServer:
    """A gateway serving two chat models and a TTS model, its key's account funded and used
    on all three."""
    chat = await simulator(models=(MODEL, OTHER_MODEL))
    tts = await simulator("tts", (TTS_MODEL,))
    gw = await gateway(chat, {"name": "tts-a", "kind": "tts", "models": [TTS_MODEL],
                              "url": str(tts.make_url("/")).rstrip("/")},
                       models=(MODEL, OTHER_MODEL),
                       policies={"prices.toml": PRICES, "tiers.toml": GENEROUS_TIERS.replace(
                           "[tiers.max]\n", "[tiers.max]\ntokens_per_minute = 50000\n"
                       ) + SLOW_TIER})
    redis = Redis.from_url(redis_url)
    try:
        await Ledger(redis).credit("acct-test", 7_500_000, {"reason": "dashboard test"})
        await Ledger(redis).set_budget("acct-test", "month", 6_000_000)
    finally:
        await redis.aclose()
    key: str = gw.api_key  # type: ignore[attr-defined]
    for _ in range(3):
        await post(gw, "/v2/compat/v1/chat/completions", {"model": MODEL, "messages": HELLO}, key)
    for _ in range(2):
        await post(gw, "/v2/served/v1/chat/completions",
                   {"model": OTHER_MODEL, "messages": HELLO}, key)
    await post(gw, "/v2/audio/tts/engine", {"text": "Hello from the dashboard."}, key)
    await settled(gw)
    return gw


def shown(view: dict[str, Any], field: str) -> str:
    """A usage figure as the page must write it: credits as the API's string, counts as given
    (a float as JavaScript writes it)."""
    value = view[field]
    if field == "cost":
        return str(value["credits"])
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


async def sign_in(page: Page, key: str) -> None:
    await page.fill("#key", key)
    await page.click("#key-form button[type=submit]")


async def test_the_dashboard_shows_what_the_account_api_returns(
        gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
        browser: Browser) -> None:
    gw = await busy_gateway(gateway, simulator, clean_redis.url)
    key: str = gw.api_key  # type: ignore[attr-defined]
    account = await get_json(gw, "/v2/account", key)
    usage = await get_json(gw, "/v2/account/usage", key)
    assert set(usage["by_model"]) == {MODEL, OTHER_MODEL, TTS_MODEL}
    # Trailing zeros throughout (the prices are chosen so): a number the page re-rendered,
    # rather than wrote as given, would lose them.
    assert all(account["balance"][name]["credits"].endswith("0")
               for name in ("available", "spent", "credited"))
    assert usage["totals"]["cost"]["credits"].endswith("0")

    page = await browser.new_page()
    watched = Watched(page)
    await page.goto(str(gw.make_url("/dashboard")))
    await expect(page.locator("#key-form")).to_be_visible()
    await expect(page.locator("#dashboard")).to_be_hidden()
    async with page.expect_response(lambda r: urlsplit(r.url).path == "/v2/account") as read:
        await sign_in(page, key)
    own = await (await read.value).json()  # what the page's own read returned
    await expect(page.locator("#dashboard")).to_be_visible()

    # The balance, as the account API gives it (the rate limit as the page's own read gave it).
    balance = await page.locator("#balance").evaluate(DEFINITIONS_JS)
    for name in ("available", "held", "spent", "credited"):
        assert balance[name] == account["balance"][name]["credits"], name
    assert balance["rate-remaining"] == str(own["rate_limit"]["remaining"])
    assert balance["rate-limit"] == str(account["rate_limit"]["limit"])
    assert balance["price-version"] == "dashboard-v1"
    # The token window and the budget, as the page's own read gave them.
    limits = await page.locator("#limits").evaluate(DEFINITIONS_JS)
    [minute, *_], [month] = own["token_limits"], own["budgets"]
    assert limits["tokens-minute"] == f"{minute['remaining']} of 50000"
    assert limits["budget-account-month"] == (
        f"{month['remaining']['credits']} of 6.000000 left (spent {month['spent']['credits']}, "
        f"held 0.000000); resets {month['resets_at']}")
    assert await page.locator("#who").text_content() == \
        f"Account acct-test · tier max · key {account['key_id']}"

    # Totals and the per-model and per-day tables, figure for figure.
    fields = ["requests", "prompt_tokens", "completion_tokens", "characters", "audio_seconds",
              "images", "video_seconds", "cost"]
    totals = await page.locator("#totals").evaluate(DEFINITIONS_JS)
    assert totals == {field: shown(usage["totals"], field) for field in fields}
    assert usage["totals"]["requests"] == 6 and usage["totals"]["characters"] > 0
    by_model = await page.locator("#by-model").evaluate(TABLE_JS)
    assert by_model == {model: {field: shown(view, field) for field in fields}
                        for model, view in usage["by_model"].items()}
    by_day = await page.locator("#by-day").evaluate(TABLE_JS)
    assert by_day == {day: {field: shown(view, field) for field in fields}
                      for day, view in usage["by_day"].items()}

    # One bar per model, labelled with its exact credits, the longest for the most spent.
    bars = page.locator("#chart-models rect.bar")
    assert await bars.count() == len(usage["by_model"])
    widths = {await bar.get_attribute("data-label"): float(await bar.get_attribute("width") or 0)
              for bar in await bars.all()}
    assert set(widths) == set(usage["by_model"])
    costliest = max(usage["by_model"], key=lambda m: usage["by_model"][m]["cost"]["micro_credits"])
    assert max(widths, key=lambda m: widths[m]) == costliest
    values = await page.locator("#chart-models text.value").all_text_contents()
    assert values == [view["cost"]["credits"] for view in usage["by_model"].values()]
    days = list(usage["by_day"])  # today (and yesterday, had the traffic straddled midnight)
    for chart in ("#chart-day-credits", "#chart-day-requests"):
        bars = page.locator(f"{chart} rect.bar")
        assert [await bar.get_attribute("data-day") for bar in await bars.all()] == days
    for day, view in usage["by_day"].items():
        title = page.locator(f"#chart-day-requests g[data-day='{day}'] title")
        assert await title.text_content() == f"{day}: {view['requests']} requests"

    # The journal page: every entry, newest first, amounts written exactly.
    journal = await page.locator("#journal").evaluate(TABLE_JS)
    assert list(journal) == [entry["id"] for entry in usage["entries"]]
    for entry in usage["entries"]:
        micro = entry["amount"] if entry["type"] == "credit" else entry["cost"]
        assert journal[entry["id"]]["cost"] == format_credits(micro)
        assert journal[entry["id"]]["model"] == entry.get("model", "—")

    # "Older entries" pages back through the journal as the API does.
    redis = Redis.from_url(clean_redis.url)
    try:
        for i in range(50):
            await Ledger(redis).credit("acct-test", 1, {"reason": f"entry {i}"})
    finally:
        await redis.aclose()
    newest = await get_json(gw, "/v2/account/usage", key)
    older = await get_json(gw, f"/v2/account/usage?before={newest['next_before']}", key)
    rows = page.locator("#journal tbody tr")
    await page.click("#refresh")
    await expect(rows).to_have_count(50)
    await page.click("#older")
    await expect(rows).to_have_count(50 + len(older["entries"]))
    await expect(page.locator("#older")).to_be_hidden()  # that was the last page
    assert [await row.get_attribute("data-id") for row in await rows.all()] == \
        [entry["id"] for entry in newest["entries"] + older["entries"]]

    # A reload keeps the tab signed in; signing out forgets the key.
    assert await page.evaluate("sessionStorage.length") == 1
    await page.reload()
    await expect(page.locator("#dashboard")).to_be_visible()
    await page.click("#sign-out")
    await expect(page.locator("#key-form")).to_be_visible()
    await expect(page.locator("#dashboard")).to_be_hidden()
    assert await page.evaluate("sessionStorage.length") == 0
    assert await page.evaluate("localStorage.length") == 0
    assert await page.locator("#balance dd").count() == 0
    assert await page.input_value("#key") == ""
    await page.reload()
    await expect(page.locator("#key-form")).to_be_visible()

    # A mistyped key: the gateway's 401, in words, and the form back.
    await sign_in(page, key[:-1] + ("x" if key[-1] != "x" else "y"))
    message = page.locator("#message")
    await expect(message).to_contain_text("This key was not accepted (invalid API key)")
    await expect(page.locator("#key-form")).to_be_visible()
    assert await page.evaluate("sessionStorage.length") == 0
    watched.assert_stayed_home(gw, key)


async def test_rate_limits_and_outages_are_explained(
        gateway: GatewayFactory, simulator: SimulatorFactory, clean_redis: RedisProcess,
        browser: Browser) -> None:
    gw = await busy_gateway(gateway, simulator, clean_redis.url)
    page = await browser.new_page()
    watched = Watched(page)
    await page.goto(str(gw.make_url("/dashboard")))

    # One request a minute: the dashboard's second read is the gateway's 429.
    slow = await new_key(clean_redis.url, "basic", account="slow")
    await sign_in(page, slow)
    message = page.locator("#message")
    await expect(message).to_contain_text("Too many requests with this key for its tier")
    await expect(message).to_contain_text(" s.")  # when to retry, from Retry-After
    await expect(page.locator("#sign-out")).to_be_visible()  # the key is kept for a retry
    await page.click("#sign-out")

    # Signed in, then the gateway starts draining: a refresh is its 503, the figures stay.
    key: str = gw.api_key  # type: ignore[attr-defined]
    await sign_in(page, key)
    await expect(page.locator("#dashboard")).to_be_visible()
    await gw.app[DRAIN].drain(deadline_s=1)
    await page.click("#refresh")
    await expect(message).to_have_text("The gateway cannot answer right now (the gateway is "
                                       "shutting down; retry shortly). Try again in 1 s.")
    await expect(page.locator("#dashboard")).to_be_visible()
    watched.assert_stayed_home(gw, key)
    watched.assert_stayed_home(gw, slow)


# ---- without a browser: the files, their headers, their packaging -----------------------------

@pytest.mark.parametrize(("path", "name", "content_type"), [
    ("/dashboard", "index.html", "text/html"),
    ("/dashboard/app.js", "app.js", "text/javascript"),
    ("/dashboard/style.css", "style.css", "text/css"),
])
async def test_the_files_are_served_with_a_strict_policy(
        gateway: GatewayFactory, simulator: SimulatorFactory, path: str, name: str,
        content_type: str) -> None:
    gw = await gateway(await simulator())
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.make_url(path)) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == f"{content_type}; charset=utf-8"
            assert await response.read() == (ASSETS / name).read_bytes()
            headers = response.headers
        csp = dict(d.strip().split(" ", 1) for d in headers["Content-Security-Policy"].split(";"))
        assert csp["default-src"] == csp["script-src"] == csp["connect-src"] == "'self'"
        assert csp["style-src"] == "'self'" and csp["form-action"] == "'none'"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Referrer-Policy"] == "no-referrer"
        assert headers["Cache-Control"] == "no-cache"
        assert headers["X-Request-Id"]
        etag = headers["ETag"]
        async with session.head(gw.make_url(path)) as response:
            assert response.status == 200 and await response.read() == b""
            assert response.headers["Content-Length"] == str(len((ASSETS / name).read_bytes()))
            assert response.headers["Content-Security-Policy"] == headers["Content-Security-Policy"]
        for tags in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            async with session.get(gw.make_url(path),
                                   headers={"If-None-Match": tags}) as response:
                assert response.status == 304 and await response.read() == b"", tags
                assert response.headers["ETag"] == etag
        async with session.get(gw.make_url(path), headers={"If-None-Match": '"other"'}) as r:
            assert r.status == 200
    documented = openapi_document()["paths"][path]["get"]["responses"]
    assert list(documented["200"]["content"]) == [content_type]


def test_the_page_runs_only_its_own_files_and_ships_in_the_package() -> None:
    markup = Markup()
    markup.feed((ASSETS / "index.html").read_text())
    assert markup.scripts == [("/dashboard/app.js", False)]  # no inline script
    assert markup.inline == []  # nor inline handlers or styles (the policy would refuse them)
    assert sorted(markup.links) == ["/dashboard/app.js", "/dashboard/style.css"]
    script = (ASSETS / "app.js").read_text()
    assert "localStorage" not in script and "innerHTML" not in script
    for asset in ASSETS.iterdir():
        text = asset.read_text().replace('"http://www.w3.org/2000/svg"', "")
        assert "http://" not in text and "https://" not in text and "//" + "cdn" not in text
    # What `pip install` copies: every asset matches the package data of proxy.api.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["proxy.api"]
    for asset in ASSETS.iterdir():
        relative = f"dashboard_assets/{asset.name}"
        assert any(fnmatch(relative, pattern) for pattern in patterns), relative
