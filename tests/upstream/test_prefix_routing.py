"""The "prefix" pick end to end (proxy.upstream.prefixes, routing.by_first_token): a running
gateway in front of three vLLM simulators with prefix caches, streamed and whole answers.
Conversations that share a system prompt, and every later turn of one, find the replica that
holds them (the engines' own cached-token counts show it); the gateway learns the engines'
bytes per token from their usage, and reads each one's KV-cache size from its /metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import ROUTER
from proxy.upstream.prefixes import Prompt, prompt_of
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory, sim_requests

CHAT = "/v2/compat/v1/chat/completions"
SYSTEMS = [f"You are assistant number {i}. " + "Follow the house style. " * 60 for i in range(3)]


async def ask(gw: TestServer, messages: list[dict[str, str]], stream: bool) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url(CHAT), headers={"X-API-Key": gw.api_key},  # type: ignore[attr-defined]
            json={"model": MODEL, "messages": messages, "stream": stream,
                  "stream_options": {"include_usage": True}} if stream else
            {"model": MODEL, "messages": messages}) as response:
        assert response.status == 200, await response.text()
        if not stream:
            body: dict[str, Any] = await response.json()
            return body["usage"]
        usage: dict[str, Any] = {}
        async for line in response.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                chunk = orjson.loads(line[6:])
                usage = chunk.get("usage") or usage
        return usage


async def test_shared_prompts_and_later_turns_find_the_replica_that_holds_them(
    simulator: SimulatorFactory, gateway: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "ops")
    # Prefills as long as the gateway's shipped estimate (60 ms per 1,000 tokens).
    sims = [await simulator(kv_cache_blocks=4096, block_size=16, prefill_ms_per_1k_tokens=60,
                            prompt_tokens_details=True, default_completion_tokens=4)
            for _ in range(3)]
    gw = await gateway(*sims, routing={"pick": "prefix"})
    pool = gw.app[ROUTER].chat_pool(MODEL)
    assert pool.index is not None
    before = pool.index.chars_per_token
    conversations = []
    for round_ in range(3):
        for i, system in enumerate(SYSTEMS):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Question {round_} for {i}: " + "why? " * 20}]
            conversations.append(messages)
            await ask(gw, messages, stream=round_ % 2 == 0)
    # A later turn of the first conversation.
    later = [*conversations[0], {"role": "assistant", "content": "Because."},
             {"role": "user", "content": "And then? " * 20}]
    usage = await ask(gw, later, stream=False)
    await settled(gw)
    received = {i: [r["body"]["messages"][0]["content"] for r in await sim_requests(sim)]
                for i, sim in enumerate(sims)}
    # Every system prompt went to one replica only, and the later turn went with it.
    homes = {system: {i for i, seen in received.items() if system in seen} for system in SYSTEMS}
    assert [len(home) for home in homes.values()] == [1, 1, 1], {
        i: [s[:28] for s in seen] for i, seen in received.items()}
    assert sum(len(seen) for seen in received.values()) == 10
    first_home = next(iter(homes[SYSTEMS[0]]))
    assert len(received[first_home]) >= 4  # three rounds and the later turn
    # The engine found the earlier turn's blocks: all of that prompt but its last partial one.
    assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] / 2
    # Bytes per token came from the engines' usage (the simulator's tokens are words).
    seen = _prompt(later)
    assert seen is not None
    assert before < pool.index.chars_per_token <= seen.chars / usage["prompt_tokens"] + 0.2
    # Operators see the same picture in /admin/backends.
    async with aiohttp.ClientSession() as session, session.get(
            gw.make_url("/admin/backends"), headers={"Authorization": "Bearer ops"}) as r:
        view = (await r.json())["prefix_index"][pool.key]
    assert view["bytes_per_token"] == round(pool.index.chars_per_token, 2)
    held = {name: replica["blocks"] for name, replica in view["replicas"].items()}
    assert held[f"b{first_home}"] >= len(seen.blocks)


async def test_a_replica_with_a_full_batch_loses_the_prompt_and_both_then_hold_it(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    # One slot each: the holder busy with a slow answer, the next request of its prompt goes
    # to the other replica at once rather than waiting (late binding: the first free slot in
    # the order of expected first-token time).
    sims, gw = await one_slot_each(simulator, gateway, answer_tokens=20)
    messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "hi"}]
    await asyncio.gather(*(ask(gw, messages, stream=True) for _ in range(2)))
    counts = [len(await sim_requests(sim)) for sim in sims]
    assert counts == [1, 1], counts
    pool = gw.app[ROUTER].chat_pool(MODEL)
    assert pool.index is not None
    prompt = _prompt(messages)
    assert prompt is not None
    assert all(pool.index.matched(f"b{i}", prompt) > 0 for i in range(2))


async def test_a_busy_holder_worth_waiting_for_gets_the_request_when_its_slot_frees(
    simulator: SimulatorFactory, gateway: GatewayFactory
) -> None:
    # The same two one-slot replicas, but prefilling the prompt elsewhere now costs more than
    # the holder's wait (a prefill estimate of 3 s per 1,000 tokens against a 0.5 s answer):
    # the second request waits for the holder's slot rather than copying the prompt. Waiting,
    # it holds no place in the queue: another prompt takes the free replica meanwhile.
    sims, gw = await one_slot_each(simulator, gateway, answer_tokens=10,
                                   prefill_ms_per_1k_tokens=3000)
    messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "hi"}]
    first = asyncio.create_task(ask(gw, messages, stream=True))
    await asyncio.sleep(0.1)  # placed and running
    second = asyncio.create_task(ask(gw, messages, stream=True))
    await asyncio.sleep(0.05)
    other = asyncio.create_task(ask(gw, [{"role": "system", "content": SYSTEMS[1]},
                                         {"role": "user", "content": "hi"}], stream=True))
    done, _ = await asyncio.wait({second, other}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {other}  # it ran while the second waited for the holder
    await asyncio.gather(first, second)
    received = [[r["body"]["messages"][0]["content"] for r in await sim_requests(sim)]
                for sim in sims]
    assert sorted(received) == [[SYSTEMS[0]] * 2, [SYSTEMS[1]]], [len(r) for r in received]
    async with aiohttp.ClientSession() as session, session.get(gw.make_url("/metrics")) as r:
        text = await r.text()
    assert 'igw_prefix_holder_waits_total{model="acme/small-chat",outcome="holder"} 1.0' in text


async def one_slot_each(simulator: SimulatorFactory, gateway: GatewayFactory, *,
                        answer_tokens: int, **routing: Any) -> tuple[list[TestServer], TestServer]:
    """Two replicas of one slot each (answers of `answer_tokens` at 20 a second), behind a
    gateway routing by "prefix" (and `routing`)."""
    sims = [await simulator(ttft_ms=10, tokens_per_s=20, default_completion_tokens=answer_tokens)
            for _ in range(2)]
    backends = [{"name": f"b{i}", "kind": "vllm", "url": str(s.make_url("/")).rstrip("/"),
                 "models": [MODEL], "max_concurrency": 1} for i, s in enumerate(sims)]
    return sims, await gateway(*backends, routing={"pick": "prefix", **routing})


def _prompt(messages: list[dict[str, str]]) -> Prompt | None:
    return prompt_of({"model": MODEL, "messages": messages})
