"""HTTP/1.1 to the backends: keep-alive connections, one exchange at a time on each.

This is all the gateway asks of an HTTP client on its hot path: POST a body it already holds,
then read the status, the headers and the body as it arrives (Content-Length, chunked, or up to
the close), under three timeouts (connect; first byte; idle gap once the body flows). Parsing is
httptools' (llhttp, the parser aiohttp itself uses). aiohttp's client (DESIGN §3) stays for
everything else (probes, the engines' /metrics, media fetches): per request it builds a request
object, a response object, a timer context and a task that writes the body one loop turn later,
which measured +0.13 to +0.16 ms at the median of a request at 1,000/s on this project's
machines, a quarter of all the latency the gateway adds (README "Benchmarks").

An idle connection is reused last-in first-out and dropped after `IDLE_S` (below the 5 s after
which uvicorn, i.e. vLLM, closes an idle connection itself), or at once when the server closes
it. A response whose body was not read to its end closes its connection: that is how a
backend learns that its client went away.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

IDLE_S = 4.0  # an idle connection older than this is closed rather than reused
IDLE_KEPT = 128  # idle connections kept per origin; more are closed as they come back
# Body bytes read ahead of whoever reads the body: past HIGH the socket is not read until they
# fall under LOW, so a slow client slows the backend (backpressure) instead of filling memory.
READ_AHEAD_HIGH = 64 * 1024
READ_AHEAD_LOW = 16 * 1024
INFLATE_STEP = 256 * 1024  # decoded bytes handed out at once from a compressed body
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS,
          "deflate": 32 + zlib.MAX_WBITS}  # deflate: zlib-wrapped (or gzip), as servers send it


class ConnectFailed(ConnectionError):
    """No connection could be made (refused, unreachable, unresolvable, TLS handshake)."""


class ConnectTimeout(TimeoutError):
    """The connection was not made within the connect timeout."""


class Disconnected(ConnectionError):
    """The server closed or reset the connection before the answer ended."""


class ReadTimeout(TimeoutError):
    """No answer within the first-byte timeout, or a gap in the body longer than the idle one."""


class BadResponse(Exception):
    """Bytes that are not an HTTP/1.x answer."""


class BadHeader(ValueError):
    """A header value with a line break or NUL: never written to a backend."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request goes: the connection's origin and the request line's target, parsed
    once per backend and path."""

    origin: tuple[str, str, int]  # scheme, host, port
    host_header: bytes
    path: bytes  # the request target: path and query, as the URL spells them

    @classmethod
    def of(cls, url: str) -> Target:
        parsed = URL(url, encoded=True)
        if parsed.scheme not in ("http", "https") or not parsed.host or parsed.port is None:
            raise ValueError(f"not an http(s) URL: {url!r}")
        host = (parsed.raw_host or parsed.host).lower()
        shown = f"[{host}]" if ":" in host else host  # an IPv6 literal
        host_header = shown if parsed.is_default_port() else f"{shown}:{parsed.port}"
        return cls((parsed.scheme, host, parsed.port), host_header.encode("ascii"),
                   (parsed.raw_path_qs or "/").encode())


class Response:
    """An answer whose status and headers have arrived; its body is read with `read_chunk`,
    `chunks` or `read`, then `release` (or `close`) gives the connection back. A gzip or deflate
    body (a server may compress when the request names no encoding) is read decoded."""

    __slots__ = ("_conn", "_inflate", "broken", "content_length", "headers", "status",
                 "total_bytes")

    def __init__(self, conn: _Connection, status: int, headers: CIMultiDictProxy[str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self.total_bytes = 0  # body bytes read so far (decoded)
        self.broken: BaseException | None = None  # what ended the body early, if anything
        encoding = headers.get("Content-Encoding", "identity").strip().lower()
        self._inflate = zlib.decompressobj(_WBITS[encoding]) if encoding in _WBITS else None

    async def read_chunk(self) -> bytes:
        """The body's next bytes as they came; b"" at its end. Raises `ReadTimeout`,
        `Disconnected` or `BadResponse` when it breaks off."""
        try:
            data = await (self._conn.body_chunk() if self._inflate is None else self._inflated())
        except Exception as exc:
            self.broken = exc
            raise
        self.total_bytes += len(data)
        return data

    async def _inflated(self) -> bytes:
        """The next decoded bytes, at most `INFLATE_STEP` at a time (a small chunk may inflate
        to a great deal: whoever reads counts it against their cap as it comes)."""
        inflate = self._inflate
        assert inflate is not None
        try:
            while True:
                if inflate.unconsumed_tail:
                    data = inflate.decompress(inflate.unconsumed_tail, INFLATE_STEP)
                elif raw := await self._conn.body_chunk():
                    data = inflate.decompress(raw, INFLATE_STEP)
                else:
                    return inflate.flush()
                if data:
                    return data
        except zlib.error:
            raise BadResponse("a compressed body that does not decompress") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        while data := await self.read_chunk():
            yield data

    async def read(self, limit: int) -> bytes:
        """The rest of the body, at most `limit` bytes (more is left unread)."""
        parts: list[bytes] = []
        size = 0
        while size < limit and (data := await self.read_chunk()):
            parts.append(data)
            size += len(data)
        return b"".join(parts)[:limit]

    def mark_broken(self, reason: BaseException) -> None:
        """Whoever reads the body found it unusable: the backend failed, the connection goes."""
        self.broken = reason

    @property
    def finished(self) -> bool:
        """The whole body has been read."""
        return self._conn.finished

    def close(self) -> None:
        """Drop the connection: a backend stops generating an answer nobody reads."""
        self._conn.close()

    def release(self) -> None:
        """Back to the pool when the body was read to its end; otherwise closed."""
        self._conn.release()


class Client:
    """The keep-alive connections of one worker to every backend."""

    def __init__(self, *, connect_timeout_s: float, first_byte_timeout_s: float,
                 idle_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    async def post(self, target: Target, body: bytes, headers: Mapping[str, str]) -> Response:
        """Send the request; return once its status and headers are in (or raise one of this
        module's errors; nothing has been read of the body)."""
        head = _request_head(target, headers, len(body))
        conn = self._reusable(target.origin) or await self._connect(target.origin)
        if len(body) < 65536:
            conn.send(head + body)
        else:  # a big upload: not copied once more
            conn.send(head)
            conn.send(body)
        try:
            return await conn.response_head()
        except BaseException:
            conn.close()
            raise

    def _reusable(self, origin: tuple[str, str, int]) -> _Connection | None:
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

    async def _connect(self, origin: tuple[str, str, int]) -> _Connection:
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
                    lambda: _Connection(self, origin), host, port, ssl=tls,
                    server_hostname=host if tls else None)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {host}:{port} within "
                                 f"{self.connect_timeout_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    def _keep(self, conn: _Connection) -> None:
        """A connection whose answer ended cleanly, ready for the next request."""
        if self._closed:
            conn.close()
            return
        idle = self._idle.setdefault(conn.origin, collections.deque())
        idle.append(conn)
        if len(idle) > IDLE_KEPT:
            idle.popleft().close()

    def _forget(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.origin)
        if idle is not None and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


