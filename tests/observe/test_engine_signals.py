"""The engines' own load: parsed from their /metrics text (pure), and, under `serve`, scraped by
the master once per host and shown by every worker in /metrics and /admin/backends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config import BackendSpec
from proxy.store.client import Store
from proxy.store.redis_process import RedisProcess
from proxy.upstream.fleet_state import POLL_S
from proxy.upstream.pool import Backend
from proxy.upstream.prober import FleetSync
from proxy.upstream.signals import EngineSignals, parse_signals
from tests.support.config_files import MODEL
from tests.support.fleet import ADMIN, Stack

# As vLLM 0.32 writes them (shared/real-engines/vllm-metrics.txt), two models on one server.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 2.0
vllm:num_requests_running{engine="0",model_name="b"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 3.0
vllm:num_requests_waiting{engine="0",model_name="b"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25
"""
TGI_TEXT = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 4
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 8
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 2048
# TYPE tgi_batch_max_total_tokens gauge
tgi_batch_max_total_tokens 8192
"""


def test_vllm_and_tgi_figures() -> None:
    assert parse_signals("vllm", VLLM_TEXT, 5.0) == EngineSignals(waiting=3, running=3, kv=0.25,
                                                                  at=5.0)
    assert parse_signals("tgi", TGI_TEXT, 5.0) == EngineSignals(waiting=4, running=8, kv=0.25,
                                                                at=5.0)
    assert parse_signals("tgi", TGI_TEXT.replace("tgi_batch_max_total_tokens 8192", ""),
                         5.0) == EngineSignals(waiting=4, running=8, kv=None, at=5.0)


@pytest.mark.parametrize(("kind", "text"), [
    ("vllm", ""),
    ("vllm", "vllm:num_requests_waiting 1\n"),  # no running figure: not an engine we know
    ("vllm", "{{{ not prometheus"),
    ("vllm", TGI_TEXT),
    ("tgi", VLLM_TEXT),
    ("tts", VLLM_TEXT),  # kinds without engine figures
    ("vllm", "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n"),
])
def test_what_is_not_an_engines_load(kind: str, text: str) -> None:
    assert parse_signals(kind, text, 1.0) is None


def test_a_snapshot_is_used_only_while_fresh() -> None:
    signals = EngineSignals(waiting=1, running=1, kv=0.5, at=100.0)
    assert signals.fresh(101.0) and not signals.fresh(102.5)
    assert EngineSignals.decode(signals.encode()) == signals
    assert EngineSignals.decode(b"{not json") is None


@dataclass
class FakeEngine:
    """A loopback server answering /metrics as vLLM does, with figures the test sets."""

    waiting: int = 3
    running: int = 2
    failing: bool = False
    scrapes: int = 0
    seen: list[str] = field(default_factory=list)

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.failing:
            return web.Response(status=500, text="engine error")
        return web.Response(text=(
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="{MODEL}"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.5\n'))

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})


@pytest.fixture
async def fake_engine() -> AsyncIterator[tuple[FakeEngine, TestServer]]:
    engine = FakeEngine()
    app = web.Application()
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/health", engine.health)
    server = TestServer(app)
    await server.start_server()
    yield engine, server
    await server.close()


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics", headers={"Connection": "close"}) as r:
        return await r.text()


def test_workers_read_the_figures_as_often_as_the_master_scrapes_them() -> None:
    """A pick's figures are at most two scrapes old, not a scrape and a half-second poll."""
    engines = [Backend(BackendSpec(name="e0", kind="vllm", url="http://e0:8000",
                                   models=[MODEL]))]
    store = cast(Store, None)  # not read here
    assert FleetSync(engines, store, "fleet", "signals", 0.25).interval_s == 0.25
    assert FleetSync(engines, store, "fleet", "signals", 0.01).interval_s == 0.1  # a floor
    assert FleetSync(engines, store, "fleet", "signals", 5.0).interval_s == POLL_S
    assert FleetSync(engines, store, "fleet", None, 0.25).interval_s == POLL_S  # no figures


async def test_the_master_scrapes_once_per_host_and_every_worker_shows_it(
        tmp_path: Path, clean_redis: RedisProcess,
        fake_engine: tuple[FakeEngine, TestServer]) -> None:
    engine, server = fake_engine
    stack = Stack(tmp_path, [{"name": "e0", "kind": "vllm",
                              "url": str(server.make_url("/")).rstrip("/"), "models": [MODEL]}],
                  workers=2, redis_url=clean_redis.url, gateway_extra={"access_log": "off"})
    url = stack.url
    try:
        await asyncio.to_thread(stack.ready)  # the fake engine answers probes meanwhile
        wanted = 'igw_engine_waiting{backend="e0"} 3.0'
        async with aiohttp.ClientSession() as session:
            for _ in range(100):  # the master's first scrape, then each worker's poll
                texts = [await scrape(session, url) for _ in range(4)]  # any worker
                if all(wanted in text for text in texts):
                    break
                await asyncio.sleep(0.1)
            text = await scrape(session, url)
            assert wanted in text and 'igw_engine_running{backend="e0"} 2.0' in text
            assert 'igw_engine_kv_cache_usage{backend="e0"} 0.5' in text
            async with session.get(f"{url}/admin/backends", headers=ADMIN) as r:
                [view] = (await r.json())["data"]
            assert view["engine"]["waiting"] == 3 and view["engine"]["running"] == 2
            assert 0 <= view["engine"]["age_s"] < 2
            # One scraper for the host, every 0.25 s: about 8 reads in 2 s (a scraper per
            # worker would make about 16).
            before = engine.scrapes
            await asyncio.sleep(2.0)
            assert 4 <= engine.scrapes - before <= 11, engine.scrapes - before
            # New figures reach the workers within a poll or two.
            engine.waiting = 7
            for _ in range(50):
                if 'igw_engine_waiting{backend="e0"} 7.0' in await scrape(session, url):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("new figures never showed")
            # A failing scrape: the figures go (never a stale one), the gateway goes on.
            engine.failing = True
            for _ in range(60):
                text = await scrape(session, url)
                if "igw_engine_waiting{" not in text:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("stale engine figures were still shown")
            async with session.get(f"{url}/readyz") as r:
                assert r.status == 200
    finally:
        await asyncio.to_thread(stack.close)
