"""Two gateway processes on one Redis behave as one: limits and revocations hold across them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from proxy.redis_process import RedisProcess
from tests.conftest import MODEL, free_port, write_config
from tests.test_identity import tiers
from tests.test_serve_cli import wait_until_ready

CHAT = "/v2/compat/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def two_gateways(tmp_path: Path, clean_redis: RedisProcess
                 ) -> Iterator[tuple[list[str], str, dict[str, str], Path]]:
    env = {**os.environ, "GATEWAY_REDIS_URL": clean_redis.url, "PYTHONUNBUFFERED": "1"}
    sim_port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "proxy", "simulate", "vllm", "--port",
                               str(sim_port), "--model", MODEL], env=env)]
    folder = write_config(tmp_path / "config", [{
        "name": "b0", "kind": "vllm", "url": f"http://127.0.0.1:{sim_port}", "models": [MODEL]}],
        policies={"tiers.toml": tiers(basic=10)})
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
