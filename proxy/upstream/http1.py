"""HTTP/1.1 to the backends: keep-alive connections, one exchange at a time on each.

This is all the gateway asks of an HTTP client on its hot path: POST a body it already holds,
then read the status, the headers and the body as it arrives (Content-Length, chunked, or up to
the close), under three timeouts (connect; first byte; idle gap once the body flows). Parsing is
httptools' (llhttp, the parser aiohttp itself uses). aiohttp's client (DESIGN §3) stays for
everything else (probes, the engines' /metrics, media fetches): per request it builds a request
object, a response object, a timer context and a task that writes the body one loop turn later,
which measured +0.13 to +0.16 ms at the median of a request at 1,000/s on this project's
machines, a quarter of all the latency the gateway adds (loadtests/README.md).

An idle connection is reused last-in first-out and dropped after `IDLE_S` (below the 5 s after
which uvicorn, i.e. vLLM, closes an idle connection itself), or at once when the server closes
it. A response whose body was not read to its end closes its connection: that is how a
backend learns that its client went away.

    http1.py             `Client`: the idle connections per origin, connecting, reuse
    http1_request.py     `Target` and the request head written
    http1_connection.py  one connection: parsing, read-ahead bounds, the first-byte/idle timer
    http1_response.py    `Response`: the head, then the body as it arrives (decoded)
    http1_errors.py      the failures callers catch
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import Mapping

from proxy.upstream.http1_connection import Connection
from proxy.upstream.http1_errors import (
    BadHeader,
    BadResponse,
    ConnectFailed,
    ConnectTimeout,
    Disconnected,
    ReadTimeout,
)
from proxy.upstream.http1_request import Target, request_head
from proxy.upstream.http1_response import INFLATE_STEP, Response

# What callers use, wherever it is defined: `from proxy.upstream import http1`, then http1.X.
__all__ = ["INFLATE_STEP", "BadHeader", "BadResponse", "Client", "ConnectFailed",
           "ConnectTimeout", "Disconnected", "ReadTimeout", "Response", "Target"]

IDLE_S = 4.0  # an idle connection older than this is closed rather than reused
IDLE_KEPT = 128  # idle connections kept per origin; more are closed as they come back


class Client:
    """The keep-alive connections of one worker to every backend."""

    def __init__(self, *, connect_timeout_s: float, first_byte_timeout_s: float,
                 idle_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[tuple[str, str, int], collections.deque[Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def post(self, target: Target, body: bytes, headers: Mapping[str, str]) -> Response:
        """Send the request; return once its status and headers are in (or raise one of this
        module's errors; nothing has been read of the body)."""
        head = request_head(target, headers, len(body))
        conn = self._reusable(target.origin)
        connect_s = None
        if conn is None:
            began = time.monotonic()
            conn = await self._connect(target.origin)
            connect_s = time.monotonic() - began
        if len(body) < 65536:
            conn.send(head + body)
        else:  # a big upload: not copied once more
            conn.send(head)
            conn.send(body)
        try:
            response = await conn.response_head()
        except BaseException:
            conn.close()
            raise
        response.connect_s = connect_s
        return response

    def _reusable(self, origin: tuple[str, str, int]) -> Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest = asyncio.get_running_loop().time() - IDLE_S
        while idle and idle[0].idle_since < oldest:
            idle.popleft().close()
        while idle:
            conn = idle.pop()
            if conn.open:
                return conn
        return None

    async def _connect(self, origin: tuple[str, str, int]) -> Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, origin), host, port, ssl=tls,
                    server_hostname=host if tls else None)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {host}:{port} within "
                                 f"{self.connect_timeout_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    def keep(self, conn: Connection) -> None:
        """A connection whose answer ended cleanly, ready for the next request."""
        if self._closed:
            conn.close()
            return
        idle = self._idle.setdefault(conn.origin, collections.deque())
        idle.append(conn)
        if len(idle) > IDLE_KEPT:
            idle.popleft().close()

    def forget(self, conn: Connection) -> None:
        """A connection that closed: no longer one to reuse."""
        idle = self._idle.get(conn.origin)
        if idle is not None and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()
