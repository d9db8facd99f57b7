"""Hot-path script calls over one connection, pipelined as they come.

Every request's admission is one EVALSHA (`call`); the settler's batches are one write of many
commands (`pipeline`). Through redis-py's client each call costs ~60 µs of CPU (pool checkout,
a timeout task per write, retry and encoding wrappers). Here redis-py makes the connection and
its handshake (TLS, AUTH, SELECT: whatever the client's URL asks for), then the pipe takes its
transport over: each command is packed (hiredis) and written at once, and the replies
are parsed as they arrive (hiredis, redis-py's own error classes) straight into the futures of
the calls waiting for them, oldest first (Redis answers a connection's commands in the order
they came). No reader task and no stream buffer sit between the socket and the caller: at
1,000 requests/s admission's median round trip fell from ~150 to ~130 µs (timed inside the
worker) against redis-py's connection read by a task. Calls made while others are in flight
share the connection's round trips, as a pipeline would.

A connection that fails (refused, reset, no reply or handshake within `REPLY_TIMEOUT_S`) fails
every call in flight on it with the error, and the next call connects afresh: callers treat
that as the store being unreachable. A caller that is cancelled while waiting does not stop its
command: whoever cancels must assume it ran (see `ChatMeter` and its stages).

Each connection learns the run id of the Redis process it reached (`INFO server`, once, after the
handshake): a command may carry `SERVER_RUN` among its arguments, sent as that run id. A Redis
that restarted, or a replica promoted in its place, is a new process on a new connection, so the
id a command carries is always that of the server that runs it (the ledger tags soft state with
it: proxy.credits.lua).

`ScriptPipes` keeps one pipe per primary (runtime.store.Primaries) and sends each call to the one
holding its first key. With a Cluster or Sentinels, a call that meets a moved slot or a lost
primary looks the primary up again and is sent again (twice at most, 0.1 s then 0.3 s later): a
failover costs the calls made while it lasts an error, never a wrong answer. A call sent twice
may run twice: admission's script makes that harmless (a hold id is placed once).
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import hiredis
from redis._parsers import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterDownError,
    DataError,
    InvalidResponse,
    NoScriptError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from proxy.store.client import Primaries, primary_address

REPLY_TIMEOUT_S = 2.0
_PENDING = object()  # hiredis' answer while a reply is still incomplete
_RUN_ID = re.compile(rb"run_id:([0-9a-f]+)")


class _ServerRun:
    """Stands among a command's arguments for the run id of the server that runs it."""

    def __repr__(self) -> str:
        return "SERVER_RUN"


SERVER_RUN = _ServerRun()


def resp_command(args: Sequence[Any]) -> bytes:
    """One command in Redis' wire format, packed by hiredis as redis-py packs it when hiredis is
    installed (~0.8 µs; a packer in Python took ~2.8): this runs once per request."""
    try:
        return cast(bytes, hiredis.pack_command(tuple(args)))
    except TypeError as exc:  # a bool, None, a list: nothing Redis takes
        raise DataError(str(exc)) from None


class ScriptPipe:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        kwargs = dict(redis.connection_pool.connection_kwargs)
        # The link bounds every reply instead (a socket timeout would cost a timer per read).
        kwargs["socket_timeout"] = None
        connection_class = redis.connection_pool.connection_class
        self._make: Callable[[], AbstractConnection] = lambda: connection_class(**kwargs)
        self._primary = primary_address(redis)
        self._link: _Link | None = None
        self._connecting = asyncio.Lock()
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def run(self) -> bytes | None:
        """The run id of the Redis process the pipe is connected to (None: not connected)."""
        link = self._link
        return link.run if link is not None and link.open else None

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
        link = self._link
        if link is None or not link.open or self._moved(link):
            link = await self._connect()
        return link.send(b"".join(resp_command(
            [link.run if arg is SERVER_RUN else arg for arg in command] if SERVER_RUN in command
            else command) for command in commands), len(commands))

    def _moved(self, link: _Link) -> bool:
        """The Sentinels named another primary since `link` was made (see follow_primary)."""
        primary = self._primary()
        return primary is not None and primary != link.address

    async def _connect(self) -> _Link:
        async with self._connecting:
            if self._link is not None and self._link.open and self._moved(self._link):
                self._retire(self._link)
                self._link = None
            if self._link is None or not self._link.open:
                conn = self._make()
                try:  # the handshake is a reply like any other: bounded alike
                    async with asyncio.timeout(REPLY_TIMEOUT_S):
                        await conn.connect()  # type: ignore[no-untyped-call]
                        await conn.send_command("INFO", "server")
                        info = await conn.read_response()
                except TimeoutError:
                    await conn.disconnect(nowait=True)
                    raise RedisTimeoutError("no answer from Redis while connecting") from None
                found = _RUN_ID.search(info if isinstance(info, bytes) else str(info).encode())
                if found is None:
                    await conn.disconnect(nowait=True)
                    raise InvalidResponse("INFO server named no run_id")
                self._link = _Link(conn, self._disconnect, found[1])
            return self._link

    def _retire(self, link: _Link) -> None:
        """Let the calls in flight on `link` have their replies (bounded), then close it."""
        async def retire() -> None:
            await link.finish(REPLY_TIMEOUT_S)
            link.fail(RedisConnectionError("the primary moved"))

        closing = asyncio.get_running_loop().create_task(retire())
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def _disconnect(self, conn: AbstractConnection) -> None:
        # nowait: redis-py's reader no longer sees the socket, so it would wait for a close
        # it is never told of.
        closing = asyncio.get_running_loop().create_task(conn.disconnect(nowait=True))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            await link.finish(REPLY_TIMEOUT_S)
            link.fail(RedisConnectionError("the pipe is closed"))
        if self._closing:
            await asyncio.wait(self._closing)


