"""Who runs next when a pool's slots are full: the gateway's own queue, one per pool. No I/O.

    order     strict by tier priority (a higher `priority` in tiers.toml always goes first);
              within a tier, round robin over accounts (each account's requests in arrival
              order), so one key's burst takes turns with the other accounts of its tier
              rather than running ahead of them
    leaving   a waiter that gives up (its client left, or its longest wait passed) leaves
              its place at once (`Waiter.leave`)
    waits     how long a place in the queue should take, from how fast the pool's slots free
              (`Drain`): what 503's Retry-After says, and what sheds a request at once when
              its tier's longest wait would be passed anyway

Strict rather than weighted: a paying tier buys latency, and under weights a Basic burst still
adds to a Max request's wait; what keeps the lower tiers from waiting forever is each tier's
longest wait (`max_queue_wait_s`), past which they are answered 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.config import TierPolicy


@dataclass(frozen=True, slots=True)
class Ticket:
    """What the queue knows of a request: its tier's place and its account."""

    tier: str
    priority: int  # higher first
    account: str
    max_wait_s: float
    higher: tuple[int, ...] = ()  # the other tiers' priorities above this one


def ticket_for(tier_name: str, tiers: Mapping[str, TierPolicy], account: str
               ) -> Ticket | None:
    """The queue's view of a request of `tier_name` (None for a tier no longer configured)."""
    tier = tiers.get(tier_name)
    if tier is None:
        return None
    higher = tuple(sorted({t.priority for t in tiers.values() if t.priority > tier.priority}))
    return Ticket(tier_name, tier.priority, account, tier.max_queue_wait_s, higher)


@dataclass(eq=False, slots=True)
class Waiter:
    ticket: Ticket
    want: Any = None  # what its dispatcher needs to serve it
    granted: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    queue: TierQueue | None = None

    def leave(self) -> None:
        """Out of the queue (a no-op once it was granted or had left)."""
        if self.queue is not None:
            self.queue.remove(self)


class _Tier:
    """One tier's waiters: per account, in arrival order; accounts take turns."""

    __slots__ = ("accounts", "count")

    def __init__(self) -> None:
        self.accounts: OrderedDict[str, deque[Waiter]] = OrderedDict()
        self.count = 0

    def push(self, waiter: Waiter) -> None:
        self.accounts.setdefault(waiter.ticket.account, deque()).append(waiter)
        self.count += 1

    def pop(self) -> Waiter:
        account, waiters = next(iter(self.accounts.items()))
        waiter = waiters.popleft()
        if waiters:
            self.accounts.move_to_end(account)  # its next request waits for the others' turns
        else:
            del self.accounts[account]
        self.count -= 1
        return waiter

    def peek(self) -> Waiter:
        return next(iter(self.accounts.values()))[0]

    def remove(self, waiter: Waiter) -> bool:
        waiters = self.accounts.get(waiter.ticket.account)
        if waiters is None or waiter not in waiters:
            return False
        waiters.remove(waiter)
        if not waiters:
            del self.accounts[waiter.ticket.account]
        self.count -= 1
        return True


class TierQueue:
    """A pool's waiters, highest priority first."""

    def __init__(self) -> None:
        self._tiers: dict[int, _Tier] = {}
        self._order: list[int] = []  # priorities with waiters, highest first

    def __len__(self) -> int:
        return sum(t.count for t in self._tiers.values())

    def push(self, waiter: Waiter) -> None:
        priority = waiter.ticket.priority
        tier = self._tiers.get(priority)
        if tier is None:
            tier = self._tiers[priority] = _Tier()
            self._order = sorted(self._tiers, reverse=True)
        tier.push(waiter)
        waiter.queue = self

    def peek(self) -> Waiter | None:
        """Who is next, without taking it out."""
        return self._tiers[self._order[0]].peek() if self._order else None

    def pop(self) -> Waiter | None:
        """Who runs next (taken out), or None when nobody waits."""
        if not self._order:
            return None
        priority = self._order[0]
        waiter = self._tiers[priority].pop()
        self._forget_if_empty(priority)
        waiter.queue = None
        return waiter

    def remove(self, waiter: Waiter) -> None:
        priority = waiter.ticket.priority
        tier = self._tiers.get(priority)
        if tier is not None and tier.remove(waiter):
            self._forget_if_empty(priority)
        waiter.queue = None

    def ahead(self, priority: int) -> int:
        """Waiters a new request of `priority` would wait behind (its own tier's included)."""
        return sum(t.count for p, t in self._tiers.items() if p >= priority)

    def place(self, ticket: Ticket) -> int:
        """How many waiters a new request of `ticket` would be served after: every higher
        tier's, and in its own tier, by the accounts' turns, its account's own and up to one
        more than that from each other account (a light account's request does not wait
        behind a heavy account's whole burst)."""
        higher = sum(t.count for p, t in self._tiers.items() if p > ticket.priority)
        tier = self._tiers.get(ticket.priority)
        if tier is None:
            return higher
        own = len(tier.accounts.get(ticket.account, ()))
        others = sum(min(len(waiters), own + 1) for account, waiters in tier.accounts.items()
                     if account != ticket.account)
        return higher + own + others

    def depth(self) -> dict[str, int]:
        """Waiters by tier name (for /metrics and /admin/backends)."""
        counts: dict[str, int] = {}
        for tier in self._tiers.values():
            for waiters in tier.accounts.values():
                for waiter in waiters:
                    counts[waiter.ticket.tier] = counts.get(waiter.ticket.tier, 0) + 1
        return counts

    def _forget_if_empty(self, priority: int) -> None:
        if self._tiers[priority].count == 0:
            del self._tiers[priority]
            self._order = sorted(self._tiers, reverse=True)


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
