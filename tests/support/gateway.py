"""Fixtures (a pytest plugin) and helpers for the gateway on loopback: `gateway` starts one in
front of given upstreams (on the same runner `serve` uses), with a max-tier key, and checks the
ledger reconciles when the test ends; `settled` waits until it has settled every request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.test_utils import TestServer
from aiohttp.web_runner import BaseRunner

from proxy.app import build_app
from proxy.appkeys import CONFIG, SETTLER
from proxy.config import load_config
from proxy.http.server import GatewayRunner
from proxy.store.redis_process import RedisProcess
from tests.support.accounts import assert_ledger_reconciles, new_key
from tests.support.config_files import GENEROUS_TIERS, MODEL, write_config

GatewayFactory = Callable[..., Awaitable[TestServer]]


class GatewayTestServer(TestServer):
    """aiohttp's TestServer on the runner `serve` uses: the same [server] deadlines, connection
    cap and JSON refusals as a worker."""

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        return GatewayRunner(self.app, self.app[CONFIG], **kwargs)


@pytest.fixture
async def gateway(tmp_path: Path, clean_redis: RedisProcess) -> AsyncIterator[GatewayFactory]:
    """Start a gateway whose backends.toml lists the given upstream servers (`server` fills
    its [server] section, `settings` its [gateway] section).

    The server gets an `api_key` attribute: a max-tier key for clients that need one.
    """
    redis_server = clean_redis
    servers: list[TestServer] = []

    async def start(*upstreams: TestServer | dict[str, Any], kind: str = "vllm",
                    models: tuple[str, ...] = (MODEL,),
                    upstream: dict[str, Any] | None = None,
                    server: dict[str, Any] | None = None,
                    policies: dict[str, str] | None = None,
                    resolver: AbstractResolver | None = None,
                    settings: dict[str, Any] | None = None,
                    media: dict[str, Any] | None = None,
                    routing: dict[str, Any] | None = None,
                    alerts: dict[str, Any] | None = None,
                    telemetry: dict[str, Any] | None = None) -> TestServer:
        backends = []
        for i, up in enumerate(upstreams):
            if isinstance(up, dict):
                backends.append(up)
                continue
            backends.append({
                "name": f"b{i}", "kind": kind, "url": str(up.make_url("/")).rstrip("/"),
                "models": list(models), "forward_headers": ["x-sim-*"],
            })
        policies = {"tiers.toml": GENEROUS_TIERS, **(policies or {})}
        folder = write_config(tmp_path / "config", backends, upstream=upstream, server=server,
                              policies=policies, gateway=settings, media=media,
                              routing=routing, alerts=alerts, telemetry=telemetry)
        app: web.Application = build_app(load_config(folder), redis_url=redis_server.url,
                                         resolver=resolver)
        gw = GatewayTestServer(app)
        await gw.start_server()  # handler_cancellation is on, as in serve
        servers.append(gw)
        gw.api_key = await new_key(redis_server.url)  # type: ignore[attr-defined]
        return gw

    try:
        yield start
        await assert_ledger_reconciles(redis_server.url)
    finally:
        for gw in reversed(servers):
            await gw.close()


async def settled(server: TestServer) -> None:
    """Wait until the gateway has settled every request (settlement runs after the answer)."""
    quiet = 0
    for _ in range(400):
        await asyncio.sleep(0.005)
        quiet = quiet + 1 if not server.app[SETTLER].pending else 0
        if quiet >= 3:
            return
    raise AssertionError("settlements still running after 2 s")