class _Link(asyncio.Protocol):
    """One connection after its handshake: the protocol of its transport from then on."""

    def __init__(self, conn: AbstractConnection,
                 disconnect: Callable[[AbstractConnection], None], run: bytes) -> None:
        self.open = True
        self.run = run  # the run id of the Redis process at the other end
        self.address = (getattr(conn, "host", None), getattr(conn, "port", None))
        self._conn = conn
        self._disconnect = disconnect
        self._loop = asyncio.get_running_loop()
        # redis-py keeps the transport behind its StreamWriter (no public accessor; private
        # names of libraries are listed in tests/test_contracts.py).
        self._transport = cast(asyncio.Transport, conn._writer.transport)  # type: ignore[union-attr]
        # Error replies become redis-py's own exceptions (NoScriptError, MOVED, ...), as its
        # hiredis parser makes them. Its own "no whole reply yet" marker: False is a reply under
        # RESP3.
        self._parser = hiredis.Reader(protocolError=InvalidResponse,
                                      replyError=BaseParser.parse_error,
                                      notEnoughData=_PENDING)
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._heard = 0.0  # when the last reply came, or the oldest call began to wait
        self._timer: asyncio.TimerHandle | None = None
        self._idle: asyncio.Future[None] | None = None  # set by `finish`
        self._transport.set_protocol(self)

    def send(self, packed: bytes, count: int) -> list[asyncio.Future[Any]]:
        futures = [self._loop.create_future() for _ in range(count)]
        if not self._waiting:
            self._heard = self._loop.time()
        self._waiting.extend(futures)  # before the write: replies pair with calls in order
        self._transport.write(packed)
        if self._timer is None:
            self._timer = self._loop.call_at(self._heard + REPLY_TIMEOUT_S, self._check)
        return futures

    def data_received(self, data: bytes) -> None:
        self._heard = self._loop.time()
        self._parser.feed(data)
        try:
            while (reply := self._parser.gets()) is not _PENDING:
                if not self._waiting:
                    raise InvalidResponse("a reply nobody asked for")
                future = self._waiting.popleft()
                if future.done():
                    continue  # its caller went away
                if isinstance(reply, Exception):  # this command's error, not the link's
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except InvalidResponse as exc:
            self.fail(exc)
            return
        if not self._waiting and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError("connection to Redis lost"))

    def _check(self) -> None:
        """No reply for REPLY_TIMEOUT_S while calls wait: the link is dead (a hung Redis)."""
        self._timer = None
        if not self._waiting or not self.open:
            return
        due = self._heard + REPLY_TIMEOUT_S
        if self._loop.time() >= due:
            self.fail(RedisTimeoutError("no reply from Redis"))
        else:
            self._timer = self._loop.call_at(due, self._check)

    async def finish(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) for the replies still due."""
        if self._waiting and self.open:
            self._idle = self._loop.create_future()
            await asyncio.wait({self._idle}, timeout=timeout_s)

    def fail(self, exc: RedisError) -> None:
        """End the link: every call still waiting gets `exc`."""
        if not self.open:
            return
        self.open = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, collections.deque()
        for future in waiting:
            if not future.done():
                future.set_exception(exc)
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        self._disconnect(self._conn)


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
