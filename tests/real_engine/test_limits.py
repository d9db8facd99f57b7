"""The engine's own limits: its max_model_len, read from its /v1/models in the background, bounds
what the gateway asks for. A cap beyond the context is the gateway's 422 (nothing held, nothing
sent); a prompt beyond it is the engine's judgement relayed as a 400, never a 502; a request that
names no cap is capped within the context instead of failing."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import ROUTER
from proxy.credits.pricing import prompt_upper_bound
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import funded_key, journal
from tests.support.gateway import GatewayFactory, settled
from tests.support.real_engines import MAX_MODEL_LEN, SERVED, Engines, backend
from tests.support.vllm_metrics import totals, wait_idle

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

PRICES = """
version = "real-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""
HELLO = [{"role": "user", "content": "Hello"}]
LONG = [{"role": "user", "content": "license " * 1500}]  # about 1500 tokens: beyond 1024


def request(style: str, messages: list[dict[str, Any]], cap: int | None, stream: bool
            ) -> tuple[str, dict[str, Any], list[str]]:
    """(path, body, the body's cap field) for a chat request in `style`."""
    body: dict[str, Any] = {"model": SERVED, "messages": messages, "stream": stream}
    if style == "compat":
        if cap is not None:
            body["max_tokens"] = cap
        return "/v2/compat/v1/chat/completions", body, ["body", "max_tokens"]
    if style == "messages":
        body["max_tokens"] = cap or 16
        return "/v2/messages/v1/messages", body, ["body", "max_tokens"]
    if cap is not None:
        body["options"] = {"num_predict": cap}
    return "/v2/native/api/chat", body, ["body", "options", "num_predict"]


async def call(gw: TestServer, key: str, path: str, body: dict[str, Any]
               ) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(path), json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, await r.read()


@pytest.fixture
async def setup(replicas: Engines, gateway: GatewayFactory, clean_redis: RedisProcess
                ) -> tuple[TestServer, str]:
    gw = await gateway(*(backend(r) for r in replicas.replicas),
                       policies={"prices.toml": PRICES})
    await wait_idle(replicas.replicas)
    return gw, await funded_key(clean_redis.url)


async def test_max_model_len_is_read_from_each_engine_before_traffic(
    setup: tuple[TestServer, str]
) -> None:
    gw, _ = setup
    assert {b.name: b.max_model_len for b in gw.app[ROUTER].backends} == {
        "vllm-0": {SERVED: MAX_MODEL_LEN}, "vllm-1": {SERVED: MAX_MODEL_LEN}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("style", ["compat", "messages", "native"])
async def test_a_cap_beyond_the_context_is_422_and_reaches_no_engine(
    style: str, stream: bool, setup: tuple[TestServer, str], replicas: Engines,
    clean_redis: RedisProcess
) -> None:
    gw, key = setup
    before = await totals(replicas.replicas, "vllm:prompt_tokens_total")
    path, body, loc = request(style, HELLO, MAX_MODEL_LEN + 1, stream)
    status, raw = await call(gw, key, path, body)
    assert status == 422, raw
    detail = orjson.loads(raw)["detail"]
    assert [d["loc"] for d in detail] == [loc] and str(MAX_MODEL_LEN) in detail[0]["msg"]
    await settled(gw)
    assert await totals(replicas.replicas, "vllm:prompt_tokens_total") == before
    assert [e for e in await journal(clean_redis.url) if e["type"] == "charge"] == []


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("style", ["compat", "messages", "native"])
async def test_a_prompt_beyond_the_context_is_400_free_and_no_fault_of_the_engine(
    style: str, stream: bool, setup: tuple[TestServer, str], clean_redis: RedisProcess
) -> None:
    gw, key = setup
    path, body, _ = request(style, LONG, 8, stream)
    status, raw = await call(gw, key, path, body)
    assert status == 400, raw
    assert b"maximum context length is 1024 tokens" in raw
    await settled(gw)
    [charge] = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    # The engine refused the request itself: the client's fault, not the engine's (nor its cost).
    assert charge["cost"] == 0 and charge["status"] == "client_error"
    for b in gw.app[ROUTER].backends:  # the engine judged a bad request: alive and well
        assert b.healthy and b.health.consecutive_failures == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_without_a_cap_is_capped_within_the_context(
    stream: bool, setup: tuple[TestServer, str], clean_redis: RedisProcess
) -> None:
    gw, key = setup
    # ignore_eos (a vLLM extension, on the served route): the answer runs to the cap.
    body = {"model": SERVED, "messages": HELLO, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, raw = await call(gw, key, "/v2/served/v1/chat/completions", body)
    assert status == 200, raw[:300]
    if stream:
        events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")]
        usage = orjson.loads(events[-1])["usage"]
        finish = [orjson.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]][-1]
    else:
        answer = orjson.loads(raw)
        usage, finish = answer["usage"], answer["choices"][0]["finish_reason"]
    # The engine stops at its context: prompt and completion fill it exactly.
    assert finish == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    await settled(gw)
    [charge] = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    assert charge["completion_tokens"] == usage["completion_tokens"]
    # Held for the context (10 micro-credits a completion token), not default_max_tokens (4096).
    assert charge["held"] == prompt_upper_bound(body) + MAX_MODEL_LEN * 10
