"""Script calls made in one loop tick go to Redis as one pipeline: one write, one read.

Under load many requests are admitted in the same tick; sent one by one, each call costs a pool
checkout, a system call each way and redis-py's per-command wrapping (~70 µs of CPU); pipelined,
about a quarter of that. Each caller still awaits its own reply, and an error reaches only the
calls it concerns. A caller that is cancelled while waiting does not stop its command: whoever
cancels must assume it ran (the pipeline treats it so: see `ChatMeter` and its stages).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

Call = tuple[AsyncScript, Sequence[Any], Sequence[Any], "asyncio.Future[Any]"]


class ScriptBatch:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._pending: list[Call] = []
        self._sending: set[asyncio.Task[None]] = set()

    def call(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
             ) -> asyncio.Future[Any]:
        """Queue one call; the returned future gets its reply (or its error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._send_pending)  # after the callbacks ready in this tick
        self._pending.append((script, keys, args, future))
        return future

    def _send_pending(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.create_task(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[Call]) -> None:
        try:
            replies = await self._execute(batch)
            missing = [c for c, r in zip(batch, replies, strict=True)
                       if isinstance(r, NoScriptError)]
            if missing:  # Redis restarted and lost its script cache: load, then once more
                for script in {id(c[0]): c[0] for c in missing}.values():
                    await self._redis.script_load(script.script)
                again = dict(zip(map(id, missing), await self._execute(missing), strict=True))
                replies = [again.get(id(c), r) for c, r in zip(batch, replies, strict=True)]
        except BaseException as exc:  # every waiter must hear of it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for (*_, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue  # its caller went away
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _execute(self, batch: Sequence[Call]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in batch:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            return replies

    async def close(self) -> None:
        """Let the pipelines in flight finish (shutdown)."""
        if self._sending:
            await asyncio.wait(self._sending, timeout=5)
