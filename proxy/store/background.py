"""Stopping background tasks reliably."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("proxy")


async def stop_task(task: asyncio.Task[None]) -> None:
    """Cancel `task` and wait until it is over. Cancel again if it swallowed the first one:
    redis-py can, when the cancellation lands inside a command."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.2)
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())
