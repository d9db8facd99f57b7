"""Real engines under load: a full queue's 503 is retried on the other replica before the first
byte (and a busy replica is not taken for a broken one), and a client that leaves aborts its
request in the engine."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.appkeys import ROUTER
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import funded_key, journal
from tests.support.gateway import GatewayFactory, settled
from tests.support.real_engines import SERVED, Engines, Replica, backend
from tests.support.vllm_metrics import metrics, totals, wait_idle

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(240, func_only=True)]

SERVED_CHAT = "/v2/served/v1/chat/completions"
LONG_STREAM = {"model": SERVED, "messages": [{"role": "user", "content": "x"}], "stream": True,
               "max_tokens": 1000, "ignore_eos": True}
QUEUE = 8  # REPLICA_ARGS: --max-num-queued-reqs 8 (running and waiting)
REJECTED = "vllm:admission_rejections_total"
RUNNING, GENERATED = "vllm:num_requests_running", "vllm:generation_tokens_total"


@pytest.fixture
async def gw(replicas: Engines, gateway: GatewayFactory) -> TestServer:
    server = await gateway(*(backend(r) for r in replicas.replicas))
    await wait_idle(replicas.replicas)
    return server


async def consume(response: aiohttp.ClientResponse, seen: list[bytes] | None = None) -> None:
    """Read a stream as a live client does. (vLLM misses a client that stopped reading and
    then left: it would generate to the end.)"""
    async for line in response.content:
        if seen is not None and line.startswith(b"data: {") and b'"content":"' in line:
            seen.append(line)


@contextlib.asynccontextmanager
async def kept_full(replica: Replica) -> AsyncIterator[None]:
    """`replica`'s queue kept full: QUEUE long non-streamed requests straight to it, each
    sent again when it ends (a client that leaves one aborts it, as vLLM does)."""
    body = {**LONG_STREAM, "stream": False}
    stop = asyncio.Event()

    async def keep(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with session.post(replica.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                if r.status == 503:  # a gateway request took the slot meanwhile
                    await asyncio.sleep(0.05)

    async with aiohttp.ClientSession() as session:
        keepers = [asyncio.create_task(keep(session)) for _ in range(QUEUE)]
        try:
            await until([replica], "vllm:num_requests_waiting", QUEUE - 4)  # 4 run, 4 wait
            async with session.post(replica.url + "/v1/chat/completions", json={
                    "model": SERVED, "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 2}) as refused:
                assert refused.status == 503  # full: what the gateway will meet there
                assert "Retry-After" not in refused.headers
            yield
        finally:
            stop.set()
            for keeper in keepers:
                keeper.cancel()
            await asyncio.gather(*keepers, return_exceptions=True)


async def test_a_full_queue_is_retried_on_the_other_replica_and_is_not_a_failure(
    gw: TestServer, replicas: Engines
) -> None:
    busy, other = replicas[0], replicas[1]
    statuses: list[int] = []

    async def client(stream: bool) -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(4):
                async with session.post(gw.make_url(SERVED_CHAT), headers={
                        "Authorization": f"Bearer {gw.api_key}"}, json={  # type: ignore[attr-defined]
                        "model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4, "stream": stream}) as response:
                    await response.read()
                    statuses.append(response.status)

    async with kept_full(busy):
        before = (await metrics(busy))[REJECTED]
        # Four clients at once (the other replica runs four at a time): about half of the
        # requests are picked for the full replica first.
        await asyncio.gather(*(client(i % 2 == 1) for i in range(4)))
        rejected = (await metrics(busy))[REJECTED] - before
    assert statuses == [200] * 16
    assert rejected >= 3  # it did meet the full queue, and no client saw it
    backends = {b.name: b for b in gw.app[ROUTER].backends}
    # Busy is not broken: the full replica was neither ejected nor counted as failing.
    assert backends[busy.name].healthy and backends[busy.name].health.consecutive_failures == 0
    assert backends[other.name].healthy


async def test_a_client_that_leaves_aborts_its_request_in_the_engine(
    replicas: Engines, gateway: GatewayFactory, clean_redis: RedisProcess
) -> None:
    gw = await gateway(*(backend(r) for r in replicas.replicas))
    key = await funded_key(clean_redis.url)
    await wait_idle(replicas.replicas)
    generated = (await totals(replicas.replicas, GENERATED))[GENERATED]
    seen: list[bytes] = []
    async with aiohttp.ClientSession() as client:
        response = await client.post(gw.make_url(SERVED_CHAT), json=LONG_STREAM,
                                     headers={"Authorization": f"Bearer {key}"})
        assert response.status == 200
        reader = asyncio.create_task(consume(response, seen))
        await until(replicas.replicas, RUNNING, 1.0)  # generating: ~1000 tokens, a second or more
        reader.cancel()
        response.close()  # the client goes away
    await until(replicas.replicas, RUNNING, 0.0, within_s=1.0)  # the engine stopped at once
    await asyncio.sleep(0.3)  # and generates nothing more for it
    assert (await totals(replicas.replicas, GENERATED))[GENERATED] - generated < 900
    await settled(gw)
    [charge] = [e for e in await journal(clean_redis.url) if e["type"] == "charge"]
    assert charge["status"] == "client_gone" and charge["estimated"]
    assert charge["completion_tokens"] < 900  # what was delivered, not the cap


async def until(replicas: list[Replica], name: str, value: float, within_s: float = 5.0
                ) -> None:
    """Wait until the replicas' `name` adds up to `value` (gauges follow engine steps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while (seen := (await totals(replicas, name))[name]) != value:
        assert loop.time() < deadline, f"{name} is {seen}, not {value}, after {within_s} s"
        await asyncio.sleep(0.02)
