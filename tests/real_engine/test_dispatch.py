"""The dispatcher in front of two real vLLM replicas (batch of 4 each, `max_concurrency` 4 in
backends.toml, and as shipped one more request queued in each engine: `[routing] engine_queue`):
a Basic burst three times what they run at once waits in the gateway, not in the engines' own
queues (one in each at most), and a Max request sent after it runs before the Basic requests
still waiting in the gateway."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from proxy.store.redis_process import RedisProcess
from tests.support.accounts import funded_key, new_key
from tests.support.gateway import GatewayFactory
from tests.support.real_engines import SERVED, Engines, backend
from tests.support.vllm_metrics import metrics, wait_idle

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

SERVED_CHAT = "/v2/served/v1/chat/completions"
BATCH = 4  # REPLICA_ARGS: --max-num-seqs 4
TIERS = "".join(f"""
[tiers.{name}]
requests_per_minute = 10000
families = ["chat"]
models = {{ "*" = ["direct"] }}
priority = {priority}
max_queue_wait_s = 120
""" for name, priority in [("guest", 0), ("basic", 1), ("pro", 2), ("max", 3)])


async def test_max_runs_before_a_waiting_basic_burst_and_the_engines_never_queue(
    replicas: Engines, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    gw = await gateway(*(backend(r, max_concurrency=BATCH) for r in replicas.replicas),
                       policies={"tiers.toml": TIERS})
    keys = {}
    for tier in ("basic", "max"):
        keys[tier] = await new_key(clean_redis.url, tier, account=f"acct-{tier}")
        await funded_key(clean_redis.url, account=f"acct-{tier}")
    await wait_idle(replicas.replicas)
    first_token: dict[str, float] = {}

    async def ask(tier: str, name: str) -> int:
        async with aiohttp.ClientSession() as session, session.post(
                gw.make_url(SERVED_CHAT), headers={"Authorization": f"Bearer {keys[tier]}"},
                json={"model": SERVED, "messages": [{"role": "user", "content": name}],
                      "stream": True, "max_tokens": 500, "ignore_eos": True}) as response:
            async for line in response.content:
                if b'"content":"' in line and name not in first_token:
                    first_token[name] = time.monotonic()
            return response.status

    waiting_seen = 0.0
    done = asyncio.Event()

    async def watch() -> None:  # the engines' own queues, while the burst lasts
        nonlocal waiting_seen
        while not done.is_set():
            for replica in replicas.replicas:
                waiting_seen = max(waiting_seen,
                                   (await metrics(replica))["vllm:num_requests_waiting"])
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    burst = [asyncio.create_task(ask("basic", f"basic {i}")) for i in range(3 * BATCH)]
    await asyncio.sleep(0.5)  # eight run, one waits in each engine, two in the gateway
    top = asyncio.create_task(ask("max", "max"))
    statuses = await asyncio.gather(*burst, top)
    done.set()
    await watcher
    assert statuses == [200] * (3 * BATCH + 1)
    after_max = [n for n, at in first_token.items()
                 if n.startswith("basic") and at > first_token["max"]]
    in_gateway = 3 * BATCH - 2 * (BATCH + 1)
    assert len(after_max) >= in_gateway, sorted(first_token.items(), key=lambda kv: kv[1])
    assert waiting_seen <= 1  # at most one in flight beyond the slots, never the burst
