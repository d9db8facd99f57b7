"""Bad input gets a clear 4xx in the documented shape and never reaches an upstream."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.support.chat import CHAT, HELLO, client_for, post
from tests.support.config_files import GENEROUS_TIERS, MODEL
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import SimulatorFactory, sim_requests


@pytest.fixture
async def setup(simulator: SimulatorFactory, gateway: GatewayFactory) -> Any:
    sim = await simulator()
    gw = await gateway(sim, policies={"requests.toml": "[chat]\nmax_body_bytes = 2048\n"})
    return sim, gw


@pytest.mark.parametrize(("raw", "message"), [
    (b"{not json", "request body is not valid JSON"),
    (b"", "request body is not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object"),
    (b'"text"', "request body must be a JSON object"),
    (b"\xff\xfe", "request body is not valid JSON"),
    (b"[" * 5000 + b"]" * 5000, "request body is not valid JSON"),
])
async def test_not_json_is_400(setup: Any, raw: bytes, message: str) -> None:
    sim, gw = setup
    status, _, body = await post(gw, None, raw=raw[:2048])
    assert status == 400
    assert orjson.loads(body) == {"detail": message,
                                  "error": {"type": "invalid_json", "message": message}}
    assert await sim_requests(sim) == []


async def test_body_over_cap_is_413_declared_or_chunked(setup: Any) -> None:
    sim, gw = setup
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4096}]}
    status, _, body = await post(gw, big)
    assert status == 413 and orjson.loads(body)["error"]["type"] == "payload_too_large"

    async def chunks() -> Any:
        for _ in range(10):
            yield b" " * 512  # no Content-Length: counted as it arrives

    async with aiohttp.ClientSession() as session, session.post(
        gw.make_url(CHAT), data=chunks(),
        headers={"Content-Type": "application/json"}) as response:
        assert response.status == 413
    assert await sim_requests(sim) == []


async def test_validation_error_shape_through_the_gateway(setup: Any) -> None:
    sim, gw = setup
    status, _, raw = await post(gw, {"model": MODEL, "messages": HELLO, "temperature": 3,
                                     "n": 0, "surprise": 1})
    body = orjson.loads(raw)
    assert status == 422
    assert body["detail"] == [
        {"loc": ["body", "temperature"], "msg": "Input should be less than or equal to 2",
         "type": "less_than_equal"},
        {"loc": ["body", "n"], "msg": "Input should be greater than or equal to 1",
         "type": "greater_than_equal"},
        {"loc": ["body", "surprise"], "msg": "Extra inputs are not permitted",
         "type": "extra_forbidden"},
    ]
    assert body["error"]["type"] == "validation_error" and body["error"]["message"]
    assert await sim_requests(sim) == []


async def test_openai_client_raises_unprocessable_entity(setup: Any) -> None:
    _, gw = setup
    async with client_for(gw) as client:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await client.chat.completions.create(model=MODEL, messages=HELLO, top_logprobs=3)
    assert "top_logprobs" in str(caught.value.body)


@pytest.mark.parametrize(("body", "status", "kind"), [
    ({"model": "acme/nope", "messages": HELLO}, 404, "not_found"),
    ({"model": MODEL, "messages": HELLO, "mode": "network"}, 404, "not_found"),
])
async def test_route_level_refusals(setup: Any, body: dict[str, Any], status: int, kind: str
                                    ) -> None:
    sim, gw = setup
    got, _, raw = await post(gw, body)
    assert got == status and orjson.loads(raw)["error"]["type"] == kind
    assert await sim_requests(sim) == []


async def test_unknown_route_and_method(setup: Any) -> None:
    _, gw = setup
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.make_url("/v2/nowhere")) as response:
            assert response.status == 404
            assert (await response.json())["error"]["type"] == "not_found"
        async with session.get(gw.make_url(CHAT)) as response:
            assert response.status == 405
            assert (await response.json())["error"]["type"] == "method_not_allowed"
            assert "POST" in response.headers["Allow"]


@pytest.mark.parametrize("dispatch", [False, True])
async def test_no_available_backend_is_fast_503(simulator: SimulatorFactory,
                                                gateway: GatewayFactory, dispatch: bool) -> None:
    """Without the dispatcher each worker answers 503 past a backend's cap; with it, a tier
    that may not wait (max_queue_wait_s = 0) gets 503 pool_saturated at once."""
    sim = await simulator("vllm", tokens_per_s=5)
    gw = await gateway({"name": "one", "kind": "vllm", "url": str(sim.make_url("/")).rstrip("/"),
                        "models": [MODEL], "max_concurrency": 1},
                       routing={"dispatch": dispatch},
                       policies={"tiers.toml": GENEROUS_TIERS.replace(
                           '[tiers.max]', 'max_queue_wait_s = 0\n\n[tiers.max]')})
    async with aiohttp.ClientSession() as session:
        first = await session.post(gw.make_url(CHAT), json={"model": MODEL, "messages": HELLO,
                                                            "stream": True})
        await first.content.readline()  # the one slot is now taken
        status, headers, raw = await post(gw, {"model": MODEL, "messages": HELLO})
        first.close()
    assert status == 503 and int(headers["Retry-After"]) >= 1
    error = orjson.loads(raw)["error"]
    if dispatch:
        assert error["type"] == "pool_saturated" and "would wait" in error["message"]
    else:
        assert "concurrency limit" in error["message"]


async def test_openapi_document_describes_the_chat_route(setup: Any) -> None:
    _, gw = setup
    async with aiohttp.ClientSession() as session, session.get(
        gw.make_url("/v2/openapi.json")) as response:
        doc = await response.json()
    assert doc["openapi"].startswith("3.1")
    operation = doc["paths"]["/v2/compat/v1/chat/completions"]["post"]
    assert "422" in operation["responses"]
    schemas = doc["components"]["schemas"]
    assert "ChatRequest" in schemas and "temperature" in schemas["ChatRequest"]["properties"]
    assert {"/v2/served/v1/chat/completions", "/v2/messages/v1/messages", "/v2/native/api/chat",
            "/v2/models", "/v2/account", "/v2/account/usage"} <= set(doc["paths"])
    assert {"MessagesRequest", "OllamaChatRequest", "ServedChatRequest"} <= set(schemas)
    from openapi_spec_validator import validate

    validate(doc)


async def test_health_endpoints(setup: Any) -> None:
    _, gw = setup
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.make_url("/healthz")) as response:
            assert response.status == 200
        async with session.get(gw.make_url("/readyz")) as response:
            assert response.status == 200
            checks = (await response.json())["checks"]
            assert checks["redis"] is True and checks["backends"] is True


async def test_502s_and_cut_streams_are_logged(
    simulator: SimulatorFactory, gateway: GatewayFactory, caplog: pytest.LogCaptureFixture
) -> None:
    gw = await gateway(await simulator())
    caplog.set_level("WARNING")
    status, headers, _ = await post(gw, {"model": MODEL, "messages": HELLO},
                                    headers={"x-sim-status": "500"})
    assert status == 502
    request_id = {k.lower(): v for k, v in headers.items()}["x-request-id"]
    assert f"-> 502 upstream_error (request {request_id})" in caplog.text
    status, headers, _ = await post(gw, {"model": MODEL, "messages": HELLO, "stream": True},
                                    headers={"x-sim-cut-after": "4"})
    assert status == 200
    request_id = {k.lower(): v for k, v in headers.items()}["x-request-id"]
    assert f"ended cut after 3 content chunk(s) (request {request_id})" in caplog.text
