"""Identity, tiers and rate limits through the running gateway (real Redis, real simulators)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.app import build_app
from proxy.config import load_config
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import new_key
from tests.support.chat import HELLO, post
from tests.support.config_files import BIG, MODEL, tiers, write_config
from tests.support.gateway import GatewayFactory
from tests.support.processes import free_port
from tests.support.upstreams import SimulatorFactory, sim_requests

SECRET = "s" * 48
AUTH_JWT = """
[jwt]
algorithms = ["HS256"]
secret_env = "TEST_JWT_SECRET"
issuer = "test-issuer"
audience = "igw-test"
"""


def token(**claims: Any) -> str:
    now = int(time.time())
    base = {"sub": "acct-jwt", "tier": "pro", "iss": "test-issuer", "aud": "igw-test",
            "exp": now + 300, "iat": now}
    base.update(claims)
    return jwt.encode({k: v for k, v in base.items() if v is not None}, SECRET, algorithm="HS256")


@pytest.fixture
def jwt_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_JWT_SECRET", SECRET)


async def chat(gw: TestServer, headers: dict[str, str] | None = None, **body: Any
               ) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, got_headers, raw = await post(gw, {"model": MODEL, "messages": HELLO, **body},
                                          headers=headers)
    return status, got_headers, orjson.loads(raw)


async def test_key_in_either_header_and_x_api_key_wins(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    gw = await gateway(await simulator())
    key = gw.api_key  # type: ignore[attr-defined]
    assert (await chat(gw, {"X-API-Key": key}))[0] == 200
    assert (await chat(gw, {"Authorization": f"Bearer {key}"}))[0] == 200
    # Both sent: X-API-Key decides, whatever the other says.
    assert (await chat(gw, {"X-API-Key": key, "Authorization": "Bearer junk"}))[0] == 200
    status, _, body = await chat(gw, {"X-API-Key": "junk", "Authorization": f"Bearer {key}"})
    assert status == 401 and body["error"]["type"] == "invalid_api_key"


async def test_invalid_credentials_are_401_never_a_silent_guest(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    sim = await simulator()
    gw = await gateway(sim)
    key = gw.api_key  # type: ignore[attr-defined]
    typo = key[:-3] + ("A" if key[-3] != "A" else "B") + key[-2:]
    unknown = await new_key(clean_redis.url)
    redis_url = clean_redis.url
    from redis.asyncio import Redis

    from proxy.config import KeysPolicy
    from proxy.identity.keystore import KeyStore
    redis = Redis.from_url(redis_url)
    await KeyStore(redis, KeysPolicy()).revoke(unknown)
    await redis.aclose()
    cases = {
        "X-API-Key": [typo, "", "igw_sk_short", "sk-openai-style"],
        "Authorization": ["Basic dXNlcjpwYXNz", f"Bearer {typo}", "Bearer not-a-key-or-jwt",
                          f"Bearer {token()}"],  # JWTs are off on this gateway
    }
    for header, values in cases.items():
        for value in values:
            status, _, body = await chat(gw, {header: value})
            assert status == 401, (header, value)
            assert value not in orjson.dumps(body).decode() or not value
    status, _, body = await chat(gw, {"X-API-Key": unknown})
    assert status == 401 and "revoked" in body["error"]["message"]
    assert await sim_requests(sim) == []


async def test_jwt_bearer_tokens_and_attacks(
    simulator: SimulatorFactory, gateway: GatewayFactory, jwt_secret: None
) -> None:
    sim = await simulator(models=(MODEL, BIG))
    gw = await gateway(sim, models=(MODEL, BIG),
                       policies={"auth.toml": AUTH_JWT, "tiers.toml": tiers()})
    assert (await chat(gw, {"Authorization": f"Bearer {token()}"}))[0] == 200
    # The tier comes from the claims: pro may use the 120B model directly, basic may not.
    assert (await chat(gw, {"Authorization": f"Bearer {token(tier='pro')}"}, model=BIG))[0] == 200
    assert (await chat(gw, {"Authorization": f"Bearer {token(tier='basic')}"}, model=BIG))[0] == 403
    header, payload, _ = token().split(".")
    forged_none = f"{header.replace(header, 'eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0')}.{payload}."
    attacks = {
        "alg none": forged_none,
        "expired": token(exp=int(time.time()) - 3600),
        "wrong audience": token(aud="someone-else"),
        "wrong issuer": token(iss="mallory"),
        "bad signature": jwt.encode({"sub": "x", "tier": "max", "exp": int(time.time()) + 60,
                                     "iss": "test-issuer", "aud": "igw-test"},
                                    "x" * 48, algorithm="HS256"),
        "no tier": token(tier=None),
    }
    for name, forged in attacks.items():
        status, _, body = await chat(gw, {"Authorization": f"Bearer {forged}"})
        assert status == 401, name
        assert body["error"]["type"] == "invalid_api_key"
    assert len(await sim_requests(sim)) == 2


async def test_guests_by_address_and_trusted_proxies(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator()
    trusted = "[clients]\ntrusted_proxies = [\"127.0.0.1/32\"]\n"
    gw = await gateway(sim, policies={"tiers.toml": tiers(guest=2), "auth.toml": trusted})
    for _ in range(2):
        assert (await chat(gw, {"X-Forwarded-For": "203.0.113.7"}))[0] == 200
    status, _headers, body = await chat(gw, {"X-Forwarded-For": "203.0.113.7"})
    assert status == 429 and body["error"]["type"] == "rate_limited"
    # Another client behind the same trusted proxy has its own bucket; a forged entry to the
    # left of the proxy's own does not help the limited client.
    assert (await chat(gw, {"X-Forwarded-For": "198.51.100.9"}))[0] == 200
    status, _, _ = await chat(gw, {"X-Forwarded-For": "198.51.100.10, 203.0.113.7"})
    assert status == 429


async def test_forwarded_for_ignored_from_untrusted_peers(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    gw = await gateway(await simulator(), policies={"tiers.toml": tiers(guest=2)})
    assert (await chat(gw, {"X-Forwarded-For": "203.0.113.1"}))[0] == 200
    assert (await chat(gw, {"X-Forwarded-For": "203.0.113.2"}))[0] == 200
    assert (await chat(gw, {"X-Forwarded-For": "203.0.113.3"}))[0] == 429  # one bucket: the peer


async def test_each_tier_access(simulator: SimulatorFactory, gateway: GatewayFactory,
                                clean_redis: RedisProcess) -> None:
    sim = await simulator(models=(MODEL, BIG))
    gw = await gateway(sim, models=(MODEL, BIG), policies={"tiers.toml": tiers()})
    keys = {tier: await new_key(clean_redis.url, tier) for tier in ("basic", "pro", "max")}

    async def status(tier: str, **body: Any) -> tuple[int, str]:
        code, _, got = await chat(gw, {"X-API-Key": keys[tier]}, **body)
        return code, got["error"]["message"] if code >= 400 else ""

    assert (await status("basic"))[0] == 200
    code, message = await status("basic", model=BIG)
    assert code == 403 and "basic tier may not use model group 'large-chat'" in message
    assert (await status("pro", model=BIG))[0] == 200
    code, message = await status("pro", model=BIG, mode="network")
    assert code == 403 and "network mode" in message
    # Max may use it in network mode; this gateway offers it in direct mode only: 404.
    code, message = await status("max", model=BIG, mode="network")
    assert code == 404 and "not offered in network mode" in message
    assert (await status("max", model=BIG))[0] == 200


async def test_guest_token_cap(simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    sim = await simulator()
    gw = await gateway(sim, policies={"tiers.toml": tiers()})
    status, _, body = await chat(gw, max_tokens=1000)
    assert status == 403 and "at most 64 completion tokens" in body["error"]["message"]
    assert (await chat(gw))[0] == 200
    assert (await sim_requests(sim))[-1]["body"]["max_tokens"] == 64  # the cap was applied


async def test_rate_limit_headers_and_429(simulator: SimulatorFactory, gateway: GatewayFactory,
                                          clean_redis: RedisProcess) -> None:
    sim = await simulator()
    gw = await gateway(sim, policies={"tiers.toml": tiers(basic=3)})
    key = await new_key(clean_redis.url, "basic")
    remaining = []
    for _ in range(3):
        status, headers, _ = await chat(gw, {"X-API-Key": key})
        assert status == 200 and headers["X-RateLimit-Limit"] == "3"
        assert 1 <= int(headers["X-RateLimit-Reset"]) <= 60
        remaining.append(headers["X-RateLimit-Remaining"])
    assert remaining == ["2", "1", "0"]
    status, headers, body = await chat(gw, {"X-API-Key": key})
    assert status == 429 and body["error"]["type"] == "rate_limited"
    assert 1 <= int(headers["Retry-After"]) <= 60 and headers["X-RateLimit-Remaining"] == "0"
    assert len(await sim_requests(sim)) == 3  # the rejected request never reached the upstream
    # Every identified attempt counts (the spec's check order), and limited routes always carry
    # the headers, errors included.
    status, headers, _ = await post(gw, None, raw=b"{bad", headers={"X-API-Key": key})
    assert status == 429 and "X-RateLimit-Limit" in headers


async def test_concurrent_requests_never_exceed_the_limit(
    simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    sim = await simulator()
    gw = await gateway(sim, policies={"tiers.toml": tiers(basic=5)})
    key = await new_key(clean_redis.url, "basic")
    results = await asyncio.gather(*(chat(gw, {"X-API-Key": key}) for _ in range(50)))
    codes = sorted(status for status, _, _ in results)
    assert codes.count(200) == 5 and codes.count(429) == 45
    assert len(await sim_requests(sim)) == 5


async def test_store_down_fails_open_or_closed_then_recovers(
    simulator: SimulatorFactory, aiohttp_server: Any, tmp_path: Path
) -> None:
    redis = RedisProcess(tmp_path / "redis", port=free_port(), fsync="always")
    redis.start()
    gw: TestServer | None = None
    try:
        sim = await simulator()
        folder = write_config(tmp_path / "config", [{
            "name": "b0", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
            "models": [MODEL]}], policies={"tiers.toml": tiers()})
        gw = await aiohttp_server(build_app(load_config(folder), redis_url=redis.url))
        key = await new_key(redis.url, "basic")
        assert (await chat(gw, {"X-API-Key": key}))[0] == 200  # the key is now cached

        redis.kill()
        # The guest tier fails open to its small per-process limit (2/min) ...
        assert [(await chat(gw))[0] for _ in range(3)] == [200, 200, 429]
        # ... the basic tier fails closed.
        status, headers, body = await chat(gw, {"X-API-Key": key})
        assert status == 503 and headers["Retry-After"] and body["error"]["type"] == "unavailable"

        redis.start()  # same port, same AOF: the key is still there
        for _ in range(50):
            status, _, _ = await chat(gw, {"X-API-Key": key})
            if status == 200:
                break
            await asyncio.sleep(0.1)
        assert status == 200
    finally:
        if gw is not None:
            await gw.close()  # while its Redis runs: its cleanup would wait out a dead one
        redis.stop()


async def test_admin_api_reload_and_revocation(
    simulator: SimulatorFactory, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "admin-secret-token-for-tests")
    admin = {"Authorization": "Bearer admin-secret-token-for-tests"}
    gw = await gateway(await simulator(), policies={"tiers.toml": tiers(basic=2)})
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.make_url("/admin/keys"), headers=admin,
                                json={"account": "acme", "tier": "basic"}) as response:
            assert response.status == 201
            created = await response.json()
        async with session.post(gw.make_url("/admin/keys"),
                                json={"account": "acme", "tier": "basic"}) as response:
            assert response.status == 401
        assert (await chat(gw, {"X-API-Key": created["key"]}))[0] == 200

        # Reload: a bad file is refused and the old policy stays; a good one applies at once.
        tiers_file = tmp_path / "config" / "policies" / "tiers.toml"
        tiers_file.write_text(tiers(basic=2).replace("requests_per_minute = 2", "rpm = 2"))
        async with session.post(gw.make_url("/admin/reload"), headers=admin) as response:
            assert response.status == 422
            assert "policies/tiers.toml" in (await response.json())["error"]["message"]
        assert (await chat(gw, {"X-API-Key": created["key"]}))[0] == 200
        assert (await chat(gw, {"X-API-Key": created["key"]}))[0] == 429  # still 2/min
        tiers_file.write_text(tiers(basic=50))
        async with session.post(gw.make_url("/admin/reload"), headers=admin) as response:
            assert response.status == 200
        status, headers, _ = await chat(gw, {"X-API-Key": created["key"]})
        assert status == 200 and headers["X-RateLimit-Limit"] == "50"

        async with session.delete(gw.make_url(f"/admin/keys/{created['id']}"),
                                  headers=admin) as response:
            assert response.status == 200
        deadline = time.monotonic() + 1.0
        while (await chat(gw, {"X-API-Key": created["key"]}))[0] != 401:
            assert time.monotonic() < deadline, "revocation not seen within 1 s"
            await asyncio.sleep(0.02)


async def test_admin_role_jwt(simulator: SimulatorFactory, gateway: GatewayFactory,
                              jwt_secret: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_ADMIN_TOKEN", raising=False)
    gw = await gateway(await simulator(), policies={"auth.toml": AUTH_JWT})
    async with aiohttp.ClientSession() as session:
        for claims, expected in (({"role": "admin"}, 200), ({"role": "user"}, 401), ({}, 401)):
            async with session.get(gw.make_url("/admin/keys"), headers={
                    "Authorization": f"Bearer {token(**claims)}"}) as response:
                assert response.status == expected, claims


async def test_a_key_never_appears_in_logs(simulator: SimulatorFactory, gateway: GatewayFactory,
                                           caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    gw = await gateway(await simulator())
    canary = gw.api_key  # type: ignore[attr-defined]
    typo = canary[:-1] + ("x" if canary[-1] != "x" else "y")
    for headers in ({"X-API-Key": canary}, {"Authorization": f"Bearer {canary}"},
                    {"X-API-Key": typo}, {"X-API-Key": canary, "x-sim-status": "500"}):
        await chat(gw, headers)
        await chat(gw, headers, stream=True, temperature=9)
    assert caplog.records, "nothing was logged at all: the check would prove nothing"
    assert canary not in caplog.text and typo not in caplog.text
    assert canary[8:-6] not in caplog.text
