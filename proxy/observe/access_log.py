"""The access log: one JSON line per request, written off the hot path.

A request's line is built from its `Trace`, encoded (orjson, ~1 µs) and handed to a queue; a
thread of its own writes whatever has queued up (stderr or a file) through the file's buffer, so a
slow disk or a full pipe never stalls the event loop, and a busy gateway pays a system call per
4 KB of lines (stderr; 8 KB to a file), not per line. Lines wait as bytes (~350 B each), not as
dicts (~850 B), and the thread joins no copy of a batch: memory it allocates lands in a malloc
arena of its own, which the process keeps (a batch joined there, and orjson's 4 KB buffers, once
cost the worker ~8 MB of RSS under load). `QUEUE_MAX` bounds what a writer that falls behind
can hold. A line holds the request id, method, route template, model, task family, mode, tier,
account, status, error type, latency, time to first byte, backend, stream outcome, units
(cached prompt tokens among them), credits and the id of its trace when one was exported
([telemetry]): what `policy replay` reads back (proxy.policy.replay); never a key,
a token, a header or anything from a body. `[gateway] access_log` picks where it goes
("stderr", "off" or a file path; a file is reopened when logrotate moves it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import orjson
from aiohttp import web

from proxy.observe.trace import Trace

if TYPE_CHECKING:
    from proxy.observe.metrics import Metrics

QUEUE_MAX = 20_000  # lines waiting for the writer (~7 MB); past it lines are dropped, not awaited
BATCH_MAX = 4096  # lines written at once
_GATHER_S = 0.05  # how long the writer lets lines gather before it writes them
_STOP = None

log = logging.getLogger("proxy.observe")


class AccessLog:
    """`write` on the request path; `start` runs the writer thread until `stop`."""

    def __init__(self, destination: str, root: str, metrics: Metrics | None = None) -> None:
        self.enabled = destination != "off"
        self.dropped = 0  # lines lost to a full queue (a writer that cannot keep up)
        self._metrics = metrics
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
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
        line = self.line(request, trace, status, request_id)
        if line is not None:
            self.put(line)

    def put(self, line: dict[str, Any]) -> None:
        """Queue a line made by `line` (perhaps with more added: a shadow policy's verdict)."""
        if self._thread is None:
            return
        if self._queue.qsize() >= QUEUE_MAX:
            self.dropped += 1
            if self._metrics is not None:
                self._metrics.access_log_dropped.inc()
            return
        # A copy: orjson hands back its whole 4 KB working buffer (see wire.upstream_body).
        self._queue.put(bytes(memoryview(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))))

    def line(self, request: web.Request, trace: Trace, status: int, request_id: str
             ) -> dict[str, Any] | None:
        """The request's line, as of now (None: the log is off)."""
        if self._thread is None:
            return None
        line: dict[str, Any] = {
            "ts": round(time.time(), 3), "request_id": request_id, "method": request.method,
            "route": trace.route, "status": status,
            "latency_ms": round((time.monotonic() - trace.started) * 1000, 1),
        }
        for name in ("model", "family", "mode", "tier", "account", "error", "backend",
                     "outcome"):
            value = getattr(trace, name)
            if value is not None:
                line[name] = value
        if trace.first_byte_s is not None:
            line["first_byte_ms"] = round(trace.first_byte_s * 1000, 1)
        if trace.asked_tokens is not None:  # for a replay's completion cap (policy replay)
            line["max_tokens"] = trace.asked_tokens
        if trace.waiting is not None:  # what the queue-budget check read, for a replay too
            line["waiting"] = round(trace.waiting, 2)
        if trace.units:
            line["units"] = trace.units
        if trace.credits:
            line["credits"] = trace.credits
        if trace.spans is not None and trace.spans.kept:  # exported: the backend has it
            line["trace_id"] = f"{trace.spans.trace_id:032x}"
        return line

    def _run(self, out: _Output) -> None:
        get, get_nowait = self._queue.get, self._queue.get_nowait
        running = True
        while running:
            batch = [get()]
            # Let lines gather: a writer woken for every line would take the GIL from the
            # event loop thousands of times a second.
            time.sleep(_GATHER_S)
            while len(batch) < BATCH_MAX:
                try:
                    batch.append(get_nowait())
                except queue.Empty:
                    break
            if _STOP in batch:
                running = False
            try:
                out.write([line for line in batch if line is not None])
            except (OSError, ValueError) as exc:  # a full disk, a closed pipe: lose lines only
                log.warning("access log write failed (%s)", exc)
        out.close()


class _Output:
    """stderr, or an append-only file reopened when it is moved or removed (logrotate)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.file: BinaryIO = _buffered_stderr() if path is None else self._open()

    def _open(self) -> BinaryIO:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return self.path.open("ab")

    def write(self, lines: list[bytes]) -> None:
        """Through the file's own buffer: no joined copy of a batch in this thread's memory."""
        if self.path is not None and self._moved():
            self.file.close()
            self.file = self._open()
        self.file.writelines(lines)
        self.file.flush()

    def _moved(self) -> bool:
        assert self.path is not None
        try:
            return os.stat(self.path).st_ino != os.fstat(self.file.fileno()).st_ino
        except FileNotFoundError:
            return True

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # what a failed write left buffered
            self.file.close()  # (stderr's own descriptor stays open)


def _buffered_stderr() -> BinaryIO:
    """fd 2 through a buffer of its own. `sys.stderr.buffer` has none: every line would be a
    system call, each one handing the GIL back and forth with the event loop. PIPE_BUF bytes
    at most per write keeps each write whole on a pipe shared with other writers."""
    return open(sys.stderr.fileno(), "wb", buffering=select.PIPE_BUF, closefd=False)
