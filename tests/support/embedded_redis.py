"""`serve`'s embedded redis-servers from a test's side: the operator CLI run against a `Stack`'s
config (and so its embedded Redis), a funded key made that way, the live redis-server of each
socket, a client of the ledger's, and polling /readyz until the wanted answer holds."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import psutil
from redis.asyncio import Redis

from proxy.store.redis_process import socket_path
from tests.support.fleet import REPO, Stack, cmdline, gone

# Prices that make every request cost something, so a lost write would show in the balance.
PRICES = """
version = "test-1"
[default]
prompt_per_1k_tokens = 1000
completion_per_1k_tokens = 3000
"""


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    """`inference-gateway ...` on the running stack's embedded Redis, as an operator runs it."""
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "proxy", *args, "--config", str(stack.folder)],
                          capture_output=True, text=True, timeout=30, env=env, cwd=REPO)


def new_funded_key(stack: Stack, account: str, credits: str) -> str:
    created = cli(stack, "keys", "create", "--account", account, "--tier", "max")
    assert created.returncode == 0, created.stderr
    added = cli(stack, "credits", "add", "--account", account, "--amount", credits)
    assert added.returncode == 0, added.stderr
    return created.stdout.split()[0]


def embedded_redis(stack: Stack, name: str) -> psutil.Process:
    """The live redis-server serving data/<name>'s socket (its argv, or the process title
    redis-server rewrites it to, names the socket)."""
    sock = str(socket_path(stack.data / name))
    found = [p for p in stack.tree()
             if "redis-server" in cmdline(p) and sock in cmdline(p) and not gone(p)]
    assert len(found) == 1, [cmdline(p) for p in stack.tree()]
    return found[0]


def ledger_client(stack: Stack) -> Redis:
    return Redis.from_url(f"unix://{socket_path(stack.data / 'redis')}")


async def wait_readyz(url: str, want: Callable[[int, dict[str, Any]], bool], *,
                      within: float, in_a_row: int = 1) -> float:
    """Seconds until `want(status, body)` held for `in_a_row` answers in a row. A fresh connection
    each time, so that the kernel may hand each one to any worker."""
    started = time.monotonic()
    connector = aiohttp.TCPConnector(force_close=True)
    timeouts = aiohttp.ClientTimeout(total=5)
    seen: list[tuple[int, dict[str, Any]]] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts) as session:
        hits = 0
        while hits < in_a_row:
            assert time.monotonic() - started < within, seen[-5:]
            async with session.get(url + "/readyz") as response:
                seen.append((response.status, await response.json()))
            hits = hits + 1 if want(*seen[-1]) else 0
            await asyncio.sleep(0.02)
    return time.monotonic() - started


def all_ready(status: int, body: dict[str, Any]) -> bool:
    return status == 200
