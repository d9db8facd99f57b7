"""The embedded redis-servers of `serve` are supervised: a kill -9 is noticed, reaped and undone.

Real processes only: `serve` with its own ledger Redis (AOF, appendfsync always) and rate-limit
Redis on unix sockets under the data dir, a supervised simulator, the operator CLI.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import psutil
from multidict import CIMultiDict

from proxy.credits.ledger import Balance, Ledger
from proxy.store.client import connect_redis
from proxy.store.redis_process import RedisProcess, socket_path
from tests.support.config_files import MODEL
from tests.support.embedded_redis import (
    PRICES,
    all_ready,
    cli,
    embedded_redis,
    ledger_client,
    new_funded_key,
    wait_readyz,
)
from tests.support.fleet import CHAT, Stack, simulator

ACCOUNT = "acct-redis"
# Which /readyz check covers which server (named by its folder under the data dir).
CHECKS = {"redis": "redis", "redis-limits": "rate_limit_redis"}


async def settled_balance(stack: Stack, account: str) -> Balance:
    """The account once no hold is open (settlement runs just after the answer)."""
    redis = ledger_client(stack)
    try:
        deadline = time.monotonic() + 10
        while (balance := await Ledger(redis).balance(account)).held:
            assert time.monotonic() < deadline, balance
            await asyncio.sleep(0.05)
        return balance
    finally:
        await redis.aclose()


def freeze(proc: subprocess.Popen[bytes]) -> None:
    """SIGSTOP, and wait until every thread of it has stopped (one may be inside waitpid)."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5
    tasks = Path(f"/proc/{proc.pid}/task")
    while any((t / "stat").read_text().rsplit(")", 1)[1].split()[0] != "T"
              for t in tasks.iterdir()):
        assert time.monotonic() < deadline, "the master did not stop"
        time.sleep(0.01)


