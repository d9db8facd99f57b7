"""Network mode's execution: one request run on several backends at once, then the verdict.

Every replica runs concurrently and to its end (a failure is a disagreement, not an abort), so
the verdict sees them all (`proxy.upstream.quorum.decide`). When the caller is cancelled (the
client went away, a deadline passed) every replica still running is cancelled too, which closes
its upstream request, and the cancellation goes on up once they have all stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from proxy.upstream.quorum import Verdict, decide

B = TypeVar("B")
T = TypeVar("T")


async def run_redundant(backends: Sequence[B], run_one: Callable[[B], Awaitable[T]], *,
                        key: Callable[[T], str], quorum: int,
                        name: Callable[[B], str]) -> Verdict[T]:
    """`run_one` on every backend concurrently; their answers (or exceptions) go to `decide`
    in `backends`' order. Raises CancelledError, after cancelling the replicas, when the caller
    is cancelled."""
    if not backends:
        raise ValueError("run_redundant needs at least one backend")
    tasks = [asyncio.ensure_future(run_one(backend)) for backend in backends]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        # Let each replica finish its cleanup (its exchange closes the upstream request and
        # gives back its place under the backend's cap) before the cancellation goes on.
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return decide([(name(b), r) for b, r in zip(backends, results, strict=True)], key, quorum)
