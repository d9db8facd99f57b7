"""Real engines under load: a full queue's 503 is retried on the other replica before the first
byte (and a busy replica is not taken for a broken one), and a client that leaves aborts its
request in the engine."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import ROUTER
from proxy.runtime.redis_process import RedisProcess
from tests.conftest import GatewayFactory, settled
from tests.credits.test_money import funded_key, journal
from tests.real_engine.conftest import backend
from tests.real_engine.engines import SERVED, Engines, Replica
from tests.real_engine.scrape import metrics, totals, wait_idle

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

SERVED_CHAT = "/v2/served/v1/chat/completions"
LONG_STREAM = {"model": SERVED, "messages": [{"role": "user", "content": "x"}], "stream": True,
               "max_tokens": 1000, "ignore_eos": True}
QUEUE = 8  # REPLICA_ARGS: --max-num-queued-reqs 8 (running and waiting)
REJECTED = "vllm:admission_rejections_total"


@pytest.fixture
async def gw(replicas: Engines, gateway: GatewayFactory) -> TestServer:
    server = await gateway(*(backend(r) for r in replicas.replicas))
    await wait_idle(replicas.replicas)
    return server


async def fill(session: aiohttp.ClientSession, replica: Replica) -> list[aiohttp.ClientResponse]:
    """Long streams straight to `replica` until its queue is full (it answers 503)."""
    streams = []
    for _ in range(QUEUE):
        response = await session.post(replica.url + "/v1/chat/completions", json=LONG_STREAM)
        assert response.status == 200
        streams.append(response)
    async with session.post(replica.url + "/v1/chat/completions", json={
            "model": SERVED, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
    }) as refused:
        assert refused.status == 503  # full: what the gateway will meet there
        assert "Retry-After" not in refused.headers
    return streams


async def test_a_full_queue_is_retried_on_the_other_replica_and_is_not_a_failure(
    gw: TestServer, replicas: Engines
) -> None:
    full, other = replicas[0], replicas[1]
    async with aiohttp.ClientSession() as direct, aiohttp.ClientSession() as client:
        streams = await fill(direct, full)
        before = (await metrics(full))[REJECTED]
        statuses = []
        for i in range(16):  # about half are picked for the full replica first
            async with client.post(gw.make_url(SERVED_CHAT), headers={
                    "Authorization": f"Bearer {gw.api_key}"}, json={  # type: ignore[attr-defined]
                    "model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "stream": i % 2 == 1}) as response:
                await response.read()
                statuses.append(response.status)
        rejected = (await metrics(full))[REJECTED] - before
        for stream in streams:
            stream.close()
    assert statuses == [200] * 16
    assert rejected >= 3  # it did meet the full queue, and no client saw it
    backends = {b.name: b for b in gw.app[ROUTER].backends}
    # Busy is not broken: the full replica was neither ejected nor counted as failing.
    assert backends[full.name].healthy and backends[full.name].health.consecutive_failures == 0
    assert backends[other.name].healthy


async def test_a_client_that_leaves_aborts_its_request_in_the_engine(
    replicas: Engines, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    gw = await gateway(*(backend(r) for r in replicas.replicas))
    key = await funded_key(clean_redis.url)
    await wait_idle(replicas.replicas)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as client:
        response = await client.post(gw.make_url(SERVED_CHAT), json=LONG_STREAM,
                                     headers={"Authorization": f"Bearer {key}"})
        assert response.status == 200
        content = 0
        async for line in response.content:
            if line.startswith(b"data: {") and b'"content":"' in line:
                content += 1
            if content >= 5:
                break
        running = await totals(replicas.replicas, "vllm:num_requests_running")
        assert running == {"vllm:num_requests_running": 1.0}  # ~1000 tokens still to come
        response.close()  # the client goes away
        left = loop.time()
    while (await totals(replicas.replicas, "vllm:num_requests_running")
           )["vllm:num_requests_running"]:
        assert loop.time() - left < 2.0, "the engine is still generating for a client that left"
        await asyncio.sleep(0.05)
    await settled(gw)
    [charge] = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    assert charge["status"] == "client_gone" and charge["estimated"]
    assert 5 <= charge["completion_tokens"] < 1000  # what was delivered, not the cap
