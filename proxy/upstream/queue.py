"""Who runs next when a pool's slots are full: the gateway's own queue, one per pool. No I/O.

    order     strict by tier priority (a higher `priority` in tiers.toml always goes first);
              within a tier, by turns (`Turns`, start-time fair queuing over accounts): each
              request is tagged with its account's next turn, and the smallest tag runs next,
              so one key's burst takes turns with the other accounts of its tier rather than
              running ahead of them, and an account that sends rarely runs at its next turn
    leaving   a waiter that gives up (its client left, or its longest wait passed) leaves
              its place at once (`Waiter.leave`)
    waits     how long a place in the queue should take, from how fast the pool's slots free
              (`Drain`): what 503's Retry-After says, and what sheds a request at once when
              its tier's longest wait would be passed anyway

Strict rather than weighted: a paying tier buys latency, and under weights a Basic burst still
adds to a Max request's wait; what keeps the lower tiers from waiting forever is each tier's
longest wait (`max_queue_wait_s`), past which they are answered 503 with Retry-After.

The turns are the fleet's: the slot ledger (proxy.upstream.slots) keeps the same tags in Redis
for every worker of every gateway; `Turns` here is that arithmetic, and what a worker uses on
its own while the ledger's Redis cannot be reached.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from proxy.config import TierPolicy
from proxy.errors import ErrorKind, GatewayError

if TYPE_CHECKING:
    from proxy.upstream.pool import Backend
    from proxy.upstream.prefixes import Prompt


@dataclass(frozen=True, slots=True)
class Ticket:
    """What the queue knows of a request: its tier's place and its account."""

    tier: str
    priority: int  # higher first
    account: str
    max_wait_s: float
    higher: tuple[int, ...] = ()  # the other tiers' priorities above this one
    headroom: float = 0.0  # the share of a pool's slots it leaves free for those tiers

    def keep_free(self, slots: int) -> int:
        """Of a pool's `slots`, those this request leaves free for the tiers above (never
        all of them)."""
        return min(math.floor(self.headroom * slots), slots - 1) if self.headroom else 0


def ticket_for(tier_name: str, tiers: Mapping[str, TierPolicy], account: str
               ) -> Ticket | None:
    """The queue's view of a request of `tier_name` (None for a tier no longer configured)."""
    tier = tiers.get(tier_name)
    if tier is None:
        return None
    higher = tuple(sorted({t.priority for t in tiers.values() if t.priority > tier.priority}))
    return Ticket(tier_name, tier.priority, account, tier.max_queue_wait_s, higher,
                  tier.headroom if higher else 0.0)


class Turns:
    """Start-time fair queuing over one tier's accounts (one pool): a request's tag is its
    account's next turn, `max(now, account's last tag + 1)`, where "now" is the tag of the
    request that last got a slot. The smallest tag runs next. An account with a backlog has
    tags far ahead; one that sends rarely gets "now" and runs at the next free slot of its
    tier. The slot ledger's Lua does the same for the whole fleet."""

    __slots__ = ("_next", "now")

    def __init__(self) -> None:
        self.now = 0
        self._next: dict[str, int] = {}  # account -> its next turn, while ahead of `now`

    def tag(self, account: str) -> int:
        return max(self.now, self._next.get(account, 0))

    def queued(self, account: str, tag: int) -> None:
        self._next[account] = tag + 1

    def left(self, account: str, tag: int) -> None:
        """A waiter of `tag` gave up: its turn is the account's again if it was the last."""
        if self._next.get(account) == tag + 1:
            self._next[account] = tag

    def served(self, account: str, tag: int) -> None:
        self.now = max(self.now, tag)
        self._next[account] = max(self._next.get(account, 0), tag + 1)
        if len(self._next) > 64:  # accounts whose next turn is now or past are like new ones
            self._next = {a: t for a, t in self._next.items() if t > self.now}


_seq = itertools.count()


@dataclass(frozen=True, slots=True)
class Want:
    """What a waiter asks for besides its ticket: its prompt's blocks, a backend to avoid, and
    how many distinct backends it needs a slot on at once (network mode's replicas)."""

    prompt: Prompt | None
    exclude: Backend | None
    queued_at: float
    need: int = 1


