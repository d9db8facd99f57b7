"""Reading request bodies (proxy.http.body): JSON by Content-Type (415), in the documented check
order, and within the body deadline (408) (reliability.md I1, I2)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from tests.support.chat import CHAT, HELLO
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory
from tests.support.raw_http import connect, error_type, read_response
from tests.support.upstreams import SimulatorFactory, sim_requests

BODY = orjson.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 4})
JSON_ROUTES = ["/v2/compat/v1/chat/completions", "/v2/served/v1/chat/completions",
               "/v2/messages/v1/messages", "/v2/native/api/chat", "/api/native/chat",
               "/v2/native/api/show"]
ONE_GUEST_REQUEST = """
[tiers.guest]
requests_per_minute = 1
families = ["chat"]
models = { "*" = ["direct"] }
"""


async def _post(url: str, headers: dict[str, str], body: bytes = BODY
                ) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession(skip_auto_headers=["Content-Type"]) as session, \
            session.post(url, data=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


@pytest.mark.parametrize("content_type", [
    None, "text/plain", "application/x-www-form-urlencoded", "application/xml",
    "multipart/form-data; boundary=x", "application/jsonl", "application/json-patch",
    "text/json",
])
async def test_a_json_route_refuses_other_media_types_with_415(
    simulator: SimulatorFactory, gateway: GatewayFactory, content_type: str | None
) -> None:
    sim = await simulator()
    gw = await gateway(sim)
    headers = {"X-API-Key": gw.api_key}  # type: ignore[attr-defined]
    if content_type is not None:
        headers["Content-Type"] = content_type
    status, _, body = await _post(str(gw.make_url(CHAT)), headers)
    assert status == 415 and error_type(body) == "unsupported_media_type"
    assert await sim_requests(sim) == []


async def test_every_json_route_checks_the_media_type_and_json_types_pass(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator()
    gw = await gateway(sim)
    key = {"X-API-Key": gw.api_key}  # type: ignore[attr-defined]
    for route in JSON_ROUTES:
        status, headers, _ = await _post(str(gw.make_url(route)),
                                         {**key, "Content-Type": "text/plain"})
        assert status == 415, route
        assert headers["Content-Type"] == "application/json"
    for content_type in ("application/json", "application/json; charset=utf-8",
                         "Application/JSON", "application/vnd.api+json"):
        status, _, _ = await _post(str(gw.make_url(CHAT)), {**key, "Content-Type": content_type})
        assert status == 200, content_type


async def test_auth_and_rate_limit_come_before_the_media_type(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator()
    gw = await gateway(sim, policies={"tiers.toml": ONE_GUEST_REQUEST})
    url = str(gw.make_url(CHAT))
    status, _, _ = await _post(url, {"X-API-Key": "igw_sk_nope", "Content-Type": "text/plain"})
    assert status == 401
    status, _, _ = await _post(url, {"Content-Type": "text/plain"})  # a guest's one request
    assert status == 415
    status, _, _ = await _post(url, {"Content-Type": "text/plain"})
    assert status == 429


async def test_a_415_reads_no_body(gateway: GatewayFactory) -> None:
    gw = await gateway()
    reader, writer = await connect(gw)
    # A body is announced but never sent: the answer must not wait for it.
    writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: text/plain\r\n"
                 f"Content-Length: 100000\r\n\r\n".encode())
    status, _, body = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert status == 415 and error_type(body) == "unsupported_media_type"


async def test_a_body_that_does_not_arrive_in_time_gets_408(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator()
    gw = await gateway(sim, server={"body_timeout_s": 1.0})
    reader, writer = await connect(gw)
    loop = asyncio.get_running_loop()
    writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 f"X-API-Key: {gw.api_key}\r\n"  # type: ignore[attr-defined]
                 f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:10])
    sent = loop.time()
    status, headers, body = await asyncio.wait_for(read_response(reader), 1.0 + 2.0)
    writer.close()
    assert loop.time() - sent > 0.5
    assert status == 408 and headers["connection"] == "close"
    assert error_type(body) == "request_timeout"
    assert await sim_requests(sim) == []
