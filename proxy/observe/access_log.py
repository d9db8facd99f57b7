"""The access log: one JSON line per request, written off the hot path.

A request's line is built from its `Trace` and handed to a queue; a thread of its own encodes
and writes whatever has queued up in one write (stderr or a file), so a slow disk or a full pipe
never stalls the event loop, and a busy gateway pays one system call per batch, not per line. A
line holds the request id, method, route template, model, tier, account, status, error type,
latency, time to first byte, backend, stream outcome, units and credits; never a key, a token, a
header or anything from a body. `[gateway] access_log` picks where it goes ("stderr", "off" or a
file path; a file is reopened when logrotate moves it).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from aiohttp import web

from proxy.credits.pricing import format_credits
from proxy.observe.trace import Trace

QUEUE_MAX = 100_000  # lines waiting for the writer; past it lines are dropped, not awaited
_BATCH_MAX = 4096  # lines encoded and written at once
_GATHER_S = 0.05  # how long the writer lets lines gather before it writes them
_STOP = None

log = logging.getLogger("proxy.observe")


class AccessLog:
    """`write` on the request path; `start` runs the writer thread until `stop`."""

    def __init__(self, destination: str, root: str) -> None:
        self.enabled = destination != "off"
        self.dropped = 0  # lines lost to a full queue (a writer that cannot keep up)
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._path = None if destination in ("stderr", "off") else Path(root) / destination
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.enabled:
            return
        out = _Output(self._path)  # opened here: a bad path fails the start, not the thread
        self._thread = threading.Thread(target=self._run, args=(out,), name="access-log",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Write what is queued, then end the thread."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(timeout=5)
            self._thread = None

    def write(self, request: web.Request, trace: Trace, status: int, request_id: str) -> None:
        if self._thread is None:
            return
        if self._queue.qsize() >= QUEUE_MAX:
            self.dropped += 1
            return
        line: dict[str, Any] = {
            "ts": round(time.time(), 3), "request_id": request_id, "method": request.method,
            "route": trace.route, "status": status,
            "latency_ms": round((time.monotonic() - trace.started) * 1000, 1),
        }
        for name in ("model", "tier", "account", "error", "backend", "outcome"):
            value = getattr(trace, name)
            if value is not None:
                line[name] = value
        if trace.first_byte_s is not None:
            line["first_byte_ms"] = round(trace.first_byte_s * 1000, 1)
        if trace.units:
            line["units"] = trace.units
        if trace.cost:
            line["credits"] = format_credits(trace.cost)  # as the account API writes them
        self._queue.put(line)

    def _run(self, out: _Output) -> None:
        get, get_nowait = self._queue.get, self._queue.get_nowait
        running = True
        while running:
            batch = [get()]
            # Let lines gather: a writer woken for every line would take the GIL from the
            # event loop thousands of times a second.
            time.sleep(_GATHER_S)
            while len(batch) < _BATCH_MAX:
                try:
                    batch.append(get_nowait())
                except queue.Empty:
                    break
            if _STOP in batch:
                running = False
            data = b"".join(orjson.dumps(line) + b"\n" for line in batch if line is not None)
            try:
                out.write(data)
            except (OSError, ValueError) as exc:  # a full disk, a closed pipe: lose lines only
                log.warning("access log write failed (%s)", exc)
        out.close()


class _Output:
    """stderr, or an append-only file reopened when it is moved or removed (logrotate)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.file: BinaryIO = sys.stderr.buffer if path is None else self._open()

    def _open(self) -> BinaryIO:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return self.path.open("ab")

    def write(self, data: bytes) -> None:
        if self.path is not None and self._moved():
            self.file.close()
            self.file = self._open()
        self.file.write(data)
        self.file.flush()

    def _moved(self) -> bool:
        assert self.path is not None
        try:
            return os.stat(self.path).st_ino != os.fstat(self.file.fileno()).st_ino
        except FileNotFoundError:
            return True

    def close(self) -> None:
        if self.path is not None:
            self.file.close()
