"""Cached prompt tokens (issue 18): what the engine reports as
`usage.prompt_tokens_details.cached_tokens` reaches every style that has such a field (OpenAI
styles as sent, Anthropic as `cache_read_input_tokens`; Ollama has none), is charged at
`cached_prompt_per_1k_tokens` (the prompt price when unset) and is journaled."""

from __future__ import annotations

from typing import Any

import anthropic
import ollama
import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.config import Rates
from proxy.credits.pricing import ChatUsage, chat_cost, chat_hold, prompt_upper_bound, usage_from
from tests.support.accounts import funded_key, journal
from tests.support.config_files import MODEL
from tests.support.gateway import GatewayFactory, settled
from tests.support.upstreams import SimulatorFactory

LONG = [{"role": "user", "content": "word " * 100}]  # 104 tokens (simulator's rule)
PROMPT, CACHED = 104, 96  # a repeat hits in whole 16-token blocks, all but the last token
PRICES = """
version = "cache-v1"
[default]
prompt_per_1k_tokens = 1000
cached_prompt_per_1k_tokens = 100
completion_per_1k_tokens = 10000
"""


def test_cached_tokens_have_their_own_price_defaulting_to_the_prompt_price() -> None:
    rates = Rates(prompt_per_1k_tokens=1000, cached_prompt_per_1k_tokens=100,
                  completion_per_1k_tokens=10000)
    usage = ChatUsage(104, 16, cached_tokens=96)
    assert chat_cost(rates, usage) == 8 + 10 + 160  # (8 * 1000 + 96 * 100 + 16 * 10000) / 1000
    plain = Rates(prompt_per_1k_tokens=1000, completion_per_1k_tokens=10000)
    assert chat_cost(plain, usage) == chat_cost(plain, ChatUsage(104, 16))
    assert chat_cost(rates, ChatUsage(10, 0, cached_tokens=50)) == 1  # never more than prompt
    dearer = Rates(prompt_per_1k_tokens=100, cached_prompt_per_1k_tokens=1000)
    body = {"messages": LONG}
    assert chat_hold(dearer, body, 0) == prompt_upper_bound(body)  # the hold covers either


def test_usage_from_reads_cached_tokens() -> None:
    assert usage_from({"prompt_tokens": 10, "completion_tokens": 2,
                       "prompt_tokens_details": {"cached_tokens": 8}}) == ChatUsage(
        10, 2, cached_tokens=8)
    for details in (None, {}, {"cached_tokens": None}, {"cached_tokens": "8"},
                    {"cached_tokens": -1}, {"cached_tokens": True}, []):
        usage = usage_from({"prompt_tokens": 10, "completion_tokens": 2,
                            "prompt_tokens_details": details})
        assert usage == ChatUsage(10, 2)


@pytest.fixture
async def setup(simulator: SimulatorFactory, gateway: GatewayFactory, clean_redis: Any
                ) -> tuple[TestServer, str]:
    sim = await simulator(prompt_tokens_details=True, block_size=16)
    gw = await gateway(sim, policies={"prices.toml": PRICES})
    return gw, await funded_key(clean_redis.url)


async def assert_billed(redis_url: str, completion: int) -> None:
    charges = [e for e in await journal(redis_url) if e["type"] == "charge"]
    assert [e["cached_tokens"] for e in charges] == [0, CACHED]
    first, second = charges
    assert first["cost"] == PROMPT + completion * 10
    assert second["cost"] == -(-((PROMPT - CACHED) * 1000 + CACHED * 100
                                 + completion * 10000) // 1000)


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_styles_pass_cached_tokens(setup: tuple[TestServer, str], stream: bool,
                                                clean_redis: Any) -> None:
    gw, key = setup
    async with openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/compat/v1")), api_key=key,
                                  max_retries=0) as client:
        seen = []
        for _ in range(2):
            if stream:
                chunks = [c async for c in await client.chat.completions.create(
                    model=MODEL, messages=LONG, max_tokens=4, stream=True,  # type: ignore[arg-type]
                    stream_options={"include_usage": True})]
                usage = chunks[-1].usage
            else:
                usage = (await client.chat.completions.create(
                    model=MODEL, messages=LONG, max_tokens=4)).usage  # type: ignore[arg-type]
            assert usage is not None and usage.prompt_tokens_details is not None
            seen.append(usage.prompt_tokens_details.cached_tokens)
    assert seen == [0, CACHED]
    await settled(gw)
    await assert_billed(clean_redis.url, 4)


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_reads_them_as_cache_reads(setup: tuple[TestServer, str], stream: bool,
                                                   clean_redis: Any) -> None:
    gw, key = setup
    async with anthropic.AsyncAnthropic(base_url=str(gw.make_url("/v2/messages")), api_key=key,
                                        max_retries=0) as client:
        seen = []
        for _ in range(2):
            if stream:
                async with client.messages.stream(model=MODEL, max_tokens=4,
                                                  messages=LONG) as events:  # type: ignore[arg-type]
                    usage = (await events.get_final_message()).usage
            else:
                usage = (await client.messages.create(model=MODEL, max_tokens=4,
                                                      messages=LONG)).usage  # type: ignore[arg-type]
            seen.append((usage.input_tokens, usage.cache_read_input_tokens,
                         usage.cache_creation_input_tokens))
    # Anthropic counts the prompt in parts: fresh input, cache reads (and cache writes).
    assert seen == [(PROMPT, 0, 0), (PROMPT - CACHED, CACHED, 0)]
    await settled(gw)
    await assert_billed(clean_redis.url, 4)


async def test_ollama_has_no_such_field_but_is_billed_the_same(
    setup: tuple[TestServer, str], clean_redis: Any
) -> None:
    gw, key = setup
    async with ollama.AsyncClient(host=str(gw.make_url("/v2/native")),
                                  headers={"Authorization": f"Bearer {key}"}) as client:
        for _ in range(2):
            reply = await client.chat(model=MODEL, messages=LONG, options={"num_predict": 4})
            assert reply.prompt_eval_count == PROMPT  # the whole prompt, as Ollama counts it
    await settled(gw)
    await assert_billed(clean_redis.url, 4)
