"""Shared fixtures: a real redis-server, real simulator servers, the gateway on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.test_utils import TestServer
from aiohttp.web_runner import BaseRunner
from redis.asyncio import Redis

from proxy.app import build_app
from proxy.appkeys import CONFIG, SETTLER
from proxy.config import KeysPolicy, load_config
from proxy.credits.ledger import Ledger
from proxy.http.server import GatewayRunner
from proxy.identity.keystore import KeyStore
from proxy.simulators import SimConfig
from proxy.simulators import build_app as build_simulator
from proxy.simulators.runtime import STATE as SIM_STATE
from proxy.store.redis_process import RedisProcess

MODEL = "acme/small-chat"

# Tests that are not about rate limits must not trip over them.
GENEROUS_TIERS = """
[tiers.guest]
requests_per_minute = 100000
families = ["chat", "tts", "asr", "image", "video"]
models = { "*" = ["direct", "network"] }

[tiers.max]
requests_per_minute = 100000
families = ["chat", "tts", "asr", "image", "video"]
models = { "*" = ["direct", "network"] }
"""


async def new_key(redis_url: str, tier: str = "max", account: str = "acct-test") -> str:
    """A real API key, created the way `keys create` does."""
    redis = Redis.from_url(redis_url)
    try:
        raw, _ = await KeyStore(redis, KeysPolicy()).create(account, tier, "test")
    finally:
        await redis.aclose()
    return raw


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-engine tier runs last, so its replicas live only while it runs (they start on
    first use and stop at the session's end), and within it the tests that kill an engine run
    after the others, which then need no restart."""

    def rank(item: pytest.Item) -> tuple[bool, bool]:
        return (item.get_closest_marker("real_engine") is not None,
                item.get_closest_marker("kills_engine") is not None)

    items.sort(key=rank)  # stable: the rest keep their order


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """One real redis-server for the session (tests that kill Redis start their own)."""
    proc = RedisProcess(tmp_path_factory.mktemp("redis"), port=free_port(), fsync="everysec")
    proc.start()
    yield proc
    proc.stop()


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(value)


def write_config(
    folder: Path,
    backends: list[dict[str, Any]],
    *,
    upstream: dict[str, Any] | None = None,
    gateway: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
    policies: dict[str, str] | None = None,
) -> Path:
    """A config folder as an operator writes it: backends.toml plus policies/*.toml."""
    lines = ["[gateway]"] + [f"{k} = {toml_value(v)}" for k, v in (gateway or {}).items()]
    if server:
        lines += ["", "[server]"] + [f"{k} = {toml_value(v)}" for k, v in server.items()]
    lines += ["", "[upstream]"] + [f"{k} = {toml_value(v)}" for k, v in (upstream or {}).items()]
    for backend in backends:
        lines += ["", "[[backends]]"] + [f"{k} = {toml_value(v)}" for k, v in backend.items()]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "backends.toml").write_text("\n".join(lines) + "\n")
    (folder / "policies").mkdir(exist_ok=True)
    for name, text in (policies or {}).items():
        (folder / "policies" / name).write_text(text)
    return folder


SimulatorFactory = Callable[..., Awaitable[TestServer]]
GatewayFactory = Callable[..., Awaitable[TestServer]]


class GatewayTestServer(TestServer):
    """aiohttp's TestServer on the runner `serve` uses: the same [server] deadlines, connection
    cap and JSON refusals as a worker."""

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        return GatewayRunner(self.app, self.app[CONFIG], **kwargs)


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


@pytest.fixture
async def clean_redis(redis_server: RedisProcess) -> RedisProcess:
    """The session's redis-server, emptied: no keys, limits or balances from earlier tests."""
    redis = Redis.from_url(redis_server.url)
    await redis.flushdb()
    await redis.aclose()
    return redis_server


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
                    settings: dict[str, Any] | None = None) -> TestServer:
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
                              policies=policies, gateway=settings)
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


async def assert_ledger_reconciles(redis_url: str) -> None:
    """Reconcile runs clean after every test that spends (settlements may still be landing), and
    no hold is left open: every request ended its hold."""
    redis = Redis.from_url(redis_url)
    try:
        ledger = Ledger(redis)
        for _ in range(40):
            problems = await ledger.reconcile()
            for account in await ledger.accounts():
                if await ledger.open_holds(account):
                    problems.append(f"{account}: holds still open")
            if not problems:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"ledger does not reconcile: {problems}")
    finally:
        await redis.aclose()
