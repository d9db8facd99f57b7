"""Running queued tasks: every worker is a consumer of the `igw-runners` group.

Each worker reads new entries (`XREADGROUP ... >`) up to `runners_per_worker` at a time, and
every few seconds one worker of the fleet (the holder of a lease, runtime.lease) claims entries
another consumer has left idle longer than `claim_idle_s` (`XAUTOCLAIM`): a worker that died
mid-task stops touching its entries, so they move to a live one. A running task keeps its entry
fresh (`XCLAIM ... JUSTID` by its own consumer, a third of `claim_idle_s` apart), so a long task
is never taken from a live worker. An entry is acked and deleted once its task has ended; a task
that already ended (a reclaim raced its finish) is only acked. The work itself is `execute`
(proxy.pipeline.run_task): the request path minus the client.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from proxy.store.background import stop_task
from proxy.store.client import Store
from proxy.store.lease import Lease
from proxy.tasks.store import GROUP, QUEUE, TaskStore

log = logging.getLogger("proxy.tasks")

Execute = Callable[[str, str], Awaitable[None]]  # (account, task id): run, store, settle


def consumer_name() -> str:
    """Unique per worker process (and host): a reclaimed entry must change hands."""
    return f"{socket.gethostname()}-{os.getpid()}"


class TaskRunner:
    def __init__(self, redis: Store, store: TaskStore, execute: Execute, *, concurrency: int,
                 claim_idle_s: float, name: str | None = None) -> None:
        self.redis = redis
        self.store = store
        self.execute = execute
        self.name = name or consumer_name()
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.claim_every_s = min(5.0, claim_idle_s / 3)
        # One runner of the whole fleet looks for abandoned entries at a time: the lease's
        # holder, while it has room to run them (a busy holder lets the lease lapse).
        self.claim_lease = Lease(redis, "task-reclaim")
        self.concurrency = concurrency
        self._running: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        """Forever: claim abandoned entries, read new ones, run each in its own task. Until the
        first task makes the queue and its group (proxy.tasks.store), Redis answers NOGROUP and
        the loop waits a second: a gateway that never runs a task writes nothing."""
        next_claim = 0.0
        loop = asyncio.get_running_loop()
        while True:
            try:
                if loop.time() >= next_claim:
                    next_claim = loop.time() + self.claim_every_s
                    # No queue yet (no task ever submitted): nothing to claim, nothing written.
                    if self._free() and await self.redis.exists(QUEUE) \
                            and await self.claim_lease.hold(3 * self.claim_every_s):
                        await self._start(await self._claim_abandoned())
                if not self._free():
                    await asyncio.wait(set(self._running), return_when=asyncio.FIRST_COMPLETED)
                await self._start(await self._read_new())
            except asyncio.CancelledError:
                raise
            except RedisError:
                await asyncio.sleep(1.0)  # the store is down: try again shortly
            except Exception:
                log.exception("task runner loop failed; continuing")
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        for task in list(self._running):
            await stop_task(task)
        await self.claim_lease.release()

    async def _read_new(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        free = self._free()
        if not free:
            return []
        # RESP2: [[stream, [(entry id, fields), ...]]]
        reply: Any = await self.redis.xreadgroup(GROUP, self.name, {QUEUE: ">"}, count=free,
                                                 block=1000)
        return [entry for _, entries in reply or () for entry in entries]

    async def _claim_abandoned(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        free = self._free()
        if not free:
            return []
        reply = await self.redis.xautoclaim(QUEUE, GROUP, self.name,
                                            min_idle_time=self.claim_idle_ms, count=free)
        entries: list[tuple[bytes, dict[bytes, bytes]]] = reply[1] if reply else []
        return [e for e in entries if e and e[1]]  # deleted entries come back empty

    def _free(self) -> int:
        """How many more tasks may start now."""
        return max(0, self.concurrency - len(self._running))

    async def _start(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for entry_id, fields in entries:
            task = asyncio.create_task(self._process(entry_id, fields))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _process(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        heartbeat = asyncio.create_task(self._keep_fresh(entry_id))
        try:
            account = fields.get(b"account", b"").decode()
            task_id = fields.get(b"id", b"").decode()
            if account and task_id:
                await self.execute(account, task_id)
            await self.redis.xack(QUEUE, GROUP, entry_id)
            await self.redis.xdel(QUEUE, entry_id)
        except asyncio.CancelledError:
            raise  # left pending: another worker reclaims it
        except Exception:
            log.exception("task entry %s failed; it stays pending for a retry", entry_id)
        finally:
            await stop_task(heartbeat)

    async def _keep_fresh(self, entry_id: bytes) -> None:
        while True:
            await asyncio.sleep(self.claim_idle_ms / 3000)
            try:
                await self.redis.xclaim(QUEUE, GROUP, self.name, 0, [entry_id], justid=True)
            except RedisError:
                continue
