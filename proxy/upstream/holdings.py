"""The slots this process holds, by its own count: what its heartbeat tells the slot ledger, so
the ledger's count of them follows the truth (proxy.upstream.slots, `beat`). No I/O.

    held      a request's slot from the moment it is granted (by the ledger, from a spare, or
              by this worker's own count while the ledger is unreachable) until it is released;
              plus the spares kept (proxy.upstream.spares)
    why       a give-back that fails (the ledger's Redis unreachable for a moment) would leave
              its slot counted as in flight for as long as the process lives, and retrying it
              could give it back twice (the failed call may have run); a take whose reply was
              lost leaves a slot nobody uses; a ledger Redis that restarts forgets the requests
              running. The beat sets the ledger's count to this one instead
    exact     only while no take of this process is on its way: a take's grant is in the
              ledger's count before its reply reaches this one. A beat sent while takes are on
              their way only beats; one counted with none on its way carries how many were
              sent, and the ledger (which counts the takes it ran) skips the count when a
              take sent after it ran first (calls made while the connection is opened, or
              sent again after Redis lost its scripts, may overtake one another). A
              give-back sent before the beat is in both counts either way
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Mapping
from typing import TypeVar

from proxy.upstream.pool import Backend

B = TypeVar("B", bound=Backend)
T = TypeVar("T")


class Holdings:
    __slots__ = ("_running", "asked", "asking")

    def __init__(self) -> None:
        self._running: Counter[str] = Counter()
        self.asking = 0  # takes and turns sent whose reply has not come
        self.asked = 0  # takes and turns sent, ever

    async def ask(self, call: Awaitable[T]) -> T:
        """A take or turn: on its way until it is answered (or fails)."""
        self.asking += 1
        self.asked += 1
        try:
            return await call
        finally:
            self.asking -= 1

    def granted(self, backends: list[B] | None) -> list[B] | None:
        """A request got these slots (passed through, None included)."""
        for backend in backends or ():
            self._running[backend.name] += 1
        return backends

    def released(self, name: str) -> None:
        if self._running[name] > 1:
            self._running[name] -= 1
        else:
            del self._running[name]

    def count(self, spares: Mapping[str, int]) -> tuple[int, dict[str, int]] | None:
        """The takes and turns sent so far, and what this process holds per backend with
        `spares`; None while a take is on its way (its grant would be missing)."""
        if self.asking:
            return None
        held = self._running + Counter(spares)  # positive counts only, as both hold
        return self.asked, dict(held)
