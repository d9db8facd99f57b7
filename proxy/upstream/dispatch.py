"""The dispatcher: a request runs when one of its pool's engines has a free slot, and waits in
the gateway (tier order, proxy.upstream.queue) while none has, so the engines' own first-in
first-out queues stay short and the queue that decides who runs next is ours.

    slots     a backend's `max_concurrency` (backends.toml): the requests its engine runs at
              once (vLLM `--max-num-seqs`, TGI `--max-concurrent-requests`, a speech or image
              server's concurrency), for vLLM `[routing] engine_queue` more to wait in its own
              queue (pool.Backend.queued: a tier's only while no higher tier sends), counted
              across every worker and gateway host in the rate-limit Redis (upstream.slots)
    arriving  one script call (in parallel with admission's): a slot on the first of the
              pool's preferred backends with one free, when nobody in any gateway waits ahead
              of the request (a higher tier, or an earlier turn of its own tier: fair queuing
              over accounts, proxy.upstream.queue.Turns); otherwise it waits, with its turn
    holders   a prompt whose holders' slots are all taken, while another replica has one free,
              waits for a holder's slot (asking again as slots free, holding no place in the
              queue) as long as prefilling it elsewhere would cost (routing.Ranking), unless
              requests queue meanwhile
    waiting   each pool with waiters has a pump that asks for its next waiter's slot whenever
              a slot of this worker frees, and every `POLL_S` for slots freed elsewhere; the
              ledger grants it only when no waiter of any gateway comes before it
    shedding  a request whose expected wait (the requests ahead of it in every gateway, by how
              fast the pool's slots free) passes its tier's `max_queue_wait_s` is answered 503
              pool_saturated at once, with that wait as Retry-After; one that waits that long
              is answered the same
    spares    while a pool is far from full, a worker keeps a few slots between its requests
              (proxy.upstream.spares): most of its requests then make no ledger call at all
    leaving   a client that disconnects while queued leaves the queue (nothing was held
              upstream; its credit hold is released as for any request that never ran)

If the rate-limit Redis cannot be reached, each worker falls back to its own counts (a backend
takes up to its slots from each worker, as before the dispatcher) and its own queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any

from redis.exceptions import RedisError

from proxy.errors import GatewayError
from proxy.observe.metrics import Metrics
from proxy.store.background import stop_task
from proxy.upstream.early import Early
from proxy.upstream.holdings import Holdings
from proxy.upstream.pool import Backend, Pool
from proxy.upstream.prefixes import Prompt
from proxy.upstream.queue import Drain, Ticket, TierQueue, Turns, Waiter, Want, saturated
from proxy.upstream.routing import Ranking
from proxy.upstream.slots import BEAT_S, SlotLedger, Taken, free_here, offer
from proxy.upstream.spares import Spares

log = logging.getLogger("proxy.dispatch")

POLL_S = 0.02  # a waiting pool asks for slots freed in other processes this often
HOLDER_POLL_S = 0.01  # ... and a request waiting for its prompt's holder (it holds no place)


class Dispatcher:
    """One per worker process."""

    def __init__(self, ledger: SlotLedger | None, metrics: Metrics) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self._queues: dict[str, TierQueue] = {}
        self._turns: dict[tuple[str, int], Turns] = {}  # while the ledger is unreachable
        self._drains: dict[str, Drain] = {}
        self._wakes: dict[str, asyncio.Event] = {}
        self._pumps: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._shared = ledger is not None  # False while the ledger's Redis is unreachable
        self._started = asyncio.Event()  # set at the first take: the heartbeat begins
        self._slot_freed: dict[str, asyncio.Future[None]] = {}  # backend -> its next give-back
        self.spares = Spares(lambda name, count: self._spawn(self._give_back(name, count)))
        self.held = Holdings()  # what the heartbeat tells the ledger this process holds

    async def acquire(self, pool: Pool, ticket: Ticket | None, *, prompt: Prompt | None = None,
                      exclude: Backend | None = None) -> Backend:
        """A backend of `pool` with a slot held for this request (give it back with
        `release`); 503 when none can be had within the ticket's longest wait. Without a
        ticket (no tier: internal calls), no queue: the pick as before."""
        if ticket is None:  # released like any other: counted like any other
            picked = pool.pick(exclude=exclude, prompt=prompt)
            self.held.granted([picked])
            return picked
        waiter = Waiter(ticket, want=Want(prompt, exclude, time.monotonic()))
        taken = await self._arrive(pool, waiter) or await self._wait(pool, waiter)
        pool.placed(taken[0], prompt)
        return taken[0]

    async def acquire_distinct(self, pool: Pool, ticket: Ticket | None, n: int
                               ) -> list[tuple[Pool, Early | None]]:
        """`n` distinct backends of `pool` for one network-mode request, as one-backend
        pools; with the dispatcher, each with its slot (taken all at once, so two requests
        never each hold part of what the other needs, waiting in `ticket`'s place until they
        are free) for the replica's call to use, or `forget`."""
        if ticket is None or self.ledger is None:
            return [(Pool(pool.model, [b], key=pool.key), None) for b in pool.pick_distinct(n)]
        waiter = Waiter(ticket, want=Want(None, None, time.monotonic(), n))
        taken = await self._arrive(pool, waiter) or await self._wait(pool, waiter)
        replicas: list[tuple[Pool, Early | None]] = []
        for backend in taken:
            replica = Pool(pool.model, [backend], key=pool.key)
            replicas.append((replica, Early.held(replica, backend)))
        return replicas

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

        def give_back(task: asyncio.Future[Backend]) -> None:
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
        self.held.released(backend.name)
        if self.ledger is not None and not (self._shared and not self._waiting()
                                            and self.spares.keep(backend)):
            self._spawn(self._give_back(backend.name))
        for wake in self._wakes.values():  # the backend may serve waiters of other pools too
            wake.set()
        if (freed := self._slot_freed.pop(backend.name, None)) is not None:
            freed.set_result(None)

    async def in_flight(self) -> dict[str, int] | None:
        """Slots in use per backend, fleet-wide; None without the shared ledger."""
        if self.ledger is not None and self._shared:
            with contextlib.suppress(RedisError):
                return await self.ledger.in_flight()
        return None

    def waiting(self) -> dict[str, dict[str, int]]:
        """Waiters in this worker, by pool and tier (for /admin/backends)."""
        return {name: queue.depth() for name, queue in self._queues.items() if queue}

    async def run(self) -> None:
        """Forever: the heartbeat that keeps this process's slots its own (a process that
        stops beating is taken for crashed and what it held is given back) and sets the
        ledger's count of them to this process's own (proxy.upstream.holdings). It begins with the
        process's first request upstream: a gateway that never sends one writes nothing."""
        if self.ledger is None:
            return
        await self._started.wait()
        while True:
            try:
                if (changed := await self.ledger.beat(held=self.held.count(
                        self.spares.counts()))) > 0:
                    log.warning("the slot ledger's count of this process's slots was %d off "
                                "(a give-back or take lost on its way): corrected", changed)
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
            await stop_task(task)  # it cancels again where redis-py swallowed the first
        if self.ledger is not None:
            for name, count in self.spares.take_all().items():
                await self._give_back(name, count)
            await self.ledger.close()

    # --- taking a slot -------------------------------------------------------------------

    async def _arrive(self, pool: Pool, waiter: Waiter) -> list[Backend] | None:
        """A new request: its slot(s) when free and nobody waits ahead of it; otherwise
        None, with its turn in `waiter.tag` (and its place in the ledger's queue). 503 when
        more wait ahead of it than its longest wait allows, or when the pool has no available
        backend at all."""
        want: Want = waiter.want
        if self.ledger is None:  # dispatch off: this worker's cap, 503 beyond it
            return [pool.preferred(exclude=want.exclude, prompt=want.prompt)[0]]
        ranking = pool.ranked(want.exclude, prompt=want.prompt, capped=False)
        with pool.reserved(ranking.order[0], want.prompt):
            return await self._bind(pool, waiter, ranking)

    async def _bind(self, pool: Pool, waiter: Waiter, ranking: Ranking[Backend]
                    ) -> list[Backend] | None:
        """`_arrive`, once ranked."""
        assert self.ledger is not None
        want: Want = waiter.want
        ticket = waiter.ticket
        preferred = ranking.order
        if not self._started.is_set():  # this process's first: known alive before it takes
            self._started.set()
            with contextlib.suppress(RedisError):
                await self.ledger.beat()
        if (self._shared and want.need == 1 and not ticket.headroom
                and self.spares.use(preferred[0])):
            return self.held.granted(preferred[:1])  # kept from an earlier request
        most_ahead = self._drain(pool).most_ahead(ticket.max_wait_s, slots := pool.slots())
        if self._shared:
            waiter.member = self.ledger.member()
            if ranking.patience_s > 0 and want.need == 1 and not ticket.keep_free(slots):
                held = await self._holder(pool, waiter, ranking)
                if held is not None:
                    return held
            got = (await self._take(pool, waiter, preferred, most_ahead,
                                    spare=want.need == 1) if self._shared else None)
            if got is not None:
                if got.tag is None:
                    raise self._shed(pool, ticket, got.ahead, "expected")
                waiter.tag = got.tag
                return self.held.granted(pool.named(got.backends))
        # The ledger is unreachable: this worker's own counts, turns and queue.
        turns = self._local_turns(pool, ticket)
        waiter.tag = turns.tag(ticket.account)
        queue = self._queues.get(pool.key)
        ahead = queue.ahead(ticket.priority, waiter.tag) if queue else 0
        if ahead == 0 and (local := free_here(preferred, ticket.keep_free(pool.slots()),
                                          want.need)) is not None:
            turns.served(ticket.account, waiter.tag)
            return self.held.granted(local)
        if ahead > most_ahead:
            raise self._shed(pool, ticket, ahead, "expected")
        turns.queued(ticket.account, waiter.tag)
        return None

    async def _take(self, pool: Pool, waiter: Waiter, offered: list[Backend],
                    most_ahead: int, spare: bool = False) -> Taken | None:
        """One `take` of a slot on the first of `offered` with one free (and spares to keep
        there, when `spare` and the pool is free enough); None when the ledger cannot be
        reached (this worker counts on its own then)."""
        assert self.ledger is not None
        ticket, first = waiter.ticket, offered[0]
        wanted = self.spares.wanted(first) if spare and not self._waiting() else 0
        call = asyncio.ensure_future(self.held.ask(self.ledger.take(
            pool.key, ticket.priority, ticket.higher, ticket.account, offer(offered),
            member=waiter.member, wait_s=ticket.max_wait_s, most_ahead=most_ahead,
            keep_free=ticket.keep_free(pool.slots()), need=waiter.want.need, spare=wanted)))
        try:
            got = await asyncio.shield(call)
            if got.spare:
                self.spares.granted(first, got.spare)
            elif got.ahead or not got.backends:  # someone waits, or will: none kept
                self.spares.give_back_all()
            return got
        except RedisError:
            self._shared = False
            waiter.member = ""
            return None
        except asyncio.CancelledError:
            # The script runs anyway (it was sent): undo what it did once it lands.
            call.add_done_callback(lambda done: self._undo(done, pool, waiter))
            raise

    async def _holder(self, pool: Pool, waiter: Waiter, ranking: Ranking[Backend]
                      ) -> list[Backend] | None:
        """A slot on one of the ranking's first `hold` backends (they hold the most of the
        prompt), asked for again as slots free, for up to its `patience_s` while nobody
        queues; None when that passes, or when a request queues (the queue's order decides
        then). Meanwhile the request holds no place: it delays nobody."""
        holders = ranking.order[:ranking.hold]
        until = time.monotonic() + ranking.patience_s
        waited = False
        while True:
            got = await self._take(pool, waiter, holders, -1)
            if got is None or got.ahead > 0:
                break
            if got.backends:
                if waited:
                    self.metrics.held_out(pool.model, "holder")
                return self.held.granted(pool.named(got.backends))
            left = until - time.monotonic()
            if left <= 0:
                break
            waited = True
            await asyncio.wait([self._freed(b) for b in holders],
                               timeout=min(HOLDER_POLL_S, left),
                               return_when=asyncio.FIRST_COMPLETED)
        if waited:
            self.metrics.held_out(pool.model, "elsewhere")
        return None

    def _freed(self, backend: Backend) -> asyncio.Future[None]:
        """Done when this worker next gives back a slot of `backend`."""
        freed = self._slot_freed.get(backend.name)
        if freed is None:
            freed = self._slot_freed[backend.name] = asyncio.get_running_loop().create_future()
        return freed

    async def _turn(self, pool: Pool, waiter: Waiter) -> list[Backend] | None:
        """A waiter's slot(s), when free and no waiter of any gateway comes before it."""
        want: Want = waiter.want
        ticket = waiter.ticket
        preferred = pool.preferred(exclude=want.exclude, prompt=want.prompt, capped=False)
        if self.ledger is not None and self._shared:
            try:
                got = await self.held.ask(self.ledger.turn(
                    pool.key, ticket.priority, ticket.higher, ticket.account, offer(preferred),
                    waiter.member, waiter.tag, ticket.keep_free(pool.slots()), want.need))
                return self.held.granted(pool.named(got.backends))
            except RedisError:
                self._shared = False
        # This worker's own counts: the head of its queue is first here.
        local = free_here(preferred, ticket.keep_free(pool.slots()), want.need)
        if local is not None:
            self._local_turns(pool, ticket).served(ticket.account, waiter.tag)
        return self.held.granted(local)

    def _undo(self, done: asyncio.Future[Taken], pool: Pool, waiter: Waiter) -> None:
        """A take whose requester was cancelled: give back the slot, or stop waiting."""
        if done.cancelled() or done.exception() is not None:
            return
        got = done.result()
        taken = self.held.granted(pool.named(got.backends))
        if taken:
            if got.spare:  # spares nobody heard of: back at once
                self._spawn(self._give_back(taken[0].name, got.spare))
            for backend in taken:
                self.release(pool, backend, 0.0)
        elif got.tag is not None:
            waiter.tag = got.tag
            self._left(pool, waiter)

    def _left(self, pool: Pool, waiter: Waiter) -> None:
        """`waiter` gave up: out of the ledger's queue (or this worker's turns)."""
        ticket = waiter.ticket
        if waiter.member and self.ledger is not None:
            self._spawn(self._leave(pool.key, ticket, waiter.member, waiter.tag))
        elif (turns := self._turns.get((pool.key, ticket.priority))) is not None:
            turns.left(ticket.account, waiter.tag)

    async def _leave(self, pool: str, ticket: Ticket, member: str, tag: int) -> None:
        assert self.ledger is not None
        with contextlib.suppress(RedisError):  # it is forgotten when its longest wait ends
            await self.ledger.leave(pool, ticket.priority, ticket.account, member, tag)

    async def _give_back(self, backend: str, count: int = 1) -> None:
        assert self.ledger is not None
        with contextlib.suppress(RedisError):
            await self.ledger.give_back(backend, count)

    def _waiting(self) -> bool:
        """Requests of this worker wait: for a slot, or for their prompt's holder."""
        return bool(self._slot_freed) or any(self._queues.values())

    # --- waiting ---------------------------------------------------------------------------

    async def _wait(self, pool: Pool, waiter: Waiter) -> list[Backend]:
        """Wait in this worker's queue for its slot(s), up to the ticket's longest wait."""
        ticket = waiter.ticket
        queue = self._queues.setdefault(pool.key, TierQueue())
        queue.push(waiter)
        self.metrics.queued(pool.model, ticket.tier, 1)
        self._pump(pool)
        try:
            async with asyncio.timeout(ticket.max_wait_s):
                taken: list[Backend] = await asyncio.shield(waiter.granted)
        except BaseException as exc:
            waiter.leave()
            if waiter.granted.done() and not waiter.granted.cancelled():
                # Granted as it gave up: the slots go back (and to the next waiter).
                for backend in waiter.granted.result():
                    self.release(pool, backend, 0.0)
            else:
                waiter.granted.cancel()
                self._left(pool, waiter)
            if isinstance(exc, TimeoutError):
                raise self._shed(pool, ticket, queue.ahead(ticket.priority, waiter.tag),
                                 "waited") from None
            raise
        finally:
            self.metrics.queued(pool.model, ticket.tier, -1)
        self.metrics.waited(pool.model, ticket.tier, time.monotonic() - waiter.want.queued_at)
        return taken

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
            try:
                taken = await self._turn(pool, head)
            except GatewayError as exc:  # no backend available at all: tell them all
                while (gone := queue.pop()) is not None:
                    if not gone.granted.done():
                        gone.granted.set_exception(exc)
                return
            if taken is not None:
                if queue.peek() is head and not head.granted.done():
                    queue.pop()
                    head.granted.set_result(taken)
                else:  # it left while we asked: the slots go back
                    for backend in taken:
                        self.release(pool, backend, self._drain(pool).held_s)
                continue
            wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), POLL_S)

    def _shed(self, pool: Pool, ticket: Ticket, ahead: int, reason: str) -> GatewayError:
        self.metrics.shed(pool.model, ticket.tier, reason)
        return saturated(pool.model, ticket, self._drain(pool).wait_s(ahead, pool.slots()),
                         waited=reason == "waited")

    def _local_turns(self, pool: Pool, ticket: Ticket) -> Turns:
        return self._turns.setdefault((pool.key, ticket.priority), Turns())

    def _drain(self, pool: Pool) -> Drain:
        if (drain := self._drains.get(pool.key)) is None:
            drain = self._drains[pool.key] = Drain()
        return drain

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

