"""The three official clients (and OpenAI's Responses API) through the gateway to two real
vLLM replicas, streamed and not, called as a new user calls them (no completion cap where the
client needs none); the journal bills exactly the usage the engines report, counted by the
engines' own /metrics."""

from __future__ import annotations

from typing import Any

import anthropic
import ollama
import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.store.redis_process import RedisProcess
from tests.support.accounts import funded_key, journal
from tests.support.gateway import GatewayFactory, settled
from tests.support.real_engines import SERVED, Engines, backend
from tests.support.vllm_metrics import totals, wait_idle

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

HELLO = [{"role": "user", "content": "Say hello to the world."}]
PROMPT, GENERATED = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
# Shipped defaults except the prices: a request without a cap holds default_max_tokens (4096),
# far beyond this engine's 1024-token context.
PRICES = """
version = "real-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 10000
"""


@pytest.fixture
async def setup(replicas: Engines, gateway: GatewayFactory, clean_redis: RedisProcess
                ) -> tuple[TestServer, str]:
    gw = await gateway(*(backend(r) for r in replicas.replicas),
                       policies={"prices.toml": PRICES})
    await wait_idle(replicas.replicas)
    return gw, await funded_key(clean_redis.url)


async def openai_calls(gw: TestServer, key: str) -> list[tuple[int, int]]:
    async with openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/compat/v1")), api_key=key,
                                  max_retries=0) as client:
        reply = await client.chat.completions.create(model=SERVED, messages=HELLO)  # type: ignore[arg-type]
        assert reply.choices[0].message.content and reply.usage is not None
        assert reply.choices[0].finish_reason in ("stop", "length")
        stream = await client.chat.completions.create(
            model=SERVED, messages=HELLO, stream=True, max_tokens=24,  # type: ignore[arg-type]
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage is not None and not chunks[-1].choices
    assert usage.completion_tokens <= 24
    return [(reply.usage.prompt_tokens, reply.usage.completion_tokens),
            (usage.prompt_tokens, usage.completion_tokens)]


async def anthropic_calls(gw: TestServer, key: str) -> list[tuple[int, int]]:
    def prompt(usage: Any) -> int:  # Anthropic counts cache reads apart from input_tokens
        return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))

    async with anthropic.AsyncAnthropic(base_url=str(gw.make_url("/v2/messages")), api_key=key,
                                        max_retries=0) as client:
        message = await client.messages.create(model=SERVED, max_tokens=24, messages=HELLO)  # type: ignore[arg-type]
        assert message.content and message.stop_reason in ("end_turn", "max_tokens")
        async with client.messages.stream(model=SERVED, max_tokens=24, messages=HELLO) as stream:  # type: ignore[arg-type]
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
    assert text and final.usage.output_tokens > 0
    return [(prompt(message.usage), message.usage.output_tokens),
            (prompt(final.usage), final.usage.output_tokens)]


async def ollama_calls(gw: TestServer, key: str) -> list[tuple[int, int]]:
    async with ollama.AsyncClient(host=str(gw.make_url("/v2/native")),
                                  headers={"Authorization": f"Bearer {key}"}) as client:
        reply = await client.chat(model=SERVED, messages=HELLO)
        assert reply.message.content and reply.done
        parts = [part async for part in await client.chat(
            model=SERVED, messages=HELLO, stream=True, options={"num_predict": 24})]
    last = parts[-1]
    assert last.done and "".join(p.message.content or "" for p in parts)
    assert reply.prompt_eval_count and reply.eval_count and last.prompt_eval_count
    assert last.eval_count
    return [(reply.prompt_eval_count, reply.eval_count),
            (last.prompt_eval_count, last.eval_count)]


async def responses_calls(gw: TestServer, key: str) -> list[tuple[int, int]]:
    """The Responses API (client.responses), answered through the chat path."""
    async with openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/compat/v1")), api_key=key,
                                  max_retries=0) as client:
        reply = await client.responses.create(model=SERVED, input=HELLO[0]["content"],
                                              max_output_tokens=24)
        assert reply.output_text and reply.usage is not None
        stream = await client.responses.create(model=SERVED, input=HELLO[0]["content"],
                                               max_output_tokens=24, stream=True)
        events = [event async for event in stream]
        # With tools: the engine (hermes parser) decides; a tiny random model never calls one,
        # so what comes back is its text, the tool's schema accepted by vLLM on the way.
        tooled = await client.responses.create(
            model=SERVED, input="What is the weather in Paris?", max_output_tokens=16,
            tools=[{"type": "function", "name": "get_weather", "strict": False,
                    "parameters": {"type": "object", "required": ["unit"],
                                   "properties": {"unit": {"type": "string",
                                                           "enum": ["c", "f"]}}}}])
        assert tooled.usage is not None and tooled.output
        assert {item.type for item in tooled.output} <= {"message", "function_call"}
    final = events[-1].response  # type: ignore[union-attr]
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and final.output_text == text and final.usage is not None
    return [(reply.usage.input_tokens, reply.usage.output_tokens),
            (final.usage.input_tokens, final.usage.output_tokens),
            (tooled.usage.input_tokens, tooled.usage.output_tokens)]


CLIENTS = {"openai": openai_calls, "anthropic": anthropic_calls, "ollama": ollama_calls,
           "responses": responses_calls}


@pytest.mark.parametrize("client", sorted(CLIENTS))
async def test_official_client_streamed_and_not_billed_exactly_the_engines_usage(
    client: str, setup: tuple[TestServer, str], replicas: Engines, clean_redis: RedisProcess
) -> None:
    gw, key = setup
    before = await totals(replicas.replicas, PROMPT, GENERATED)
    seen = await CLIENTS[client](gw, key)
    await settled(gw)
    after = await totals(replicas.replicas, PROMPT, GENERATED)
    charges = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    # What the clients were told is what the journal bills ...
    assert sorted((e["prompt_tokens"], e["completion_tokens"]) for e in charges) == sorted(seen)
    assert all(e["status"] == "completed" and not e["estimated"] for e in charges)
    # ... is what the engines say they did, by their own counters ...
    assert after[PROMPT] - before[PROMPT] == sum(p for p, _ in seen)
    assert after[GENERATED] - before[GENERATED] == sum(c for _, c in seen)
    # ... at the price list's rates, rounded up once per request.
    for entry in charges:
        exact = entry["prompt_tokens"] * 1000 + entry["completion_tokens"] * 10000
        assert entry["cost"] == -(-exact // 1000)