async def keyed_chat(session: aiohttp.ClientSession, url: str, key: str
                     ) -> tuple[int, CIMultiDict[str]]:
    async with session.post(url + CHAT, headers={"X-API-Key": key}, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as response:
        await response.read()
        return response.status, response.headers.copy()


async def test_killed_embedded_redis_servers_are_restarted_with_the_ledger_intact(
    tmp_path: Path, stacks: list[Stack]
) -> None:
    stack = Stack(tmp_path, [simulator("sim-a")], workers=2, redis_url=None,
                  policies={"prices.toml": PRICES})
    stacks.append(stack)
    stack.ready()
    key = new_funded_key(stack, ACCOUNT, "1000")
    async with aiohttp.ClientSession() as session:
        status, headers = await keyed_chat(session, stack.url, key)
        assert status == 200
        first_request = headers["X-Request-Id"]
        before = await settled_balance(stack, ACCOUNT)
        assert before.credited == 1000 * 10**6 and before.spent > 0, before

        recovery: dict[str, float] = {}
        for name, check in CHECKS.items():
            # 1. The master frozen, so nothing can restart the server: /readyz must say it is
            #    gone, and the killed process stays a zombie until the master reaps it.
            victim = embedded_redis(stack, name)
            freeze(stack.proc)
            try:
                victim.kill()
                await wait_readyz(stack.url, lambda s, b, c=check: s == 503 and not b[
                    "checks"][c], within=5)
                if name == "redis":  # metered requests fail closed while the ledger is away
                    status, headers = await keyed_chat(session, stack.url, key)
                    assert status == 503 and headers["Retry-After"], status
                else:  # keyed windows live beside the balance: keyed traffic is untouched;
                    # guests fail open, on the small per-process fallback limit
                    status, headers = await keyed_chat(session, stack.url, key)
                    assert status == 200 and headers["X-RateLimit-Limit"] == "100000", headers
                    async with session.post(stack.url + CHAT, json={
                            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                            ) as response:
                        await response.read()
                        assert response.status == 200, response.status
                        assert response.headers["X-RateLimit-Limit"] == "5", response.headers
                assert victim.status() == psutil.STATUS_ZOMBIE
            finally:
                stack.proc.send_signal(signal.SIGCONT)
            await wait_readyz(stack.url, all_ready, within=10, in_a_row=12)
            replacement = embedded_redis(stack, name)
            # Reaped (psutil counts a zombie as running, and tells a reused pid apart).
            assert replacement.pid != victim.pid and not victim.is_running()
            assert socket_path(stack.data / name).exists()  # the same socket

            # 2. As it happens in production: kill -9 with the master running.
            replacement.kill()
            killed = time.monotonic()
            await asyncio.sleep(0.05)
            await wait_readyz(stack.url, all_ready, within=10, in_a_row=12)
            recovery[name] = time.monotonic() - killed
            assert embedded_redis(stack, name).pid != replacement.pid
            assert not replacement.is_running()

            # Keyed traffic works again; the limiter counts in Redis again, not on the fallback.
            status, headers = await keyed_chat(session, stack.url, key)
            assert status == 200 and headers["X-RateLimit-Limit"] == "100000", (status, headers)
        print(f"recovery after kill -9 (to 12 ready answers in a row): {recovery}")
        assert all(seconds < 5 for seconds in recovery.values()), recovery

    after = await settled_balance(stack, ACCOUNT)
    # The AOF (appendfsync always) kept every acknowledged write across two kill -9s.
    assert after.credited == before.credited and after.spent > before.spent, (before, after)
    assert after.available + after.held + after.spent == after.credited, after
    redis = ledger_client(stack)
    try:
        entries = await Ledger(redis).all_entries(ACCOUNT)
    finally:
        await redis.aclose()
    assert [e["type"] for e in entries if e.get("request_id") == first_request] == ["charge"]
    reconciled = cli(stack, "credits", "reconcile")
    assert reconciled.returncode == 0, reconciled.stdout + reconciled.stderr
    log = stack.log.read_text()
    for label in ("ledger", "rate-limit"):
        assert len(re.findall(rf"embedded redis-server {label} \(pid \d+\) died \(code -9\)",
                              log)) == 2, log[-3000:]


def _start_later(server: RedisProcess, delay: float) -> None:
    time.sleep(delay)
    server.start()


async def test_a_gateway_client_rides_out_a_redis_restart(tmp_path: Path) -> None:
    """connect_redis retries a command that meets a dropped or refused connection, so a write
    issued while Redis restarts (the supervisor takes about 0.15 s) lands instead of failing."""
    server = RedisProcess(tmp_path / "redis")
    server.start()
    redis = connect_redis(server.url)
    try:
        assert await redis.set("k", "before")
        server.kill()
        restart = asyncio.create_task(asyncio.to_thread(_start_later, server, 0.1))
        assert await redis.set("k", "during")  # on the pooled connection Redis just dropped
        await restart
        assert await redis.get("k") == b"during"
    finally:
        await redis.aclose()
        server.stop()


async def test_the_ledger_fsync_setting_reaches_the_embedded_redis(
    tmp_path: Path, stacks: list[Stack]
) -> None:
    for setting in ("everysec", "always"):
        stack = Stack(tmp_path / setting, [simulator("sim-a")], workers=1, redis_url=None,
                      gateway_extra={"ledger_fsync": setting})
        stacks.append(stack)
        stack.ready()
        redis = ledger_client(stack)
        try:
            assert await redis.config_get("appendfsync") == {"appendfsync": setting}
            assert await redis.config_get("appendonly") == {"appendonly": "yes"}
        finally:
            await redis.aclose()


def test_a_data_dir_too_deep_for_a_unix_socket_still_gets_one(tmp_path: Path) -> None:
    """A socket's address holds 107 bytes: under a deeper data dir redis-server would bind a
    name cut short where nobody looks, and the gateway would wait for it in vain."""
    deep = tmp_path / ("d" * 120) / "redis"
    server = RedisProcess(deep, persistent=False)
    assert len(str(server.socket_path)) <= 107 and server.socket_path.name == "redis.sock"
    assert server.socket_path == RedisProcess(deep).socket_path  # the same at every start
    server.start()
    try:
        assert server.socket_path.exists()
        assert (deep / "redis.log").exists()  # the data stays where it was asked to be
    finally:
        server.stop()
    shallow = tmp_path / "redis"
    assert RedisProcess(shallow).socket_path == shallow / "redis.sock"
