"""Slowloris against a real worker (reliability.md I2): hundreds of sockets trickling request
heads or sending nothing are closed by the header deadline, the worker's open file descriptors
come back down, and a normal client is served throughout."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import psutil
import pytest

from proxy.store.redis_process import RedisProcess
from tests.support.config_files import write_config
from tests.support.processes import free_port, wait_until_ready

HEADER_TIMEOUT_S = 1.5
# 300 sockets and a client in one test process, on a shared 2-core machine that may be running
# a second test suite: how late the closes and answers may be and still be the deadline's.
SLACK_S = 4.0
TRICKLERS, SILENT = 200, 100
# Never finished: a header line that keeps growing, one byte at a time.
TRICKLE = b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Slow: " + b"s" * 1000


@pytest.fixture
def worker(tmp_path: Path, clean_redis: RedisProcess) -> Iterator[tuple[int, psutil.Process]]:
    """`serve` with one worker and short deadlines; the port and the worker process."""
    port = free_port()
    folder = write_config(tmp_path / "config", [], server={
        "header_timeout_s": HEADER_TIMEOUT_S, "keepalive_timeout_s": 30.0,
        "max_connections": 1000})
    env = {**os.environ, "GATEWAY_REDIS_URL": clean_redis.url, "PYTHONUNBUFFERED": "1"}
    with (tmp_path / "gateway.log").open("wb") as log:
        master = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(folder), "--port",
             str(port), "--workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}/healthz", master)
        workers = [p for p in psutil.Process(master.pid).children()
                   if "proxy.runtime.worker" in " ".join(p.cmdline())]
        assert len(workers) == 1
        yield port, workers[0]
    finally:
        master.terminate()
        master.wait(15)


async def test_slow_and_silent_sockets_are_closed_while_normal_clients_are_served(
    worker: tuple[int, psutil.Process]
) -> None:
    port, process = worker
    loop = asyncio.get_running_loop()
    baseline_fds = process.num_fds()

    async def slow_socket(trickle: bool) -> float:
        """Seconds from connecting until the server closed the connection."""
        # Timed from before the connect: with 300 connecting at once, this loop may resume
        # well after the server accepted (and started the deadline); from then, a socket once
        # measured 1.14 s for a 1.5 s deadline.
        opened = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def drip() -> None:
            for i in range(len(TRICKLE)):
                writer.write(TRICKLE[i:i + 1])
                await asyncio.sleep(0.25)

        dripping = asyncio.create_task(drip()) if trickle else None
        try:
            while await reader.read(65536):  # a 408 for a started head, then the close
                pass
        except ConnectionResetError:
            pass
        finally:
            if dripping is not None:
                dripping.cancel()
            writer.close()
        return loop.time() - opened

    attackers = [asyncio.create_task(slow_socket(trickle=i < TRICKLERS))
                 for i in range(TRICKLERS + SILENT)]
    latencies: list[float] = []
    peak_fds = baseline_fds
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # A normal client keeps working while the sockets are open, and after they are closed.
        end = loop.time() + HEADER_TIMEOUT_S + SLACK_S
        while loop.time() < end:
            started = time.perf_counter()
            async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                assert response.status == 200
                await response.read()
            latencies.append(time.perf_counter() - started)
            peak_fds = max(peak_fds, process.num_fds())
            await asyncio.sleep(0.05)
    done, pending = await asyncio.wait(attackers, timeout=HEADER_TIMEOUT_S + SLACK_S)
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} slow sockets still open after the header deadline"
    lifetimes = [task.result() for task in done]
    assert max(lifetimes) <= HEADER_TIMEOUT_S + SLACK_S
    assert min(lifetimes) >= HEADER_TIMEOUT_S - 0.3  # closed by the deadline, not refused
    assert len(latencies) >= 10 and max(latencies) < SLACK_S  # bounded: nobody locked out

    # The worker held every socket (one descriptor each) and let them all go again.
    assert peak_fds >= baseline_fds + 0.8 * (TRICKLERS + SILENT)
    for _ in range(40):
        if process.num_fds() <= baseline_fds + 5:
            break
        await asyncio.sleep(0.05)
    assert process.num_fds() <= baseline_fds + 5
