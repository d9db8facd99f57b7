"""One keep-alive connection to a backend: an asyncio protocol that writes a request, feeds what
comes back to httptools' parser (llhttp, the parser aiohttp itself uses), and hands the answer
to its reader: the head as a `Response`, then the body in chunks. One exchange at a time.

Flow control: past READ_AHEAD_HIGH unread body bytes the socket is not read until the reader
brings them under READ_AHEAD_LOW, so a slow client slows the backend instead of filling memory.
One timer per exchange bounds the wait for the first byte and then each gap in the body.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Protocol, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.upstream.http1_errors import BadResponse, Disconnected, ReadTimeout
from proxy.upstream.http1_response import Response

# Body bytes read ahead of whoever reads the body: past HIGH the socket is not read until they
# fall under LOW, so a slow client slows the backend (backpressure) instead of filling memory.
READ_AHEAD_HIGH = 64 * 1024
READ_AHEAD_LOW = 16 * 1024


class Pool(Protocol):
    """Where a connection comes from and goes back to (proxy.upstream.http1.Client)."""

    first_byte_timeout_s: float
    idle_timeout_s: float

    def keep(self, conn: Connection) -> None: ...

    def forget(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One connection and its parser; at most one exchange at a time."""

    def __init__(self, client: Pool, origin: tuple[str, str, int]) -> None:
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
            self.client.keep(self)
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
            self.client.forget(self)
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
            self.client.forget(self)
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
