"""A real vLLM's KV-cache events (--kv-events-config, --num-gpu-blocks-override 256: a cache of
8,192 tokens) in the gateway's prefix index: the blocks the engine stores for the gateway's
requests are tied to the prompts that sent them (vLLM tags each with the request's
`session_id`), and a prompt the engine evicts for traffic the gateway never saw leaves the
index at once."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import pytest

from proxy.appkeys import ROUTER
from proxy.upstream.prefixes import prompt_of
from tests.support.gateway import GatewayFactory
from tests.support.real_engines import SERVED, Engines, backend

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

CHAT = "/v2/compat/v1/chat/completions"


def conversation(words: int = 110) -> list[dict[str, str]]:
    """A fresh prompt (earlier tests' cache misses): about 270 of the tiny model's tokens."""
    return [{"role": "system", "content": f"{uuid.uuid4().hex} " + "license terms " * words},
            {"role": "user", "content": "Summarise."}]


async def post(url: str, messages: list[dict[str, str]], headers: dict[str, str]
               ) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(
            url, headers=headers,
            json={"model": SERVED, "messages": messages, "max_tokens": 2}) as response:
        assert response.status == 200, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def test_the_index_ties_a_real_vllms_blocks_to_its_prompts_and_forgets_what_it_evicts(
    replicas: Engines, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "ops")
    engine = replicas[0]
    assert engine.events_url is not None
    gw = await gateway(backend(engine, kv_events=engine.events_url), routing={"pick": "prefix"})
    key = {"X-API-Key": gw.api_key}  # type: ignore[attr-defined]
    index = gw.app[ROUTER].chat_pool(SERVED).index
    assert index is not None

    async def view() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session, session.get(
                gw.make_url("/admin/backends"), headers={"Authorization": "Bearer ops"}) as r:
            found: dict[str, Any] = (await r.json())["data"][0]["kv_events"]
            return found

    # ZMQ joins asynchronously: requests until the engine's events are heard.
    for _ in range(50):
        await post(str(gw.make_url(CHAT)), conversation(20), key)
        if (await view())["index_blocks_mapped"]:
            break
        await asyncio.sleep(0.1)
    mine = conversation()
    prompt = prompt_of({"messages": mine})
    assert prompt is not None
    usage = (await post(str(gw.make_url(CHAT)), mine, key))["usage"]
    for _ in range(50):  # the events of that request, read
        if index.matched(engine.name, prompt) == len(prompt.blocks) and (
                await view())["stored"] * 32 >= usage["prompt_tokens"]:
            break
        await asyncio.sleep(0.1)
    seen = await view()
    assert seen["connected"] and seen["gaps"] == seen["restarts"] == 0, seen
    assert index.matched(engine.name, prompt) == len(prompt.blocks)
    # Other clients, straight to the engine: 40 such prompts overflow its 8,192 tokens.
    for _ in range(40):
        await post(f"{engine.url}/v1/chat/completions", conversation(), {})
    for _ in range(50):
        if index.matched(engine.name, prompt) == 0:
            break
        await asyncio.sleep(0.1)
    assert index.matched(engine.name, prompt) == 0, await view()
    assert (await view())["removed"] > 0
    # The engine agrees: it finds none of that prompt cached.
    again = await post(f"{engine.url}/v1/chat/completions", mine, {})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
