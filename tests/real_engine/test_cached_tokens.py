"""Cached prompt tokens from a real vLLM (--enable-prompt-tokens-details, --block-size 32):
a repeated prompt hits the engine's prefix cache, the clients see it in their own field, and
the journal bills those tokens at the cached price."""

from __future__ import annotations

import uuid

import anthropic
import openai
import pytest

from proxy.store.redis_process import RedisProcess
from tests.support.accounts import funded_key, journal
from tests.support.gateway import GatewayFactory, settled
from tests.support.real_engines import SERVED, Engines, backend

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

PRICES = """
version = "real-cache-v1"
[default]
prompt_per_1k_tokens = 1000
cached_prompt_per_1k_tokens = 100
completion_per_1k_tokens = 10000
"""


async def test_a_repeated_prompt_is_billed_at_the_cached_price(
    replicas: Engines, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    # One replica: the prefix cache is per engine. A fresh prompt: earlier tests' cache misses.
    gw = await gateway(backend(replicas[0]), policies={"prices.toml": PRICES})
    key = await funded_key(clean_redis.url)
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "license terms " * 60}]
    async with openai.AsyncOpenAI(base_url=str(gw.make_url("/v2/compat/v1")), api_key=key,
                                  max_retries=0) as client:
        first = (await client.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=4)).usage  # type: ignore[arg-type]
        second = (await client.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=4)).usage  # type: ignore[arg-type]
    assert first is not None and second is not None
    assert first.prompt_tokens_details is not None and second.prompt_tokens_details is not None
    cached = second.prompt_tokens_details.cached_tokens or 0
    assert first.prompt_tokens_details.cached_tokens == 0
    assert cached > 0 and cached % 32 == 0 and cached < second.prompt_tokens  # whole blocks
    claude = anthropic.AsyncAnthropic(base_url=str(gw.make_url("/v2/messages")), api_key=key,
                                      max_retries=0)
    async with claude, claude.messages.stream(model=SERVED, max_tokens=4,
                                              messages=messages) as stream:  # type: ignore[arg-type]
        usage = (await stream.get_final_message()).usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (
        second.prompt_tokens - cached, cached)
    await settled(gw)
    charges = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    assert [e["cached_tokens"] for e in charges] == [0, cached, cached]
    for entry in charges:
        exact = ((entry["prompt_tokens"] - entry["cached_tokens"]) * 1000
                 + entry["cached_tokens"] * 100 + entry["completion_tokens"] * 10000)
        assert entry["cost"] == -(-exact // 1000)
