"""Drain: how a worker stops without dropping what it is serving.

On SIGTERM (driven by `runtime.worker`) `/readyz` fails at once and every new request gets 503
with Retry-After (the middleware asks `Drain.draining`); requests already running finish, up to
the deadline; then `abort` closes the upstream streams still open (`Upstreams.abort_open`), which
makes each relay end its client's stream with one error event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("proxy.drain")

_ABORT_GRACE_S = 2.0  # after closing the upstreams, how long relays get to send their last event


class Drain:
    """Drain state and in-flight count of this worker."""

    def __init__(self, abort: Callable[[], int]) -> None:
        self.abort = abort  # closes what is still open upstream; says how many
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, deadline_s: float) -> None:
        """Refuse new requests; wait for running ones up to `deadline_s`, then cut upstreams."""
        self.draining = True
        log.info("draining: %d request(s) in flight, up to %.0f s", self.in_flight, deadline_s)
        try:
            await asyncio.wait_for(self._idle.wait(), deadline_s)
            return
        except TimeoutError:
            pass
        cut = self.abort()
        log.warning("drain deadline passed: closing %d upstream stream(s)", cut)
        try:
            await asyncio.wait_for(self._idle.wait(), _ABORT_GRACE_S)
        except TimeoutError:
            log.warning("%d request(s) still running; they will be cancelled", self.in_flight)
