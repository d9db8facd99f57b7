"""Writes that follow a request (settlements, idempotent results), batched per worker.

A request queues its writes (each one Redis command) and is done: no task, no await, so a
cancelled request still settles. One background task flushes whatever has queued as one
pipeline (written straight to a connection of its own per primary, proxy.store.script_pipe:
redis-py's pipeline cost ~30 µs of CPU per settlement), at most every
`FLUSH_INTERVAL_S`: one round trip and, with `appendfsync always`, one fsync shared by every
request that finished meanwhile. Redis fsyncs on its main thread, so every admission waits out an
fsync in progress; fewer, larger batches keep those stalls rare. A batch
that fails is retried with backoff (every write in it is safe to repeat: a settle of an ended hold
does nothing, SET and DEL are idempotent) and, past the last attempt, dropped: its holds expire and
the sweeper releases them, so a lost settlement never over-charges (reconcile reports it until
then).

Each write names the key it goes to, so a batch is split by the primary that holds each key (one
pipeline per Cluster node, as they all are with one Redis). A part of a batch that fails is sent
again where its keys are now (the Cluster's slot map is read again first).

With `ack_replicas`, each pipeline ends with a write that always replicates (a marker in the
first key's slot) and a WAIT on the same connection: the batch is done once that many replicas
have everything up to it, so a failover to one of them loses no settled charge. A write no
replica confirmed within the WAIT's second is kept, with the run id of the Redis that took it,
until one does (for up to `CONFIRM_FOR_S`): while that server is still the primary, each later
batch's marker and WAIT cover it (it is not run again); once another server holds its keys (a
replica promoted without it: a Sentinel's second, hasty failover discards what its short-lived
primary took), it is sent there, where its hold is gone and never ended, so the charge is made
anew from what is available. Guests' usage entries are never sent twice (not idempotent; no
money): one stranded that way is counted as at risk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

from proxy.credits.ledger import Arg
from proxy.observe.metrics import Metrics
from proxy.store.client import Primaries, replica_wait
from proxy.store.script_pipe import ScriptPipe, ScriptPipes

log = logging.getLogger("proxy.settler")


Command = tuple[Arg, ...]  # one Redis command and its arguments, as sent


@dataclass(frozen=True, slots=True)
class Write:
    key: str  # the key it writes (all its keys share this one's slot)
    command: Command
    repeatable: bool = True  # running it again changes nothing (a settle of a hold, SET, DEL)
    # Written, and no replica confirmed it yet: since when, and the run id of the Redis that
    # took it (a later WAIT there covers it; another one needs it sent again).
    unconfirmed_since: float = 0.0
    taken_by: bytes | None = None

# ~16 s in all: a Redis restart fits, and a Cluster's or Sentinel's failover (a few seconds).
RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
FLUSH_INTERVAL_S = 0.01  # a hold lives at most this much longer; Redis fsyncs <= 100 times a second
MAX_QUEUED = 100_000  # beyond this (Redis gone for long) the oldest writes are dropped
# How long an unconfirmed write is kept (and sent where its keys moved): within the two minutes
# settle.lua remembers an ended hold, so a write that did land is never charged twice.
CONFIRM_FOR_S = 60.0


class Settler:
    def __init__(self, primaries: Primaries, scripts: Sequence[AsyncScript],
                 metrics: Metrics | None = None, *, ack_replicas: int = 0,
                 confirm_for_s: float = CONFIRM_FOR_S) -> None:
        self._primaries = primaries
        self._ack_replicas = ack_replicas
        self._confirm_for_s = confirm_for_s
        self._scripts = tuple(scripts)
        self._metrics = metrics
        self._pipes = ScriptPipes(primaries)  # one connection per primary
        self._queue: list[Write] = []
        self._flushing = 0
        self._wake = asyncio.Event()
        self.lost = 0  # writes dropped after every retry failed
        self.unreplicated = 0  # writes no replica confirmed, given up on (at risk in a failover)

    @property
    def pending(self) -> int:
        """Writes queued or being flushed."""
        return len(self._queue) + self._flushing

    def add(self, key: str, command: Command, *, repeatable: bool = True) -> None:
        """Queue a write to `key` (and keys in its slot)."""
        if len(self._queue) >= MAX_QUEUED:
            self._queue.pop(0)
            self._lose(1)
        self._queue.append(Write(key, command, repeatable))
        self._wake.set()

    def settle(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Arg], *,
               repeatable: bool = True) -> None:
        """Queue one call of a registered script."""
        self.add(keys[0], ("EVALSHA", script.sha, len(keys), *keys, *args),
                 repeatable=repeatable)

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
        """At shutdown: flush what is left, within `timeout_s`, then close the connections."""
        try:
            async with asyncio.timeout(timeout_s):
                while self._queue:
                    await self.flush()
        except TimeoutError:
            written = [w for w in self._queue if w.unconfirmed_since]  # landed, unconfirmed
            self._unreplicated(len(written))
            self._lose(len(self._queue) - len(written))
        await self._pipes.close()

    async def _write(self, batch: list[Write]) -> None:
        for attempt, delay in enumerate((0.0, *RETRY_DELAYS_S)):
            if delay:
                await asyncio.sleep(delay)
                await self._primaries.refresh()  # a Cluster's slot may have moved
            groups: dict[int, tuple[Redis, list[Write]]] = {}
            unrouted: list[Write] = []
            errors: list[RedisError] = []
            for write in batch:
                try:
                    client = self._primaries.client_for(write.key)
                except RedisError as exc:
                    unrouted.append(write)
                    errors.append(exc)
                    continue
                groups.setdefault(id(client), (client, []))[1].append(write)
            failed = await asyncio.gather(*(self._send(c, ws) for c, ws in groups.values()))
            batch = unrouted + [w for (_, writes), error in zip(groups.values(), failed,
                                                                strict=True)
                                if error is not None for w in writes]
            if not batch:
                return
            errors += [e for e in failed if e is not None]
            if self._metrics is not None:
                self._metrics.redis_errors.labels("settlement").inc()
            if attempt < len(RETRY_DELAYS_S):
                log.warning("%d settlement write(s) failed (%s: %s); retrying", len(batch),
                            type(errors[0]).__name__, str(errors[0])[:200])
        self._lose(len(batch))

    async def _send(self, client: Redis, writes: list[Write]) -> RedisError | None:
        """One pipeline to one primary (then WAIT for replicas); the error, if it failed.
        Writes this very server took before and no replica confirmed yet are not sent again:
        the WAIT after this pipeline's marker covers them (so a replica's outage costs one
        marker and WAIT per flush, not every unconfirmed write run again)."""
        pipe = self._pipes.pipe(client)
        run = pipe.run
        send: list[Write] = []
        waiting: list[Write] = []
        stranded = 0  # taken by a server that is gone, and not safe to run twice
        for w in writes:
            if w.taken_by is None or (w.taken_by != run and w.repeatable):
                send.append(w)
            elif w.taken_by == run:
                waiting.append(w)
            else:
                stranded += 1
        self._unreplicated(stranded)
        try:
            try:
                replies = await self._pipeline(pipe, send, writes[0].key)
            except NoScriptError:  # a server new to this client, or restarted: load, again
                await self._load_scripts(client)
                replies = await self._pipeline(pipe, send, writes[0].key)
        except RedisError as exc:
            return exc
        took = pipe.run  # the server this pipeline reached
        if waiting and took != run:  # another one (the primary moved): they were not covered
            self._queue[:0] = waiting  # and go to it next time
            self._wake.set()
            waiting = []
        if self._ack_replicas and int(str(replies[-1])) < self._ack_replicas:
            self._unconfirmed([replace(w, taken_by=took) for w in send] + waiting,
                              int(str(replies[-1])))
        return None

    def _unconfirmed(self, writes: list[Write], confirmed: int) -> None:
        """No replica confirmed `writes` in time: keep them (with the next batch: sent again
        where another server holds their keys now) for up to `confirm_for_s` since first
        written; count the others as at risk."""
        now = time.monotonic()
        again = [replace(w, unconfirmed_since=w.unconfirmed_since or now) for w in writes
                 if now - (w.unconfirmed_since or now) < self._confirm_for_s]
        if again:
            self._queue[:0] = again
            self._wake.set()
        self._unreplicated(len(writes) - len(again))
        log.warning("%d settlement write(s) reached %d of %d replica(s) in time; kept until "
                    "one does", len(writes), confirmed, self._ack_replicas)

    def _unreplicated(self, count: int) -> None:
        if not count:
            return
        self.unreplicated += count
        if self._metrics is not None:
            self._metrics.settlements_unreplicated.inc(count)
        log.error("%d settlement write(s) no replica confirmed; a failover now could lose them",
                  count)

    async def _pipeline(self, pipe: ScriptPipe, writes: list[Write], key: str
                        ) -> list[object]:
        commands = [write.command for write in writes]
        commands += replica_wait(key, self._ack_replicas)
        return await pipe.pipeline(commands)

    async def _load_scripts(self, client: Redis) -> None:
        try:
            for script in self._scripts:
                await client.script_load(script.script)
        except RedisError:
            pass  # the next attempt fails on its own and is retried

    def _lose(self, count: int) -> None:
        if not count:
            return
        self.lost += count
        if self._metrics is not None:
            self._metrics.settlements_lost.inc(count)
        log.error("%d settlement write(s) lost after retries; their holds expire and are "
                  "released by the sweeper", count)
