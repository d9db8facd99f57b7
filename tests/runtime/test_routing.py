"""Prefix routing across processes: two `serve` gateways with two workers each, in front of three
real vLLM simulators, send every request of one prefix to one replica."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from proxy.store.redis_process import RedisProcess
from tests.support.config_files import MODEL
from tests.support.fleet import ADMIN, Stack
from tests.support.upstreams import SimulatorFactory, sim_requests

CHAT = "/v2/compat/v1/chat/completions"


def body(system: str, user: str) -> dict[str, object]:
    # A system prompt of a few hundred bytes: several of the blocks `prefix` matches.
    return {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": system + " Answer briefly and politely." * 10},
        {"role": "user", "content": user}]}


def serving(sims: list[TestServer], tmp: Path, redis_url: str) -> Stack:
    """A two-worker `serve` in front of the simulators, as replicas r0, r1, ..."""
    return Stack(tmp, [{"name": f"r{i}", "kind": "vllm", "models": [MODEL],
                        "url": str(sim.make_url("/")).rstrip("/")} for i, sim in enumerate(sims)],
                 workers=2, redis_url=redis_url, gateway_extra={"access_log": "off"})


async def served_by(sims: list[TestServer]) -> Counter[int]:
    """How many chat requests each simulator got (the gateways' probes left out)."""
    return Counter({i: len(await sim_requests(sim)) for i, sim in enumerate(sims)})


async def test_one_prefix_one_replica_from_every_worker_of_two_gateways(
        tmp_path: Path, clean_redis: RedisProcess, simulator: SimulatorFactory,
        stacks: list[Stack]) -> None:
    sims = [await simulator("vllm") for _ in range(3)]
    gateways = [serving(sims, tmp_path / f"gateway{i}", clean_redis.url) for i in range(2)]
    stacks.extend(gateways)
    urls = [gateway.url for gateway in gateways]
    for gateway in gateways:
        await asyncio.to_thread(gateway.ready)
    await asyncio.sleep(1.0)  # the masters' first reads of the engines' figures

    async def ask(url: str, system: str, user: str) -> None:
        async with aiohttp.ClientSession() as session, session.post(
                url + CHAT, json=body(system, user), headers={"Connection": "close"}) as r:
            assert r.status == 200, await r.text()

    before = await served_by(sims)
    for n in range(16):  # new connections: every worker of both gateways takes some
        await ask(urls[n % 2], "You are the shared support assistant.", "Hello there")
    got = await served_by(sims) - before
    assert sorted(got.values()) == [16], got  # all of them on one replica

    before = await served_by(sims)
    for n in range(18):  # eighteen other prefixes: spread over the three
        await ask(urls[n % 2], f"You are assistant number {n}.", "Hello there")
    spread = await served_by(sims) - before
    assert sum(spread.values()) == 18 and len(spread) == 3, spread


async def test_a_replica_whose_queue_is_full_gets_nothing_until_it_drains(
        tmp_path: Path, clean_redis: RedisProcess, simulator: SimulatorFactory,
        stacks: list[Stack]) -> None:
    sims = [await simulator("vllm", max_concurrency=1) for _ in range(2)]  # batches of one
    gateway = serving(sims, tmp_path, clean_redis.url)
    stacks.append(gateway)
    url = gateway.url
    direct = aiohttp.ClientSession()
    try:
        await asyncio.to_thread(gateway.ready)
        system = "You are the shared support assistant."

        async def ask() -> None:
            async with aiohttp.ClientSession() as session, session.post(
                    url + CHAT, json=body(system, "Hello there"),
                    headers={"Connection": "close"}) as r:
                assert r.status == 200, await r.text()

        await ask()
        home = next(i for i, n in (await served_by(sims)).items() if n)  # the prefix's replica

        async def fill(replica: int) -> tuple[aiohttp.ClientResponse, list[Any]]:
            """Another client fills the replica's batch and queue, straight to the engine."""
            hung = await direct.post(sims[replica].make_url("/v1/chat/completions"), json={
                **body("x", "y"), "stream": True}, headers={"x-sim-hang-after": "1"})
            await hung.content.readline()
            queued = [asyncio.create_task(direct.post(
                sims[replica].make_url("/v1/chat/completions"), json=body("x", "y")))
                for _ in range(4)]
            await asyncio.sleep(1.0)  # the master reads it; both workers follow
            return hung, queued

        async def drain(hung: aiohttp.ClientResponse, queued: list[Any]) -> None:
            hung.close()
            for task in queued:
                (await task).close()
            await asyncio.sleep(1.5)

        hung, queued = await fill(home)
        before = await served_by(sims)
        for _ in range(8):
            await ask()
        moved = await served_by(sims) - before
        assert moved == Counter({1 - home: 8}), moved  # none joined the full queue
        await drain(hung, queued)
        # Now both replicas hold the prefix: with the other one full, home takes it again.
        hung, queued = await fill(1 - home)
        before = await served_by(sims)
        for _ in range(4):
            await ask()
        assert await served_by(sims) - before == Counter({home: 4})
        await drain(hung, queued)
    finally:
        await direct.close()


async def test_the_gateway_learns_an_engines_prefill_price_from_its_figures(
        tmp_path: Path, clean_redis: RedisProcess, simulator: SimulatorFactory,
        stacks: list[Stack]) -> None:
    """The engine's prefill histograms, read by the master and fitted by every worker, give
    the price `prefix` weighs waits against, shown in /admin/backends."""
    sims = [await simulator("vllm", prefill_ms_per_1k_tokens=150, ttft_ms=30,
                            default_completion_tokens=2)]
    gateway = serving(sims, tmp_path, clean_redis.url)
    stacks.append(gateway)
    await asyncio.to_thread(gateway.ready)
    async with aiohttp.ClientSession() as session:
        async def prefill_view() -> dict[str, Any] | None:
            async with session.get(gateway.url + "/admin/backends", headers=ADMIN) as r:
                [view] = (await r.json())["data"]
                return view["prefill"]  # type: ignore[no-any-return]

        async def ask(n: int) -> None:  # prompts of 20 to ~1,000 words, none alike
            words = 20 + (n * 613) % 1000
            async with session.post(gateway.url + CHAT, json=body(
                    f"Prompt {n}: " + "lorem " * words, "Hello there")) as r:
                assert r.status == 200, await r.text()

        assert await prefill_view() is None  # nothing to learn from yet
        for n in range(30):
            await ask(n)
        for n in range(30, 90):  # each worker fits what the master's next reads show ...
            views = [await prefill_view() for _ in range(4)]
            if all(views):
                break
            # ... once they span reads of different mixes: a fast machine answers the first
            # 30 within a read or two, which cannot tell a fixed cost from a per-token one.
            await ask(n)
            await asyncio.sleep(0.1)
        async with session.get(gateway.url + "/metrics") as r:  # and Prometheus
            assert 'igw_engine_prefill_ms_per_1k_tokens{backend="r0"} 1' in await r.text()
    for view in views:
        assert view is not None, views
        assert 135 <= view["ms_per_1k_tokens"] <= 165, views  # the engine's 150
        assert 25 <= view["fixed_ms"] <= 45, views  # its 30 (and a decode step)
