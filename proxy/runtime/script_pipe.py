"""Hot-path script calls over one connection, pipelined as they come.

Every request's admission is one EVALSHA (`call`); the settler's batches are one write of many
commands (`pipeline`). Through redis-py's client each call costs ~60 µs of CPU (pool checkout,
a timeout task per write, retry and encoding wrappers); here the command is packed by
`resp_command` and written on redis-py's connection at once, and one reader task takes the
replies in order (Redis answers a connection's commands in the order they came), ~20 µs. Calls
made while others are in flight share the connection's round trips, as a pipeline would.

A connection that fails (refused, reset, no reply or handshake within `REPLY_TIMEOUT_S`) fails
every call in flight on it with the error, and the next call connects afresh: callers treat
that as the store being unreachable. A caller that is cancelled while waiting does not stop its
command: whoever cancels must assume it ran (see `ChatMeter` and its stages).

`ScriptPipes` keeps one pipe per primary (runtime.store.Primaries) and sends each call to the one
holding its first key. With a Cluster or Sentinels, a call that meets a moved slot or a lost
primary looks the primary up again and is sent again (twice at most, 0.1 s then 0.3 s later): a
failover costs the calls made while it lasts an error, never a wrong answer. A call sent twice
may run twice: admission's script makes that harmless (a hold id is placed once).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterDownError,
    DataError,
    NoScriptError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.runtime.store import Primaries

REPLY_TIMEOUT_S = 2.0


def resp_command(args: Sequence[Any]) -> bytes:
    """One command in Redis' wire format, as redis-py's packer writes it (bytes as they are,
    text as UTF-8, numbers by repr) at a third of its cost: this runs once per request."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int | float) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise DataError(f"cannot send a {type(arg).__name__} to Redis")
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


class ScriptPipe:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        kwargs = dict(redis.connection_pool.connection_kwargs)
        # The reader bounds every reply instead: a write timeout would cost a task per write.
        kwargs["socket_timeout"] = None
        connection_class = redis.connection_pool.connection_class
        self._make: Callable[[], AbstractConnection] = lambda: connection_class(**kwargs)
        self._conn: AbstractConnection | None = None
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    async def call(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return await self._evalsha(script, keys, args)
        except NoScriptError:  # Redis restarted and lost its script cache: load, then again
            await self._redis.script_load(script.script)
            return await self._evalsha(script, keys, args)

    async def _evalsha(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]
                       ) -> Any:
        (future,) = await self._send([(b"EVALSHA", script.sha, len(keys), *keys, *args)])
        return await future

    async def pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """Several commands in one write, their replies in order; an error reply raises (the
        first one), as redis-py's pipelines do, once every reply is in."""
        replies = await asyncio.gather(*await self._send(commands), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return replies

    async def _send(self, commands: Sequence[Sequence[Any]]) -> list[asyncio.Future[Any]]:
        """Write `commands` at once; a future for each one's reply."""
        conn = self._conn if self._conn is not None else await self._connect()
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in commands]
        packed = b"".join(resp_command(command) for command in commands)
        # Queued before the write, with no await in between: replies pair with calls in order.
        self._waiting.extend(futures)
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(conn))
        try:
            await conn.send_packed_command(packed, check_health=False)
        except RedisError as exc:
            self._fail(conn, exc)
        return futures

    async def _connect(self) -> AbstractConnection:
        async with self._connecting:
            if self._conn is None:
                conn = self._make()
                try:  # the handshake is a reply like any other: bounded alike
                    async with asyncio.timeout(REPLY_TIMEOUT_S):
                        await conn.connect()  # type: ignore[no-untyped-call]
                except TimeoutError:
                    await conn.disconnect(nowait=True)
                    raise RedisTimeoutError("no answer from Redis while connecting") from None
                self._conn = conn
            return self._conn

    async def _read(self, conn: AbstractConnection) -> None:
        """Replies to their callers, in order, while any are waiting."""
        try:
            while self._waiting and self._conn is conn:
                try:
                    reply: Any = await conn.read_response(timeout=REPLY_TIMEOUT_S)
                except ResponseError as exc:  # this command's error (e.g. NOSCRIPT), not the link's
                    reply = exc
                if reply is None:  # redis-py's way of saying the timeout passed (our scripts
                    raise RedisTimeoutError("no reply from Redis")  # never answer nil)
                future = self._waiting.popleft()
                if future.done():
                    continue  # its caller went away
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except (RedisError, OSError) as exc:
            self._fail(conn, exc if isinstance(exc, RedisError) else RedisConnectionError(
                "connection to Redis lost"))
        finally:
            if self._reader is asyncio.current_task():
                self._reader = None
            if self._waiting and self._conn is not None:  # calls came in as it finished
                self._reader = asyncio.create_task(self._read(self._conn))

    def _fail(self, conn: AbstractConnection, exc: RedisError) -> None:
        if self._conn is not conn:
            return
        self._conn = None
        waiting, self._waiting = self._waiting, collections.deque()
        for future in waiting:
            if not future.done():
                future.set_exception(exc)
        closing = asyncio.get_running_loop().create_task(conn.disconnect(nowait=True))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        if self._reader is not None:
            await asyncio.wait({self._reader}, timeout=REPLY_TIMEOUT_S)
        if self._closing:
            await asyncio.wait(self._closing)
        if self._conn is not None:
            await self._conn.disconnect()
            self._conn = None


RESEND_DELAYS_S = (0.1, 0.3)
# Answers that mean "not here, or not now": the slot moved, or the Cluster is failing over.
_ELSEWHERE = (RedisConnectionError, RedisTimeoutError, AskError, ClusterDownError, TryAgainError)


class ScriptPipes:
    """A `ScriptPipe` per primary; each call goes to the primary that holds its first key."""

    def __init__(self, primaries: Primaries) -> None:
        self._primaries = primaries
        self._pipes: dict[int, ScriptPipe] = {}  # by the primary's client

    def pipe(self, client: Redis) -> ScriptPipe:
        """The pipe to the primary `client` speaks to (made on first use)."""
        pipe = self._pipes.get(id(client))
        if pipe is None:
            pipe = self._pipes[id(client)] = ScriptPipe(client)
        return pipe

    async def call(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        delays = RESEND_DELAYS_S if self._primaries.failover else ()
        for delay in (*delays, None):
            try:
                client = self._primaries.client_for(keys[0])  # none known mid-failover: raises
                return await self.pipe(client).call(script, keys, args)
            except _ELSEWHERE:
                if delay is None:
                    raise
            await asyncio.sleep(delay)
            await self._primaries.refresh()
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self) -> None:
        for pipe in self._pipes.values():
            await pipe.close()
