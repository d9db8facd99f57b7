"""A slot taken before the request needs it (proxy.upstream.dispatch): one call to the slot
ledger sent while admission runs, so a request that finds a free slot waits for no more Redis
round trips than admission's own."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.upstream.pool import Backend, Pool
    from proxy.upstream.prefixes import Prompt


class Early:
    """A slot taken before the request's first upstream call, which uses it: taken while
    admission runs (its round trip in parallel with admission's), or with a network-mode
    request's other replicas (`held`). A request that never makes that call gives it back
    (`Dispatcher.forget`)."""

    __slots__ = ("pool", "prompt", "task", "used")

    def __init__(self, pool: Pool, prompt: Prompt | None,
                 task: asyncio.Future[Backend]) -> None:
        self.pool = pool
        self.prompt = prompt  # the request's prompt blocks, hashed once
        self.task = task
        self.used = False

    @classmethod
    def held(cls, pool: Pool, backend: Backend) -> Early:
        """A slot of `pool` already held on `backend`."""
        taken: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
        taken.set_result(backend)
        return cls(pool, None, taken)

    async def take(self) -> Backend:
        # Used once it is ours: a request cancelled while the take lands (the task done, its
        # waiter not yet woken) leaves it unused, for `forget` to give back.
        backend = await self.task
        self.used = True
        return backend
