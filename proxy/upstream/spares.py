"""Spare slots: slots of a backend that a worker keeps in the slot ledger between its requests,
so that while a pool is far from full its requests take and give back slots without a Redis
round trip each (proxy.upstream.dispatch).

The ledger grants spares with a slot it gives (`SlotLedger.take`, `spare`): on the request's
preferred backend, only while at least half of the pool's slots stay free after them, at most
one in `SHARE` of the backend's slots per worker (none below `SHARE` slots) and `MOST` in all.
A worker then serves its requests from them and keeps each slot its requests give back, until
`LEASE_S` after the grant: then the idle ones go back, and so does every slot given back later,
until a request of the worker takes a slot from the ledger again (and is granted new spares if
the pool is still that free). So the ledger hears from a worker about once per backend per
`LEASE_S` while it is busy, and its view of the fleet is never older than that: a request
queued in another worker waits at most `LEASE_S` longer for slots kept spare elsewhere.
A worker keeps none while any request waits in it (for a slot, or for its prompt's holder),
and gives them all back as soon as the ledger shows anyone waiting. Spares count as in flight
in the ledger (the engines never see more than their slots), and a worker that crashes loses
them with the rest of what it held (its heartbeat lapses).

The dispatcher makes the ledger calls; this keeps the count, and says when a lease ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.upstream.pool import Backend

LEASE_S = 0.25
SHARE = 16
MOST = 4


def most_kept(slots: int) -> int:
    """Spares a worker may keep of a backend with `slots` slots."""
    return min(MOST, slots // SHARE)


class Spares:
    """This worker's spare slots, per backend name, and until when it may keep them.
    `give_back(name, count)` hands slots back to the ledger (in the background)."""

    __slots__ = ("_give_back", "_kept", "_timers", "_until")

    def __init__(self, give_back: Callable[[str, int], None]) -> None:
        self._give_back = give_back
        self._kept: dict[str, int] = {}
        self._until: dict[str, float] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def kept(self, name: str) -> int:
        """Spares of backend `name` kept now."""
        return self._kept.get(name, 0)

    def counts(self) -> dict[str, int]:
        """Spares kept now, per backend name."""
        return {name: count for name, count in self._kept.items() if count > 0}

    def wanted(self, backend: Backend) -> int:
        """How many more spares of `backend` the worker may keep."""
        return max(0, most_kept(backend.slots) - self.kept(backend.name))

    def granted(self, backend: Backend, count: int) -> None:
        """The ledger gave `count` spares of `backend`: they, and those already kept, are
        kept for `LEASE_S`; then the idle ones go back."""
        name = backend.name
        self._kept[name] = self._kept.get(name, 0) + count
        self._until[name] = _now() + LEASE_S
        self._schedule(name)

    def use(self, backend: Backend) -> bool:
        """Take one of `backend`'s spares for a request, if one is kept and its lease holds."""
        name = backend.name
        if self._kept.get(name, 0) <= 0 or self._until.get(name, 0.0) <= _now():
            return False
        self._kept[name] -= 1
        return True

    def keep(self, backend: Backend) -> bool:
        """A request gave back its slot of `backend`: keep it spare (True) while the lease
        holds and fewer than the most are kept; otherwise it goes back to the ledger."""
        name = backend.name
        kept = self._kept.get(name, 0)
        if (self._until.get(name, 0.0) <= _now()
                or kept >= most_kept(backend.slots)):
            return False
        self._kept[name] = kept + 1
        return True

    def give_back_all(self) -> None:
        """The leases end now: every spare goes back."""
        for name, count in self.take_all().items():
            self._give_back(name, count)

    def take_all(self) -> dict[str, int]:
        """Every spare kept, no longer kept: the caller gives them back."""
        kept, self._kept = self._kept, {}
        self._until.clear()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        return {name: count for name, count in kept.items() if count > 0}

    def __bool__(self) -> bool:
        return any(self._kept.values())

    def _schedule(self, name: str) -> None:
        if (timer := self._timers.pop(name, None)) is not None:
            timer.cancel()
        self._timers[name] = asyncio.get_running_loop().call_at(self._until[name],
                                                                self._expire, name)

    def _expire(self, name: str) -> None:
        self._timers.pop(name, None)
        if name not in self._until:
            return
        if self._until[name] > _now():  # the loop's timers may run a little early
            self._schedule(name)
            return
        del self._until[name]
        if (count := self._kept.pop(name, 0)) > 0:
            self._give_back(name, count)


def _now() -> float:
    return asyncio.get_running_loop().time()
