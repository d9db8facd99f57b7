"""Reading request bodies (proxy.http.body): JSON by Content-Type (415), in the documented check
order, and within the body deadline (408) (reliability.md I1, I2)."""

from __future__ import annotations

import asyncio
import socket
import struct

import aiohttp
import orjson
import pytest

from proxy.appkeys import METRICS
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


_FORM = (b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\nacme/large-v3\r\n'
         b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
         b"Content-Type: audio/wav\r\n\r\nRIFF")


@pytest.mark.parametrize(("route", "content_type", "body"), [
    ("/v2/compat/v1/chat/completions", "application/json", BODY),
    ("/v2/compat/v1/audio/transcriptions", "multipart/form-data; boundary=x", _FORM),
])
async def test_a_client_that_resets_mid_body_is_a_499_never_a_500(
        simulator: SimulatorFactory, gateway: GatewayFactory,
        caplog: pytest.LogCaptureFixture, route: str, content_type: str, body: bytes) -> None:
    """A client whose connection is reset while its body is still arriving has left: its
    request ends as 499 (client closed), never as an "unhandled error" 500, and nothing is
    sent upstream."""
    sim = await simulator()
    gw = await gateway(sim)
    for _ in range(20):
        _, writer = await connect(gw)
        writer.write(f"POST {route} HTTP/1.1\r\nHost: gw\r\nContent-Type: {content_type}\r\n"
                     f"X-API-Key: {gw.api_key}\r\n"  # type: ignore[attr-defined]
                     f"Content-Length: 100000\r\n\r\n".encode() + body)
        await writer.drain()
        await asyncio.sleep(0.01)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()  # with linger 0: a reset, not a FIN
    await asyncio.sleep(0.2)
    metrics = gw.app[METRICS]
    metrics.flush()
    assert metrics.errors.labels(route, "internal_error")._value.get() == 0
    tier = "max"  # the fixture's key
    assert metrics.requests.labels(route, "", tier, "499")._value.get() == 20
    assert not [r for r in caplog.records if "unhandled error" in r.getMessage()]
    assert await sim_requests(sim) == []
