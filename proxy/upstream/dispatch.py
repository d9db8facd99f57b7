"""The dispatcher: a request runs when one of its pool's engines has a free slot, and waits in
the gateway (tier order, proxy.upstream.queue) while none has, so the engines' own first-in
first-out queues stay short and the queue that decides who runs next is ours.

    slots     a backend's `max_concurrency` (backends.toml): the requests its engine runs at
              once (vLLM `--max-num-seqs`, TGI `--max-concurrent-requests`, a speech or image
              server's concurrency), counted across every worker and gateway host in the
              rate-limit Redis (proxy.upstream.slots)
    fast path a request whose pool has nobody waiting here takes a slot in one script call
              (on the first of the pool's preferred backends with one free) and goes
    waiting   otherwise it queues; each pool with waiters has a pump that tries for its next
              waiter whenever a slot of this worker frees, and every `POLL_S` for slots freed
              elsewhere. A request of a higher tier waiting in any gateway holds back a lower
              tier's take, so the order holds across processes.
    shedding  a tier whose expected wait (requests ahead of it, by how fast the pool's slots
              free) passes its `max_queue_wait_s` is answered 503 pool_saturated at once, with
              that wait as Retry-After; one that waits that long is answered the same
    leaving   a client that disconnects while queued leaves the queue (nothing was held
              upstream; its credit hold is released as for any request that never ran)

If the rate-limit Redis cannot be reached, each worker falls back to its own counts (a backend
takes up to `max_concurrency` from each worker, as before the dispatcher) and its own queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from proxy.errors import ErrorKind, GatewayError
from proxy.observe.metrics import Metrics
from proxy.upstream.pool import Backend, Pool
from proxy.upstream.prefixes import Prompt
from proxy.upstream.queue import Drain, Ticket, TierQueue, Waiter
from proxy.upstream.slots import BEAT_S, SlotLedger

log = logging.getLogger("proxy.dispatch")

POLL_S = 0.02  # a waiting pool asks for slots freed in other processes this often


class Early:
    """A slot being taken while admission runs (its round trip in parallel with admission's):
    the first upstream call uses it; a request that never makes that call gives it back."""

    __slots__ = ("pool", "prompt", "task", "used")

    def __init__(self, pool: Pool, prompt: Prompt | None, task: asyncio.Task[Backend]) -> None:
        self.pool = pool
        self.prompt = prompt  # the request's prompt blocks, hashed once
        self.task = task
        self.used = False

    async def take(self) -> Backend:
        self.used = True
        return await self.task


@dataclass(frozen=True, slots=True)
class Want:
    """What a waiter asks for besides its ticket: its prompt's blocks and a backend to avoid."""

    prompt: Prompt | None
    exclude: Backend | None
    queued_at: float


class Dispatcher:
    """One per worker process."""

    def __init__(self, ledger: SlotLedger | None, metrics: Metrics) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self._queues: dict[str, TierQueue] = {}
        self._drains: dict[str, Drain] = {}
        self._wakes: dict[str, asyncio.Event] = {}
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._shared = ledger is not None  # False while the ledger's Redis is unreachable
        self._started = asyncio.Event()  # set at the first take: the heartbeat begins

    async def acquire(self, pool: Pool, ticket: Ticket | None, *, prompt: Prompt | None = None,
                      exclude: Backend | None = None) -> Backend:
        """A backend of `pool` with a slot held for this request (give it back with
        `release`); 503 when none can be had within the ticket's longest wait. Without a
        ticket (no tier: internal calls), no queue: the pick as before."""
        queue = self._queues.get(pool.key)
        if ticket is None:
            return pool.pick(exclude=exclude, prompt=prompt)
        ahead, counted = 0, False
        if not queue:  # nobody waits here: try at once (counted as waiting if it must)
            taken, ahead, counted = await self._take(pool, ticket, prompt, exclude, queue=True)
            if taken is not None:
                pool.placed(taken, prompt)
                return taken
        return await self._wait(pool, ticket, Want(prompt, exclude, time.monotonic()), ahead,
                                counted)

    def start(self, pool: Pool, ticket: Ticket | None, prompt: Prompt | None) -> Early | None:
        """Begin taking a slot now, for a request about to be admitted; None without a
        ticket or a shared ledger (nothing to save then)."""
        if ticket is None or self.ledger is None:
            return None
        return Early(pool, prompt, asyncio.get_running_loop().create_task(
            self.acquire(pool, ticket, prompt=prompt)))

    def forget(self, early: Early | None) -> None:
        """The request ended without using its early slot (refused at admission, or failed
        before its upstream call): the slot goes back, now or once the take lands."""
        if early is None or early.used:
            return

        def give_back(task: asyncio.Task[Backend]) -> None:
            if not task.cancelled() and task.exception() is None:
                self.release(early.pool, task.result(), 0.0)

        if early.task.done():
            give_back(early.task)
        else:
            early.task.cancel()  # a waiter leaves its queue; a take already sent lands later
            early.task.add_done_callback(give_back)

    def release(self, pool: Pool, backend: Backend, held_s: float) -> None:
        """The request is done with its slot: give it back, and let a waiter try."""
        self._drain(pool).observe(held_s)
        if self.ledger is not None:
            self._spawn(self._give_back(backend))
        for wake in self._wakes.values():  # the backend may serve waiters of other pools too
            wake.set()

    async def in_flight(self) -> dict[str, int] | None:
        """Slots in use per backend, fleet-wide; None without the shared ledger."""
        if self.ledger is None or not self._shared:
            return None
        try:
            return await self.ledger.in_flight()
        except RedisError:
            return None

    def waiting(self) -> dict[str, dict[str, int]]:
        """Waiters in this worker, by pool and tier (for /admin/backends)."""
        return {name: queue.depth() for name, queue in self._queues.items() if queue}

    async def run(self) -> None:
        """Forever: the heartbeat that keeps this process's slots its own (a process that
        stops beating is taken for crashed and what it held is given back). It begins with the
        process's first request upstream: a gateway that never sends one writes nothing."""
        if self.ledger is None:
            return
        await self._started.wait()
        while True:
            try:
                await self.ledger.beat()
                if not self._shared:
                    log.warning("the slot ledger answers again: slots are shared once more")
                self._shared = True
            except RedisError:
                if self._shared:
                    log.warning("the slot ledger is unreachable: each worker counts its own "
                                "slots until it answers")
                self._shared = False
            await asyncio.sleep(BEAT_S)

    async def close(self) -> None:
        for task in (*self._pumps.values(), *self._background):
            task.cancel()
        await asyncio.gather(*self._pumps.values(), *self._background,
                             return_exceptions=True)
        if self.ledger is not None:
            await self.ledger.close()

    # --- taking a slot -------------------------------------------------------------------

    async def _take(self, pool: Pool, ticket: Ticket, prompt: Prompt | None,
                    exclude: Backend | None, *, queue: bool = False
                    ) -> tuple[Backend | None, int, bool]:
        """A slot on the first preferred backend with one free; None when all are full (or a
        higher tier waits), with how many wait ahead of the ticket in every gateway (0 where
        unknown) and whether the ledger now counts it as waiting (`queue`). 503 when the pool
        has no available backend at all."""
        if self.ledger is None:  # dispatch off: this worker's cap, 503 beyond it
            return pool.preferred(exclude=exclude, prompt=prompt)[0], 0, False
        preferred = pool.preferred(exclude=exclude, prompt=prompt, capped=False)
        if not self._started.is_set():  # this process's first: known alive before it takes
            self._started.set()
            with contextlib.suppress(RedisError):
                await self.ledger.beat()
        if self._shared:
            call = asyncio.ensure_future(self.ledger.take(
                pool.key, ticket.priority, ticket.higher,
                [(b.name, b.spec.max_concurrency) for b in preferred], queue=queue))
            try:
                name, ahead = await asyncio.shield(call)
                taken = next((b for b in preferred if b.name == name), None)
                return taken, ahead, queue and taken is None
            except RedisError:
                self._shared = False
            except asyncio.CancelledError:
                # The script runs anyway (it was sent): undo what it did once it lands.
                call.add_done_callback(
                    lambda done: self._undo(done, pool, ticket, preferred, queue))
                raise
        # The ledger is unreachable: this worker's own counts, its own queue.
        local = next((b for b in preferred if b.outstanding < b.spec.max_concurrency), None)
        return local, 0, False

    def _undo(self, done: asyncio.Future[tuple[str | None, int]], pool: Pool, ticket: Ticket,
              preferred: list[Backend], queue: bool) -> None:
        """A take whose requester was cancelled: give back the slot, or (`queue`) stop
        counting it as waiting."""
        if done.cancelled() or done.exception() is not None:
            return
        name, _ = done.result()
        taken = next((b for b in preferred if b.name == name), None)
        if taken is not None:
            self.release(pool, taken, 0.0)
        elif queue:
            self._queued(pool, ticket, -1)

    async def _give_back(self, backend: Backend) -> None:
        assert self.ledger is not None
        with contextlib.suppress(RedisError):
            await self.ledger.give_back(backend.name)

    # --- waiting ---------------------------------------------------------------------------

    async def _wait(self, pool: Pool, ticket: Ticket, want: Want, ahead: int,
                    counted: bool) -> Backend:
        """Queue for a slot; `ahead`: waiters ahead of it in every gateway, as last counted;
        `counted`: the ledger already counts it as waiting."""
        queue = self._queues.setdefault(pool.key, TierQueue())
        # Its place by the tier order and the accounts' turns, in this worker's queue; the
        # other gateways' waiters (`ahead` counts every gateway's) in the same proportion.
        local = queue.ahead(ticket.priority)
        place = queue.place(ticket)
        if ahead > local:
            place = math.ceil(place * ahead / local) if local else ahead
        expected = self._drain(pool).wait_s(place, _slots(pool))
        if expected > ticket.max_wait_s:
            if counted:
                self._queued(pool, ticket, -1)
            self.metrics.shed(pool.model, ticket.tier, "expected")
            raise _saturated(pool, ticket, expected)
        waiter = Waiter(ticket, want=want)
        queue.push(waiter)
        self.metrics.queued(pool.model, ticket.tier, 1)
        if not counted:
            self._queued(pool, ticket, 1)
        self._pump(pool)
        try:
            async with asyncio.timeout(ticket.max_wait_s):
                backend: Backend = await asyncio.shield(waiter.granted)
        except BaseException as exc:
            waiter.leave()
            if waiter.granted.done() and not waiter.granted.cancelled():
                # Granted as it gave up: the slot goes back (and to the next waiter).
                self.release(pool, waiter.granted.result(), 0.0)
            else:
                waiter.granted.cancel()
            if isinstance(exc, TimeoutError):
                self.metrics.shed(pool.model, ticket.tier, "waited")
                raise _saturated(pool, ticket, self._drain(pool).wait_s(
                    queue.ahead(ticket.priority), _slots(pool))) from None
            raise
        finally:
            self.metrics.queued(pool.model, ticket.tier, -1)
            self._queued(pool, ticket, -1)
        self.metrics.waited(pool.model, ticket.tier, time.monotonic() - want.queued_at)
        pool.placed(backend, want.prompt)
        return backend

    def _pump(self, pool: Pool) -> None:
        running = self._pumps.get(pool.key)
        if running is None or running.done():
            self._wakes.setdefault(pool.key, asyncio.Event())
            self._pumps[pool.key] = asyncio.get_running_loop().create_task(self._serve(pool))

    async def _serve(self, pool: Pool) -> None:
        """While anyone waits for `pool`: a slot for the next waiter, as slots free."""
        queue = self._queues[pool.key]
        wake = self._wakes[pool.key]
        while (head := queue.peek()) is not None:
            if head.granted.done():  # gave up meanwhile
                queue.remove(head)
                continue
            want: Want = head.want
            try:
                taken, _, _ = await self._take(pool, head.ticket, want.prompt, want.exclude)
            except GatewayError as exc:  # no backend available at all: tell them all
                while (gone := queue.pop()) is not None:
                    if not gone.granted.done():
                        gone.granted.set_exception(exc)
                return
            if taken is not None:
                if queue.peek() is head and not head.granted.done():
                    queue.pop()
                    head.granted.set_result(taken)
                else:  # it left while we asked: the slot goes back
                    self.release(pool, taken, self._drain(pool).held_s)
                continue
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), POLL_S)

    def _queued(self, pool: Pool, ticket: Ticket, delta: int) -> None:
        """Tell the other gateways (a higher tier waiting holds back lower tiers' takes)."""
        if self.ledger is not None and self._shared:
            self._spawn(self._count_queued(pool.key, ticket.priority, delta))

    async def _count_queued(self, pool: str, priority: int, delta: int) -> None:
        assert self.ledger is not None
        with contextlib.suppress(RedisError):
            await self.ledger.queued(pool, priority, delta)

    def _drain(self, pool: Pool) -> Drain:
        drain = self._drains.get(pool.key)
        if drain is None:
            drain = self._drains[pool.key] = Drain()
        return drain

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _slots(pool: Pool) -> int:
    return sum(b.spec.max_concurrency for b in pool.backends if b.healthy) or 1


def _saturated(pool: Pool, ticket: Ticket, wait_s: float) -> GatewayError:
    retry = max(1, min(300, math.ceil(wait_s)))
    return GatewayError(
        ErrorKind.POOL_SATURATED,
        f"model {pool.model!r} is busy: tier {ticket.tier!r} would wait about {wait_s:.1f} s "
        f"for a slot, longer than its {ticket.max_wait_s:g} s; retry in {retry} s",
        headers={"Retry-After": str(retry)})
