"""A stream cut before the engine's usage chunk is charged an estimate that is never below the
truth for the prompt: the engine got all of it, so it is charged at its upper bound."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from redis.asyncio import Redis

from proxy.appkeys import SETTLER
from proxy.credits.ledger import Ledger

MODEL = "acme/small-chat"
PRICES = """
version = "cut-v1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 1000
"""
# 10,000 punctuation tokens in 20,000 characters: a 4-characters-a-token guess halves it.
PROMPT = ". " * 10_000


async def _stream(gw: Any, headers: dict[str, str]) -> bytes:
    body = {"model": MODEL, "stream": True, "max_tokens": 16,
            "messages": [{"role": "user", "content": PROMPT}]}
    async with aiohttp.ClientSession() as session, session.post(
            gw.make_url("/v2/compat/v1/chat/completions"), json=body,
            headers={"X-API-Key": gw.api_key, **headers}) as response:
        assert response.status == 200
        return await response.read()


async def _last_charge(gw: Any, ledger: Ledger) -> dict[str, Any]:
    for _ in range(200):  # the settlement is queued after the answer
        await asyncio.sleep(0.01)
        if not gw.app[SETTLER].pending:
            break
    return [e for e in await ledger.all_entries("acct-test") if e["type"] == "charge"][-1]


async def test_a_cut_stream_charges_the_whole_prompt(simulator: Any, gateway: Any,
                                                     clean_redis: Any) -> None:
    gw = await gateway(await simulator(), policies={"prices.toml": PRICES})
    redis = Redis.from_url(clean_redis.url)
    ledger = Ledger(redis)
    try:
        await ledger.credit("acct-test", 10_000_000, {})
        await _stream(gw, {})
        whole = await _last_charge(gw, ledger)
        assert whole["status"] == "completed" and whole["estimated"] is False
        engine_count = whole["prompt_tokens"]  # the engine's own count, from its usage chunk
        assert engine_count > 10_000

        raw = await _stream(gw, {"x-sim-cut-after": "3"})
        assert b"upstream_error" in raw  # the client saw the cut
        cut = await _last_charge(gw, ledger)
        assert cut["status"] == "cut" and cut["estimated"] is True
        assert cut["prompt_tokens"] >= engine_count  # never a guess below the truth
        assert cut["cost"] <= cut["held"]
    finally:
        await redis.aclose()
