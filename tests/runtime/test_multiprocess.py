"""Two gateway processes on one Redis behave as one: limits and revocations hold across them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest
from redis.asyncio import Redis

from proxy.store.redis_process import RedisProcess
from tests.support.config_files import MODEL, tiers, write_config
from tests.support.processes import free_port, wait_until_ready

CHAT = "/v2/compat/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
# Only completion tokens cost (10 micro-credits each): a request capped at 100 tokens holds
# exactly 1000, and one that uses all 100 is charged exactly that.
PRICES = """
version = "mp-test"
hold_ttl_s = 4
[default]
completion_per_1k_tokens = 10000
"""


@pytest.fixture
def two_gateways(tmp_path: Path, clean_redis: RedisProcess
                 ) -> Iterator[tuple[list[str], str, dict[str, str], Path]]:
    env = {**os.environ, "GATEWAY_REDIS_URL": clean_redis.url, "PYTHONUNBUFFERED": "1"}
    sim_port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "vllm", "--port",
                               str(sim_port), "--model", MODEL], env=env)]
    folder = write_config(tmp_path / "config", [{
        "name": "b0", "kind": "vllm", "url": f"http://127.0.0.1:{sim_port}", "models": [MODEL],
        "forward_headers": ["x-sim-*"]}],
        # Short timeouts, so a 4 s hold outlives any request (check-config insists).
        upstream={"connect_timeout_s": 0.1, "first_byte_timeout_s": 0.4, "max_stream_s": 2.5},
        policies={"tiers.toml": tiers(basic=10, max_=1000), "prices.toml": PRICES})
    urls = []
    logs = tmp_path / "logs"
    logs.mkdir()
    files = []
    try:
        wait_until_ready(f"http://127.0.0.1:{sim_port}/health", procs[0])
        for i in range(2):
            port = free_port()
            log = (logs / f"gateway{i}.log").open("wb")
            files.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--config", str(folder), "--port",
                 str(port)], env=env, stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
            wait_until_ready(f"{urls[-1]}/readyz", procs[-1])
        yield urls, f"http://127.0.0.1:{sim_port}", env, folder
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        for file in files:
            file.close()


def cli(env: dict[str, str], folder: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "proxy", *args, "--config", str(folder)],
                          env=env, capture_output=True, text=True, timeout=30, check=True)
    return done.stdout


async def test_limit_and_revocation_hold_across_two_processes(
    two_gateways: tuple[list[str], str, dict[str, str], Path]
) -> None:
    urls, sim_url, env, folder = two_gateways
    key = cli(env, folder, "keys", "create", "--account", "acme", "--tier", "basic").split()[0]
    assert key.startswith("igw_sk_")
    cli(env, folder, "credits", "add", "--account", "acme", "--amount", "1")

    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> int:
            async with session.post(urls[i % 2] + CHAT, json=BODY,
                                    headers={"X-API-Key": key}) as response:
                await response.read()
                return response.status

        statuses = await asyncio.gather(*(one(i) for i in range(50)))
        assert statuses.count(200) == 10 and statuses.count(429) == 40
        async with session.get(sim_url + "/_sim/stats") as response:
            assert (await response.json())["total"] == 10

        listed = cli(env, folder, "keys", "list", "--account", "acme")
        assert key not in listed and "basic" in listed
        cli(env, folder, "keys", "revoke", key)
        started = time.monotonic()
        seen = [False, False]
        while not all(seen):
            assert time.monotonic() - started < 1.0, "revocation not seen everywhere within 1 s"
            for i, url in enumerate(urls):
                async with session.post(url + CHAT, json=BODY,
                                        headers={"X-API-Key": key}) as response:
                    seen[i] = seen[i] or response.status == 401
            await asyncio.sleep(0.02)
    for log in (folder.parent / "logs").iterdir():
        assert key not in log.read_text(), "a key reached a log"


async def test_credits_never_overspent_across_two_processes(
    two_gateways: tuple[list[str], str, dict[str, str], Path]
) -> None:
    urls, _sim_url, env, folder = two_gateways
    key = cli(env, folder, "keys", "create", "--account", "race", "--tier", "max").split()[0]
    assert "available 0.010000" in cli(env, folder, "credits", "add", "--account", "race",
                                       "--amount", "0.01")  # exactly 10 x 1000 micro-credits
    body = {**BODY, "max_tokens": 100}
    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> int:
            async with session.post(urls[i % 2] + CHAT, json=body, headers={
                    "X-API-Key": key, "x-sim-tokens": "100"}) as response:
                await response.read()
                return response.status

        statuses = await asyncio.gather(*(one(i) for i in range(100)))
    assert statuses.count(200) == 10 and statuses.count(402) == 90
    deadline = time.monotonic() + 5  # settlement runs just after each answer
    while "held 0.000000" not in (shown := cli(env, folder, "accounts", "show", "race")):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert "available 0.000000" in shown and "spent 0.010000" in shown
    assert "0 problem(s)" in cli(env, folder, "credits", "reconcile")


async def test_a_killed_workers_hold_is_swept(
    two_gateways: tuple[list[str], str, dict[str, str], Path]
) -> None:
    urls, _, env, folder = two_gateways
    key = cli(env, folder, "keys", "create", "--account", "crash", "--tier", "max").split()[0]
    cli(env, folder, "credits", "add", "--account", "crash", "--amount", "1")
    victim = psutil.Process(_gateway_pid(urls[0]))
    async with aiohttp.ClientSession() as session:
        response = await session.post(urls[0] + CHAT, json={**BODY, "stream": True}, headers={
            "X-API-Key": key, "x-sim-hang-after": "2"})
        assert response.status == 200, await response.read()
        await response.content.readline()  # the request is in flight, its hold taken
        # Read straight from Redis, and the crash at once: the stream ends by itself after
        # max_stream_s (then it is settled, and charged what was delivered), and a CLI process
        # can take that long to start on a loaded machine.
        redis = Redis.from_url(env["GATEWAY_REDIS_URL"])
        try:
            assert int(await redis.hget("igw:{crash}:bal", "held") or 0) > 0
        finally:
            await redis.aclose()
        # A crash, not a shutdown: the processes serving requests die first, without a chance
        # to settle (a master that dies first would let its workers drain gracefully).
        for proc in [*victim.children(recursive=True), victim]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        response.close()
    # The surviving gateway's sweeper releases the hold once it expires (hold_ttl_s = 4): the
    # request its worker never settled costs nothing (a crash never over-charges).
    deadline = time.monotonic() + 20
    while "held 0.000000" not in cli(env, folder, "accounts", "show", "crash"):
        assert time.monotonic() < deadline, "the orphaned hold was never released"
        await asyncio.sleep(0.3)
    assert "available 1.000000" in cli(env, folder, "accounts", "show", "crash")
    assert "0 problem(s)" in cli(env, folder, "credits", "reconcile", "--account", "crash")


def _gateway_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "serve" in cmdline and port in cmdline:
            return int(proc.info["pid"])
    raise AssertionError(f"no gateway process listening on {port}")