@dataclass(eq=False, slots=True)
class Waiter:
    ticket: Ticket
    tag: int = 0  # its turn within its tier (smaller first)
    want: Any = None  # what its dispatcher needs to serve it (a Want)
    member: str = ""  # its name in the slot ledger's queue ('' when only this worker knows it)
    granted: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    queue: TierQueue | None = None
    seq: int = field(default_factory=lambda: next(_seq))  # ties: arrival order

    def leave(self) -> None:
        """Out of the queue (a no-op once it was granted or had left)."""
        if self.queue is not None:
            self.queue.remove(self)


class TierQueue:
    """A pool's waiters: highest priority first, then smallest tag, then arrival."""

    def __init__(self) -> None:
        # A heap per priority; a waiter that left (its `queue` is None) stays in its heap
        # until it reaches the top.
        self._tiers: dict[int, list[tuple[int, int, Waiter]]] = {}
        self._order: list[int] = []  # priorities with waiters, highest first
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, waiter: Waiter) -> None:
        priority = waiter.ticket.priority
        heap = self._tiers.get(priority)
        if heap is None:
            heap = self._tiers[priority] = []
            self._order = sorted(self._tiers, reverse=True)
        heapq.heappush(heap, (waiter.tag, waiter.seq, waiter))
        waiter.queue = self
        self._count += 1

    def peek(self) -> Waiter | None:
        """Who is next, without taking it out."""
        while self._order:
            priority = self._order[0]
            heap = self._tiers[priority]
            while heap and heap[0][2].queue is not self:
                heapq.heappop(heap)  # it left
            if heap:
                return heap[0][2]
            del self._tiers[priority]
            self._order.pop(0)
        return None

    def pop(self) -> Waiter | None:
        """Who runs next (taken out), or None when nobody waits."""
        waiter = self.peek()
        if waiter is not None:
            heapq.heappop(self._tiers[waiter.ticket.priority])
            waiter.queue = None
            self._count -= 1
        return waiter

    def remove(self, waiter: Waiter) -> None:
        if waiter.queue is self:
            waiter.queue = None  # dropped from its heap when it reaches the top
            self._count -= 1

    def _waiting(self) -> list[Waiter]:
        return [w for heap in self._tiers.values() for _, _, w in heap if w.queue is self]

    def ahead(self, priority: int, tag: int | None = None) -> int:
        """Waiters a request of `priority` (and `tag`) would wait behind: every higher tier's,
        and those of its own with a smaller tag (all of its own without a tag)."""
        return sum(1 for w in self._waiting() if w.ticket.priority > priority or (
            w.ticket.priority == priority and (tag is None or w.tag < tag)))

    def depth(self) -> dict[str, int]:
        """Waiters by tier name (for /metrics and /admin/backends)."""
        counts: dict[str, int] = {}
        for waiter in self._waiting():
            counts[waiter.ticket.tier] = counts.get(waiter.ticket.tier, 0) + 1
        return counts


class Drain:
    """How fast a pool's slots free: the mean time a slot is held (smoothed), over the slots
    the pool has. A new pool's first estimate is `initial_s` per request."""

    __slots__ = ("held_s",)

    def __init__(self, initial_s: float = 1.0) -> None:
        self.held_s = initial_s

    def observe(self, held_s: float) -> None:
        self.held_s = 0.8 * self.held_s + 0.2 * max(held_s, 0.001)

    def wait_s(self, ahead: int, slots: int) -> float:
        """Expected wait for a place behind `ahead` waiters, with `slots` slots draining."""
        return (ahead + 1) * self.held_s / max(slots, 1)

    def most_ahead(self, max_wait_s: float, slots: int) -> int:
        """The most waiters a request may find ahead of it and still expect to run within
        `max_wait_s` (-1: none, not even an empty queue)."""
        return math.floor(max_wait_s * max(slots, 1) / self.held_s) - 1


def saturated(model: str, ticket: Ticket, wait_s: float, *, waited: bool) -> GatewayError:
    """503 for a request of `model` the queue will not hold, with the expected wait from now
    as Retry-After."""
    retry = max(1, min(300, math.ceil(wait_s)))
    why = (f"waited its longest {ticket.max_wait_s:g} s for a slot" if waited else
           f"would wait about {wait_s:.1f} s for a slot, longer than its "
           f"{ticket.max_wait_s:g} s")
    return GatewayError(
        ErrorKind.POOL_SATURATED,
        f"model {model!r} is busy: tier {ticket.tier!r} {why}; retry in {retry} s",
        headers={"Retry-After": str(retry)})
