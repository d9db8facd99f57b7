"""Fixtures (a pytest plugin) and helpers for the upstreams: the project's simulators on loopback,
started by the `simulator` fixture, and what clients' requests they saw."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.simulators import SimConfig
from proxy.simulators import build_app as build_simulator
from proxy.simulators.state import STATE as SIM_STATE
from tests.support.config_files import MODEL

PROBE_AGENT = "inference-gateway-health"

SimulatorFactory = Callable[..., Awaitable[TestServer]]


@pytest.fixture
async def simulator(aiohttp_server: Any) -> AsyncIterator[SimulatorFactory]:
    async def start(kind: str = "vllm", models: tuple[str, ...] = (MODEL,), **options: Any
                    ) -> TestServer:
        app = build_simulator(kind, SimConfig(models=models, **options))
        server: TestServer = await aiohttp_server(app)

        async def close_port() -> None:  # an engine death ends the server, as vLLM exits
            await server.close()

        app[SIM_STATE].close_port = close_port
        return server

    yield start


async def sim_requests(sim: TestServer) -> list[dict[str, Any]]:
    """What clients' requests sent the simulator (the gateway's health probes left out: a
    failure wakes one, and deep probes are generations too)."""
    async with aiohttp.ClientSession() as session, session.get(sim.make_url("/_sim/requests")) as r:
        records: list[dict[str, Any]] = await r.json()
        return [r for r in records if r["headers"].get("user-agent") != PROBE_AGENT]
