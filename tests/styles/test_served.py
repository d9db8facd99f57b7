"""The vLLM-style served route (official openai client) and the model list."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.support.chat import HELLO
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory
from tests.support.upstreams import SimulatorFactory, sim_requests

BIG = "acme/gpt-oss-120b"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]


def served_client(gw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/served/v1")), api_key=gw.api_key,
                              max_retries=0)


async def test_served_route_forwards_vllm_extras_and_reasoning(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator("vllm")
    gw = await gateway(sim)
    async with served_client(gw) as client:
        reply = await client.chat.completions.create(
            model=MODEL, messages=HELLO, extra_body={
                "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                "chat_template_kwargs": {"enable_thinking": True}})
        stream = await client.chat.completions.create(
            model=MODEL, messages=HELLO, stream=True,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        chunks = [c async for c in stream]
    sent = (await sim_requests(sim))[0]["body"]
    assert sent["top_k"] == 5 and sent["chat_template_kwargs"] == {"enable_thinking": True}
    assert (reply.choices[0].message.model_extra or {}).get("reasoning")
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or ""
                        for c in chunks if c.choices)
    assert reasoning and reply.usage is not None
    assert reply.usage.completion_tokens == 16 + 8  # reasoning counts in completion tokens


async def test_served_route_strips_vllm_extras_for_other_backends(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    sim = await simulator("tgi")
    gw = await gateway(sim, kind="tgi")
    async with served_client(gw) as client:
        await client.chat.completions.create(model=MODEL, messages=HELLO,
                                             extra_body={"top_k": 5, "ignore_eos": True})
    sent = (await sim_requests(sim))[0]["body"]
    assert "top_k" not in sent and "ignore_eos" not in sent


async def test_served_route_refuses_unknown_and_bad_extras(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    gw = await gateway(await simulator())
    async with served_client(gw) as client:
        with pytest.raises(openai.UnprocessableEntityError) as caught:
            await client.chat.completions.create(
                model=MODEL, messages=HELLO, extra_body={"top_kk": 5, "min_p": 3})
    detail = caught.value.response.json()["detail"]
    assert {tuple(item["loc"]) for item in detail} == {("body", "min_p"), ("body", "top_kk")}


@pytest.mark.parametrize("route", ["/v2/compat/v1", "/v2/served/v1"])
async def test_streamed_tool_calls_assemble_in_the_openai_client(
    route: str, simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    gw = await gateway(await simulator("vllm"))
    async with openai.AsyncOpenAI(base_url=str(gw.make_url(route)), api_key=gw.api_key,
                                  max_retries=0) as client, client.chat.completions.stream(
            model=MODEL, messages=HELLO, tools=TOOLS) as stream:
        final = await stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and '"city"' in call.function.arguments
    assert final.choices[0].finish_reason == "tool_calls"


async def test_model_list(simulator: SimulatorFactory, gateway: GatewayFactory) -> None:
    sim = await simulator(models=(MODEL, BIG))
    tiers = """
[groups]
large-chat = ["acme/gpt-oss-120b"]
[tiers.guest]
requests_per_minute = 5
families = ["chat"]
models = { "*" = ["direct"] }
[tiers.basic]
requests_per_minute = 5
families = ["chat"]
models = { standard = ["direct"] }
"""
    prices = f'version = "v9"\n[models."{BIG}"]\ncompletion_per_1k_tokens = 2400\n'
    gw = await gateway(sim, models=(MODEL, BIG),
                       policies={"tiers.toml": tiers, "prices.toml": prices})
    async with aiohttp.ClientSession() as session:
        async with session.get(gw.make_url("/v2/models")) as response:
            listing = await response.json()
        async with session.get(gw.make_url("/v2/models"),
                               headers={"X-API-Key": "igw_sk_bad"}) as response:
            assert response.status == 401
    models = {m["id"]: m for m in listing["data"]}
    assert listing["object"] == "list" and set(models) == {MODEL, BIG}
    big = models[BIG]
    assert big["task_family"] == "chat" and big["modes"] == ["direct"]
    assert big["resource"] == f"direct.compat.{BIG}" and big["healthy"] is True
    assert big["tiers"] == {"direct": ["guest"]} and models[MODEL]["tiers"]["direct"] == [
        "guest", "basic"]
    assert big["price"] == {"unit": "micro-credits", "version": "v9",
                            "completion_per_1k_tokens": 2400}
