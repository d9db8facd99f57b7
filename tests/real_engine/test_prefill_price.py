"""A real vLLM's prefill figures, read and fitted as the gateway's workers do
(proxy.upstream.signals, proxy.upstream.prefill_price): the engine's own histograms give a
price per prompt token once its requests' lengths differ, below the sums' plain ratio (which
counts each request's fixed step too)."""

from __future__ import annotations

import uuid

import aiohttp
import pytest

from proxy.upstream.prefill_price import PrefillFit
from proxy.upstream.signals import parse_signals
from tests.support.real_engines import SERVED, Engines

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]


async def test_a_real_vllms_prefill_price_is_fitted_from_its_figures(replicas: Engines) -> None:
    engine = replicas[1]
    fit = PrefillFit()
    async with aiohttp.ClientSession() as session:
        async def read() -> None:
            async with session.get(f"{engine.url}/metrics") as r:
                signals = parse_signals("vllm", await r.text(), 0.0)
            assert signals is not None and signals.prefill is not None
            fit.take(signals.prefill)

        await read()
        first = fit.last
        for n in range(30):  # fresh prompts of ~15 to ~700 tokens, one read after each
            words = 5 + (n * 97) % 280
            body = {"model": SERVED, "max_tokens": 1, "messages": [
                {"role": "user", "content": f"{uuid.uuid4().hex} " + "license terms " * words}]}
            async with session.post(f"{engine.url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
            await read()
    assert first is not None and fit.last is not None
    assert fit.last.requests - first.requests == 30
    ratio = (fit.last.seconds - first.seconds) / (fit.last.tokens - first.tokens)
    assert fit.per_token_s is not None and fit.fixed_s is not None
    assert 0 < fit.per_token_s < ratio  # the fixed step taken out
    assert 0 <= fit.fixed_s < 1.0
