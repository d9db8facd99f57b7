"""The access log: one JSON line per request, written off the hot path.

A request's line is built from its `Trace` and handed to a queue; a listener thread does the
writing (stderr or a file), so a slow disk or a full pipe never stalls the event loop. A line
holds the request id, method, route template, model, tier, account, status, error type, latency,
time to first byte, backend, stream outcome, units and credits; never a key, a token, a header
or anything from a body. `[gateway] access_log` picks where it goes ("stderr", "off" or a file
path; a file is reopened when logrotate moves it).
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from proxy.observe.trace import Trace

_QUEUE_MAX = 100_000  # lines waiting for the writer; past it lines are dropped, not awaited


class _JsonLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return orjson.dumps(record.msg).decode()


class AccessLog:
    """The queue side, used on the request path; `start` runs the writer thread until `stop`.
    Lines go straight to the queue, not through a named logger: several apps in one process
    (tests) each write only their own."""

    def __init__(self, destination: str, root: str) -> None:
        self.enabled = destination != "off"
        self.dropped = 0  # lines lost to a full queue (a writer that cannot keep up)
        self._queue: queue.Queue[logging.LogRecord] = queue.Queue(_QUEUE_MAX)
        self._listener: logging.handlers.QueueListener | None = None
        self._destination = destination
        self._root = root

    def start(self) -> None:
        if not self.enabled:
            return
        out: logging.Handler
        if self._destination == "stderr":
            out = logging.StreamHandler(sys.stderr)
        else:
            path = Path(self._root) / self._destination
            path.parent.mkdir(parents=True, exist_ok=True)
            out = logging.handlers.WatchedFileHandler(path)  # reopened after logrotate
        out.setFormatter(_JsonLine())
        self._listener = logging.handlers.QueueListener(self._queue, out)
        self._listener.start()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.stop()  # writes what is queued, then ends the thread
            for handler in self._listener.handlers:
                handler.close()
            self._listener = None

    def write(self, request: web.Request, trace: Trace, status: int, request_id: str) -> None:
        if self._listener is None:
            return
        line: dict[str, Any] = {
            "ts": round(time.time(), 3), "request_id": request_id, "method": request.method,
            "route": trace.route, "status": status,
            "latency_ms": round((time.monotonic() - trace.started) * 1000, 1),
        }
        optional: dict[str, Any] = {
            "model": trace.model, "tier": trace.tier, "account": trace.account,
            "error": trace.error, "backend": trace.backend, "outcome": trace.outcome,
            "first_byte_ms": None if trace.first_byte_s is None
            else round(trace.first_byte_s * 1000, 1),
        }
        line.update((k, v) for k, v in optional.items() if v is not None)
        if trace.units:
            line["units"] = trace.units
        if trace.cost:
            line["credits"] = trace.cost / 1e6
        try:
            self._queue.put_nowait(logging.makeLogRecord({"msg": line}))
        except queue.Full:
            self.dropped += 1


def access_log_ctx(destination: str, root: str) -> Any:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        from proxy.appkeys import ACCESS_LOG

        log = AccessLog(destination, root)
        log.start()
        app[ACCESS_LOG] = log
        try:
            yield
        finally:
            log.stop()

    return ctx
