"""Writes that follow a request (settlements, idempotent results), batched per worker.

A request queues its writes and is done: no task, no await, so a cancelled request still
settles. One background task flushes whatever has queued as one pipeline, at most every
`FLUSH_INTERVAL_S`: one round trip and, with `appendfsync always`, one fsync shared by every
request that finished meanwhile. Redis fsyncs on its main thread, so every admission waits out an
fsync in progress; fewer, larger batches keep those stalls rare. A batch
that fails is retried with backoff (every write in it is safe to repeat: a settle of an ended hold
does nothing, SET and DEL are idempotent) and, past the last attempt, dropped: its holds expire and
the sweeper releases them, so a lost settlement never over-charges (reconcile reports it until
then).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from proxy.credits.ledger import Arg
from proxy.observe.metrics import Metrics

log = logging.getLogger("proxy.settler")

Write = Callable[[Pipeline], object]

RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # ~4 s in all: a Redis restart fits
FLUSH_INTERVAL_S = 0.01  # a hold lives at most this much longer; Redis fsyncs <= 100 times a second
MAX_QUEUED = 100_000  # beyond this (Redis gone for long) the oldest writes are dropped


class Settler:
    def __init__(self, redis: Redis, scripts: Sequence[AsyncScript],
                 metrics: Metrics | None = None) -> None:
        self._redis = redis
        self._scripts = tuple(scripts)
        self._metrics = metrics
        self._queue: list[Write] = []
        self._flushing = 0
        self._wake = asyncio.Event()
        self.lost = 0  # writes dropped after every retry failed

    @property
    def pending(self) -> int:
        """Writes queued or being flushed."""
        return len(self._queue) + self._flushing

    def add(self, write: Write) -> None:
        if len(self._queue) >= MAX_QUEUED:
            self._queue.pop(0)
            self._lose(1)
        self._queue.append(write)
        self._wake.set()

    def settle(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Arg]) -> None:
        """Queue one call of a registered script."""
        self.add(lambda pipe: pipe.evalsha(script.sha, len(keys), *keys, *args))

    async def run(self) -> None:
        """Flush forever (the app's cleanup cancels it, then calls `drain`)."""
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            started = loop.time()
            await self.flush()
            await asyncio.sleep(max(0.0, started + FLUSH_INTERVAL_S - loop.time()))

    async def flush(self) -> None:
        self._wake.clear()
        batch, self._queue = self._queue, []
        if not batch:
            return
        self._flushing = len(batch)
        try:
            await self._write(batch)
        finally:
            self._flushing = 0

    async def drain(self, timeout_s: float) -> None:
        """At shutdown: flush what is left, within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._queue:
                    await self.flush()
        except TimeoutError:
            self._lose(len(self._queue))

    async def _write(self, batch: list[Write]) -> None:
        for attempt, delay in enumerate((0.0, *RETRY_DELAYS_S)):
            if delay:
                await asyncio.sleep(delay)
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for write in batch:
                        write(pipe)
                    await pipe.execute()
                return
            except NoScriptError:
                await self._load_scripts()  # Redis restarted without them: load, then again
            except RedisError as exc:
                if self._metrics is not None:
                    self._metrics.redis_errors.labels("settlement").inc()
                if attempt == len(RETRY_DELAYS_S):
                    break
                log.warning("settlement batch of %d failed (%s); retrying", len(batch),
                            type(exc).__name__)
        self._lose(len(batch))

    async def _load_scripts(self) -> None:
        try:
            for script in self._scripts:
                await self._redis.script_load(script.script)
        except RedisError:
            pass  # the next attempt fails on its own and is retried

    def _lose(self, count: int) -> None:
        self.lost += count
        if self._metrics is not None:
            self._metrics.settlements_lost.inc(count)
        log.error("%d settlement write(s) lost after retries; their holds expire and are "
                  "released by the sweeper", count)
