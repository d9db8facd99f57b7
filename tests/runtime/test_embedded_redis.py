"""Embedded Redis restarts, as the gateway's Redis clients see them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from proxy.runtime.redis_process import RedisProcess, connect_redis


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
