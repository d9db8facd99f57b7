"""What the document bounds, as the gateway holds to it: a usage page size or `before` outside
them is the caller's 400 (never a 503 "store down"), credit amounts and account names are
checked before the ledger sees them, the served document names today's tiers, and an integer
written 1.0 is taken and sent on as 1."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from jsonschema import Draft202012Validator

from proxy.app import openapi_document
from proxy.appkeys import REDIS
from proxy.credits.ledger import AccountKeys
from proxy.store.redis_process import RedisProcess
from tests.support.config_files import GENEROUS_TIERS, MODEL
from tests.support.fleet import REPO
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import SimulatorFactory, sim_requests

ADMIN = {"Authorization": "Bearer admin-token-for-tests"}


@pytest.fixture
async def gw(gateway: GatewayFactory, simulator: SimulatorFactory,
             monkeypatch: pytest.MonkeyPatch) -> TestServer:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-token-for-tests")
    return await gateway(await simulator())


async def call(gw: TestServer, method: str, path: str, **kwargs: Any
               ) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.request(
            method, gw.make_url(path), **kwargs) as response:
        return response.status, await response.json()


async def test_usage_pages_are_bounded_and_before_is_checked(gw: TestServer) -> None:
    key = {"X-API-Key": gw.api_key}  # type: ignore[attr-defined]
    await call(gw, "POST", "/admin/accounts/acct-test/credits", headers=ADMIN,
               json={"amount": "1"})  # one journal entry
    for limit in ("0", "201", "x", "1.5"):
        status, body = await call(gw, "GET", f"/v2/account/usage?limit={limit}", headers=key)
        assert (status, body["error"]["type"]) == (400, "invalid_request"), limit
    for before in ("x", "1-", "-1-0", "1-2-3"):
        status, body = await call(gw, "GET", "/v2/account/usage", headers=key,
                                  params={"before": before})
        assert (status, body["error"]["type"]) == (400, "invalid_request"), before
    status, body = await call(gw, "GET", "/v2/account/usage?limit=200&before=0-0", headers=key)
    assert status == 200 and body["entries"] == []  # nothing precedes the first id
    status, newest = await call(gw, "GET", "/v2/account/usage?before=", headers=key)
    assert status == 200 and len(newest["entries"]) == 1
    status, body = await call(gw, "GET", "/v2/account/usage", headers=key,
                              params={"before": "99999999999999999999-0"})
    assert status == 200 and body["entries"] == newest["entries"]  # later than any id


async def test_credit_amounts_and_accounts_are_checked(gw: TestServer) -> None:
    path = "/admin/accounts/acme/credits"
    for amount in ("1.1234567", "1e3", " 5", "NaN", "", "1234567890"):
        status, body = await call(gw, "POST", path, headers=ADMIN, json={"amount": amount})
        assert status == 422 and body["detail"][0]["loc"] == ["body", "amount"], amount
    status, body = await call(gw, "POST", "/admin/accounts/no%20spaces/credits", headers=ADMIN,
                              json={"amount": "1"})
    assert status == 422 and body["detail"][0]["loc"] == ["path", "account"]
    # A segment with braces (a template left unfilled) reaches the same check, not a 404.
    for method, braced in (("POST", "/admin/accounts/%7Baccount%7D/credits"),
                           ("GET", "/admin/accounts/%7Baccount%7D/alerts")):
        status, body = await call(gw, method, braced, headers=ADMIN,
                                  json={"amount": "1"} if method == "POST" else None)
        assert status == 422 and body["detail"][0]["loc"] == ["path", "account"], braced
    status, body = await call(gw, "POST", path, headers=ADMIN, json={"amount": "-0.5"})
    assert (status, body["error"]["type"]) == (409, "conflict")  # below zero
    status, body = await call(gw, "POST", path, headers=ADMIN, json={"amount": "2.5"})
    assert status == 201 and body["available"]["micro_credits"] == 2_500_000
    # A balance past what Redis' integers hold is refused as a conflict (the store's other
    # refusals, a failover's, are a 503: not this).
    near = 2**63 - 1_000_000  # as if credited so much (the journal's checkpoint says so too)
    await gw.app[REDIS].hset(AccountKeys.of("acme").balance, mapping={
        "available": near, "credited": near, "trimmed_credited": near - 2_500_000})
    status, body = await call(gw, "POST", path, headers=ADMIN, json={"amount": "2"})
    assert (status, body["error"]["type"]) == (409, "conflict"), body


async def test_served_document_names_the_tiers_and_models_of_now(
        gw: TestServer, tmp_path: Path) -> None:
    def tier_enum(doc: dict[str, Any]) -> list[str]:
        return list(doc["components"]["schemas"]["CreateKeyBody"]["properties"]["tier"]["enum"])

    _, doc = await call(gw, "GET", "/v2/openapi.json")
    assert tier_enum(doc) == ["max"]  # the test tiers: guest (no keys) and max
    example = doc["paths"]["/v2/compat/v1/chat/completions"]["post"]["requestBody"]
    assert example["content"]["application/json"]["example"]["model"] == MODEL
    tiers = tmp_path / "config" / "policies" / "tiers.toml"
    tiers.write_text(tiers.read_text() + '\n[tiers.basic]\nrequests_per_minute = 5\n'
                     'families = ["chat"]\nmodels = { "*" = ["direct"] }\n')
    assert (await call(gw, "POST", "/admin/reload", headers=ADMIN))[0] == 200
    _, doc = await call(gw, "GET", "/v2/openapi.json")
    assert tier_enum(doc) == ["basic", "max"]
    status, _ = await call(gw, "POST", "/admin/keys", headers=ADMIN,
                           json={"account": "new", "tier": "basic"})
    assert status == 201


@pytest.mark.parametrize("path", ["/v2/compat/v1/chat/completions",
                                  "/v2/served/v1/chat/completions"])
async def test_integers_written_as_floats_are_sent_on_as_integers(
        gateway: GatewayFactory, simulator: SimulatorFactory, path: str) -> None:
    # The document says "integer", and JSON Schema takes 1.0 as one; TGI's serde would not.
    sim = await simulator("tgi")
    gw = await gateway(sim, kind="tgi")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8.0,
            "seed": 7.0, "temperature": 1.0}
    status, _ = await call(gw, "POST", path, json=body,
                           headers={"X-API-Key": gw.api_key})  # type: ignore[attr-defined]
    assert status == 200
    seen = (await sim_requests(sim))[-1]["body"]
    assert seen["max_tokens"] == 8 and isinstance(seen["max_tokens"], int)
    assert seen["seed"] == 7 and isinstance(seen["seed"], int)


async def test_the_account_routes_past_the_rate_are_a_documented_429(
        gateway: GatewayFactory, simulator: SimulatorFactory) -> None:
    """Both account routes count against the caller's rate, so their 429 is in the document
    (a schemathesis run found it missing), with the body and headers it describes."""
    tight = GENEROUS_TIERS.replace("[tiers.max]\nrequests_per_minute = 100000",
                                   "[tiers.max]\nrequests_per_minute = 2")
    assert tight != GENEROUS_TIERS
    gw = await gateway(await simulator(), policies={"tiers.toml": tight})
    key = {"X-API-Key": gw.api_key}  # type: ignore[attr-defined]
    doc = openapi_document()
    for path in ("/v2/account", "/v2/account/usage"):
        async with aiohttp.ClientSession() as session:
            statuses = []
            for _ in range(3):
                async with session.get(gw.make_url(path), headers=key) as response:
                    statuses.append(response.status)
                    body, headers = await response.json(), response.headers
        assert statuses[-1] == 429, (path, statuses)
        documented = doc["paths"][path]["get"]["responses"]["429"]
        schema = documented["content"]["application/json"]["schema"]
        assert Draft202012Validator({**schema, "components": doc["components"]}).is_valid(body)
        for name, header in documented["headers"].items():
            assert name in headers or not header.get("required"), (path, name)


async def test_a_top_up_under_an_idempotency_key_is_made_once(gw: TestServer) -> None:
    """A billing system retrying its call (its reply lost, or sent twice at once) adds once;
    the key is the operator's, apart from the account's own request keys."""
    path = "/admin/accounts/billed/credits"
    once = {**ADMIN, "Idempotency-Key": "invoice-42"}
    body = {"amount": "3", "reason": "invoice 42"}
    answers = await asyncio.gather(*(call(gw, "POST", path, headers=once, json=body)
                                     for _ in range(8)))
    assert {status for status, _ in answers} == {201}
    assert {a["available"]["micro_credits"] for _, a in answers} == {3_000_000}
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(path), headers=once, json={"reason": "invoice 42", "amount": "3.0"}
    ) as response:  # the same amount, written otherwise: the same top-up
        assert response.status == 201
        assert response.headers["Idempotent-Replayed"] == "true"
        assert (await response.json())["available"]["micro_credits"] == 3_000_000
    status, answer = await call(gw, "POST", path, headers=once, json={"amount": "4"})
    assert (status, answer["detail"][0]["loc"]) == (422, ["header", "Idempotency-Key"])
    # Without a key, or under another, a top-up is made again; the balance shows each once.
    assert (await call(gw, "POST", path, headers=ADMIN, json=body))[0] == 201
    assert (await call(gw, "POST", path, headers={**ADMIN, "Idempotency-Key": "invoice-43"},
                       json=body))[0] == 201
    balance = await gw.app[REDIS].hgetall(AccountKeys.of("billed").balance)
    assert int(balance[b"credited"]) == int(balance[b"available"]) == 9_000_000
    journal = await gw.app[REDIS].xlen(AccountKeys.of("billed").journal)
    assert journal == 3
    status, answer = await call(gw, "POST", path, headers={**ADMIN, "Idempotency-Key": ""},
                                json=body)
    assert status == 422
    # The account's own request under the same key string is its own, and runs.
    own = {"X-API-Key": gw.api_key, "Idempotency-Key": "invoice-42"}  # type: ignore[attr-defined]
    assert (await call(gw, "POST", "/admin/accounts/acct-test/credits", headers=once,
                       json=body))[0] == 201
    status, answer = await call(gw, "POST", "/v2/compat/v1/chat/completions", headers=own,
                                json={"model": MODEL, "messages": [{"role": "user",
                                                                    "content": "hi"}]})
    assert status == 200, answer


async def test_the_cli_and_the_admin_route_share_a_top_ups_key(
        gw: TestServer, clean_redis: RedisProcess) -> None:
    env = {**os.environ, "GATEWAY_REDIS_URL": clean_redis.url}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "proxy", "credits", "add", "--account",
                               "paid", *args, "--config", str(REPO)],
                              env=env, capture_output=True, text=True, timeout=60)

    first = cli("--amount", "2", "--reason", "order 7", "--idempotency-key", "order-7")
    assert first.returncode == 0 and "available 2.000000" in first.stdout, first.stderr
    again = cli("--amount", "2", "--reason", "order 7", "--idempotency-key", "order-7")
    assert again.returncode == 0 and "already added under this key" in again.stdout
    other = cli("--amount", "5", "--reason", "order 7", "--idempotency-key", "order-7")
    assert other.returncode != 0 and "used for another top-up" in other.stderr
    assert cli("--amount", "1", "--idempotency-key", "").returncode == 2
    status, body = await call(gw, "POST", "/admin/accounts/paid/credits",
                              headers={**ADMIN, "Idempotency-Key": "order-7"},
                              json={"amount": "2", "reason": "order 7"})
    assert status == 201 and body["available"]["micro_credits"] == 2_000_000
    balance = await gw.app[REDIS].hgetall(AccountKeys.of("paid").balance)
    assert int(balance[b"credited"]) == 2_000_000