def _request_head(target: Target, headers: Mapping[str, str], length: int) -> bytes:
    lines = [b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Length: %d\r\n"
             % (target.path, target.host_header, length)]
    accept = False
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\0" in value:
            raise BadHeader(f"the {name} header has a line break")
        lower = name.lower()
        if lower in ("host", "content-length", "transfer-encoding", "connection"):
            continue  # this client's own framing
        accept = accept or lower == "accept"
        lines.append(b"%b: %b\r\n" % (name.encode("ascii"),
                                      value.encode("utf-8", "surrogateescape")))
    if not accept:
        lines.append(b"Accept: */*\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


class _Connection(asyncio.Protocol):
    """One connection and its parser; at most one exchange at a time."""

    def __init__(self, client: Client, origin: tuple[str, str, int]) -> None:
        self.client = client
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._busy = False  # an exchange is in flight (a request sent, its answer not ended)
        self._raw_headers: list[tuple[str, str]] = []
        self._response: Response | None = None
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0  # bytes in _body
        self._paused = False  # reading paused: the reader is behind
        self._framed = False  # the body's end is known from its framing, not the close
        self._ended = False  # the answer ended (its last byte parsed, or the close ended it)
        self._reusable = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._gap = client.first_byte_timeout_s
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    # -- the caller's side

    def send(self, data: bytes) -> None:
        if not self._busy:
            self._start()
        assert self.transport is not None
        self.transport.write(data)

    def _start(self) -> None:
        self._busy = True
        self._raw_headers = []
        self._response = None
        self._body.clear()
        self._buffered = 0
        self._framed = self._ended = self._reusable = False
        self._error = None
        self._gap = self.client.first_byte_timeout_s
        self._deadline = self.loop.time() + self._gap
        self._arm()

    async def response_head(self) -> Response:
        while self._response is None:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self._response

    async def body_chunk(self) -> bytes:
        while True:
            if self._body:
                data = self._body.popleft()
                self._buffered -= len(data)
                if self._paused and self._buffered <= READ_AHEAD_LOW:
                    self._paused = False
                    self._deadline = self.loop.time() + self._gap  # the gap starts again
                    if self.transport is not None:
                        self.transport.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self._ended:
                return b""
            await self._wait()

    @property
    def finished(self) -> bool:
        return self._ended and not self._body and self._error is None

    async def _wait(self) -> None:
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def release(self) -> None:
        if self._busy and self.finished and self._reusable and self.open:
            self._busy = False
            self._cancel_timer()
            self.idle_since = self.loop.time()
            self.client._keep(self)
        else:
            self.close()

    def close(self) -> None:
        if self._busy and not self._ended and self._error is None:
            self._error = Disconnected("the connection was closed mid-answer")
            self._wake()
        self._busy = False
        self._cancel_timer()
        if self.open:
            self.open = False
            self.client._forget(self)
        if self.transport is not None:
            self.transport.close()

    # -- the event loop's side

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.open = True

    def data_received(self, data: bytes) -> None:
        if not self._busy:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        if self._ended:  # more than the answer: keep what was answered, never reuse
            self._reusable = False
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(BadResponse("the server switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"not an HTTP answer: {exc}"))
        else:
            self._deadline = self.loop.time() + self._gap
            if self._busy and not self._ended and self._deadline < self._timer_at:
                self._arm()  # the gap shrank (the body began): sooner than the timer
            if self._buffered > READ_AHEAD_HIGH and not self._paused and self.open:
                self._paused = True
                assert self.transport is not None
                self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        was_open, self.open = self.open, False
        if was_open:
            self.client._forget(self)
        self._cancel_timer()
        if self._busy and not self._ended and self._error is None:
            if self._response is not None and not self._framed:
                self._ended = True  # a body that runs to the close has ended
            else:
                self._error = Disconnected("the server closed the connection mid-answer")
        self._wake()

    # -- httptools' callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # 100 Continue and the like: the answer follows
            self._raw_headers = []
            return
        headers = CIMultiDictProxy(CIMultiDict(self._raw_headers))
        encoding = headers.get("Transfer-Encoding", "").lower()
        self._framed = "chunked" in encoding or "Content-Length" in headers
        self._response = Response(self, status, headers)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        self._gap = self.client.idle_timeout_s  # the body flows: gaps are idle gaps now
        self._wake()

    def on_message_complete(self) -> None:
        if self._response is None:
            return  # the end of a 1xx answer
        self._ended = True
        self._reusable = self._parser.should_keep_alive()
        self._cancel_timer()
        self._wake()

    # -- the rest

    def _fail(self, error: BaseException) -> None:
        if self._error is None and not self._ended:
            self._error = error
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm(self) -> None:
        self._cancel_timer()
        self._timer_at = self._deadline
        self._timer = self.loop.call_at(self._deadline, self._check_deadline)

    def _check_deadline(self) -> None:
        """One timer per exchange, moved on lazily: data only sets a new deadline."""
        self._timer = None
        if not self._busy or self._ended:
            return
        if self._paused:  # our reader is behind, not the server: no gap is counted
            self._deadline = self.loop.time() + self._gap
        if self.loop.time() >= self._deadline:
            waited = "an answer" if self._response is None else "more of the answer"
            self._fail(ReadTimeout(f"no {waited} within {self._gap:g} s"))
        else:
            self._arm()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
