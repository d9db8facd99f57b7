"""A worker process killed (SIGKILL) while it runs an async task: the task completes on another
worker of the same gateway, once its claim has gone idle. Real processes: `serve` with two
workers, its supervised simulator, a Redis the test reads the queue from."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path

import aiohttp
from redis.asyncio import Redis

from proxy.tasks.store import GROUP, QUEUE
from tests.support.fleet import BODY, CHAT, Stack, simulator


async def test_a_killed_workers_task_completes_on_another(tmp_path: Path, stacks: list[Stack],
                                                          redis_url: str) -> None:
    stack = Stack(tmp_path, [simulator("sim-a")], workers=2, redis_url=redis_url,
                  policies={"requests.toml": "[tasks]\nclaim_idle_s = 1\n"})
    stacks.append(stack)
    stack.ready()
    redis = Redis.from_url(redis_url)
    try:
        # A connection per request: one kept alive to the worker killed below would be reset.
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as session:
            async with session.post(stack.url + CHAT, json={**BODY, "async": True},
                                    headers={"x-sim-delay-ms": "2500"}) as r:
                assert r.status == 202, await r.text()
                task = await r.json()
            async with asyncio.timeout(10):  # a worker has taken it: who?
                while True:
                    pending = await redis.xpending_range(QUEUE, GROUP, "-", "+", 10)
                    if pending:
                        break
                    await asyncio.sleep(0.05)
            consumer = pending[0]["consumer"].decode()
            pid = int(consumer.rsplit("-", 1)[1])
            assert pid in stack.workers()
            os.kill(pid, signal.SIGKILL)
            async with asyncio.timeout(20):
                while True:
                    try:
                        async with session.get(stack.url + task["poll_url"]) as r:
                            record = await r.json()
                    except aiohttp.ClientConnectionError:
                        # A connection the kernel had queued to the killed worker's socket
                        # (the workers share the port) is reset; the next one reaches another.
                        await asyncio.sleep(0.1)
                        continue
                    if record["status"] != "running":
                        break
                    await asyncio.sleep(0.1)
        assert record["status"] == "completed", record
        assert record["result"]["choices"][0]["message"]["content"]
        # The record is written before the entry is acked and deleted: give that a moment.
        async with asyncio.timeout(5):
            while True:
                if await redis.xlen(QUEUE) == 0:
                    break
                await asyncio.sleep(0.05)
        assert re.search(r"worker \d exited \(code -9\)", stack.log.read_text())
    finally:
        await redis.aclose()
