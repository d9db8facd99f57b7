"""The HTTP server under the application: connection deadlines, a connection cap, JSON refusals.

aiohttp alone keeps an idle connection for an hour, puts no deadline on a request head, waits
forever for a client that stops reading, accepts until the process runs out of file descriptors,
and answers malformed requests in text/plain echoing the offending bytes. `GatewayRunner` is
aiohttp's AppRunner with its own connection class, `GatewayProtocol`, which adds ([server] in
backends.toml, proxy.config.ServerSection):

    header_timeout_s     a request head must be complete this long after the connection opens,
                         or after its first byte on a kept-alive connection (aiohttp's own
                         keep-alive timer also closes a connection whose next head is not
                         complete keepalive_timeout_s after the previous response): 408 + close
                         when part of a head arrived, a silent close when nothing did
    keepalive_timeout_s  idle kept-alive connections close (aiohttp's timer, set from config)
    write_timeout_s      a connection whose writes stay blocked this long (the client reads
                         nothing) is cut; the handler is cancelled as for a client that left
    max_connections      per worker; beyond it a connection gets 503 and is closed unserved
    malformed requests   (aiohttp's parser errors) JSON in the documented shape, nothing echoed;
                         a head over MAX_HEAD_BYTES in all (431) and an HTTP version other than
                         1.0 and 1.1 (505: HTTP/2.0 and 0.9 request lines parse, but are not
                         what they say) are refused alike, before the application
    Expect               taken from aiohttp (`expect_later`): 100 Continue when the body is
                         read, other expectations ignored

The body deadline, and the 100 Continue, live where bodies are read (proxy.http.body).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, BadHttpMethod, LineTooLong
from aiohttp.web_protocol import RequestHandler

from proxy.config import Config, ServerSection
from proxy.errors import ErrorKind, GatewayError
from proxy.http.body import EXPECTS_CONTINUE
from proxy.ids import hex_id

log = logging.getLogger("proxy")

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

# Longest request line and header line. They differ by design: aiohttp reports both as
# LineTooLong, and the limit it names tells a long URL (414) from a long header (431).
REQUEST_LINE_MAX = 8192
HEADER_LINE_MAX = 8190  # aiohttp's default
# The whole head: request line and every header line (128 of 8,190 bytes would be ~1 MB).
MAX_HEAD_BYTES = 64 * 1024
HTTP_VERSIONS = frozenset({HttpVersion10, HttpVersion11})
# A request refused before the application sees it (set by `checked_requests`).
REFUSED = web.RequestKey("refused", GatewayError)
# File descriptors a worker keeps for itself (listening socket, Redis, logs, probes), besides
# client and upstream connections, when max_connections is fitted under the open-file limit.
FD_HEADROOM = 256
# A shed connection has had its 503 and a FIN; it is cut if the client does not close first.
SHED_LINGER_S = 1.0


def raw_response(error: GatewayError) -> bytes:
    """A whole HTTP/1.1 response, written straight to a transport no request object exists for
    (with an id of its own, as every answer has)."""
    body = error.json()
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}",
            "Content-Type: application/json", f"Content-Length: {len(body)}",
            f"X-Request-Id: {hex_id()}", "Connection: close",
            *(f"{k}: {v}" for k, v in error.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_HEAD_TIMEOUT = GatewayError(ErrorKind.REQUEST_TIMEOUT, "the request head did not arrive in time")
_HEAD_TOO_LARGE = GatewayError(ErrorKind.HEADERS_TOO_LARGE,
                               f"the request head is larger than {MAX_HEAD_BYTES} bytes")
_SHED = GatewayError(ErrorKind.UNAVAILABLE,
                     "the gateway is at its connection limit; retry shortly",
                     headers={"Retry-After": "1"})


def refusal(exc: BaseException | None) -> GatewayError:
    """A parser error as a public error: the right status, and none of the request's bytes."""
    if isinstance(exc, LineTooLong):
        if exc.args[1:2] == (REQUEST_LINE_MAX,):
            return GatewayError(ErrorKind.URI_TOO_LONG,
                                f"the request line is longer than {REQUEST_LINE_MAX} bytes")
        return GatewayError(ErrorKind.HEADERS_TOO_LARGE,
                            f"a request header is longer than {HEADER_LINE_MAX} bytes")
    if isinstance(exc, BadHttpMethod) and not exc.message.startswith("Received HTTPS"):
        # The parser knows every registered method: anything else is one we do not implement.
        return GatewayError(ErrorKind.NOT_IMPLEMENTED, "the request method is not supported")
    if isinstance(exc, BadHttpMessage) and exc.message == "Too many headers received":
        return GatewayError(ErrorKind.HEADERS_TOO_LARGE, "the request has too many headers")
    return GatewayError(ErrorKind.INVALID_REQUEST, "the request is not valid HTTP/1.1")


class GatewayProtocol(RequestHandler):
    """One client connection: aiohttp's handler plus the deadlines, the cap and JSON refusals."""

    __slots__ = ("_gateway", "_head_bytes", "_head_started", "_head_timer", "_shed",
                 "_write_timer")

    def __init__(self, manager: GatewayServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gateway = manager
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # bytes of the awaited head have arrived
        self._head_bytes = 0  # how many, while it is incomplete
        self._write_timer: asyncio.TimerHandle | None = None
        self._shed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._gateway.open_connections >= self._gateway.max_connections:
            self._shed_connection(cast(asyncio.Transport, transport))
            return
        super().connection_made(transport)
        self._arm_head_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        for timer in (self._head_timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._write_timer = None
        if not self._shed:  # a shed connection was never registered with the server
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._shed:
            return
        next_head = bool(data) and self._head_timer is None and self._awaiting_request()
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:
            # A complete head (or a parse error, answered at once): the deadline is met.
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            self._head_started = False
            self._head_bytes = 0
        elif next_head:
            # The start of the next request on a kept-alive connection, not all of its head
            # (a whole head in one read, the usual case, costs no timer).
            self._head_started = True
            self._head_bytes = len(data)
            self._arm_head_deadline()
        elif data and self._head_timer is not None:
            self._head_started = True
            self._head_bytes += len(data)
        if self._head_bytes > MAX_HEAD_BYTES and self.transport is not None:
            # Arriving in pieces, the head is refused before the parser buffers any more of it
            # (one that came whole is refused by `checked_requests`).
            self.transport.write(raw_response(_HEAD_TOO_LARGE))
            self._head_bytes = 0
            self.force_close()
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_timer = self._gateway.loop.call_later(
            self._gateway.settings.write_timeout_s, self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's hook for requests the application never saw: parser errors (400) and a
        handler that raised past the middleware (500). `message` carries request bytes: unused."""
        if request.writer.output_size > 0:  # as aiohttp does: too late for another response
            raise ConnectionError("the response has started; cannot send an error response")
        if status == 400:
            error = refusal(exc)
            log.debug("refused a malformed request (%s)", type(exc).__name__)
        else:
            error = GatewayError(ErrorKind.INTERNAL_ERROR, "internal error")
            log.error("unhandled error outside the application", exc_info=exc)
        # A fresh id: every answer carries one, and a malformed request's own is not to be trusted.
        response = web.Response(status=error.status, body=error.json(),
                                content_type="application/json",
                                headers={**error.headers, "X-Request-Id": hex_id()})
        response.force_close()
        return response

    def _awaiting_request(self) -> bool:
        """Between requests: aiohttp waits on `_waiter` only while no request is in hand."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def _arm_head_deadline(self) -> None:
        self._head_timer = self._gateway.loop.call_later(
            self._gateway.settings.header_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport is None or self._force_close:
            return
        if self._head_started:  # a client mid-request is told why; a silent one just closed
            self.transport.write(raw_response(_HEAD_TIMEOUT))
        self.force_close()

    def _write_expired(self) -> None:
        self._write_timer = None
        if self.transport is not None:
            log.debug("cut a connection whose client read nothing for %.0f s",
                      self._gateway.settings.write_timeout_s)
            # Nothing more can reach this client: drop the buffer. aiohttp then cancels the
            # handler, as for any client that went away (the pipeline settles what was sent).
            self.transport.abort()

    def _shed_connection(self, transport: asyncio.Transport) -> None:
        """Over the cap: 503 and FIN without reading a request; cut after a short linger so the
        client can read the answer before a reset."""
        self._shed = True
        transport.write(raw_response(_SHED))
        if transport.can_write_eof():
            transport.write_eof()
        # Its one timer, kept where the head deadline's would be.
        self._head_timer = self._gateway.loop.call_later(SHED_LINGER_S, transport.abort)


class GatewayServer(web.Server):
    """aiohttp's Server making GatewayProtocol connections and counting the open ones."""

    def __init__(self, handler: Handler, *, request_factory: Callable[..., web.BaseRequest],
                 handler_cancellation: bool, settings: ServerSection, max_connections: int,
                 **handler_kwargs: Any) -> None:
        self.loop = asyncio.get_running_loop()
        super().__init__(handler, request_factory=request_factory,
                         handler_cancellation=handler_cancellation, loop=self.loop,
                         **handler_kwargs)
        # Each connection's options (timeouts, line limits, logging), kept here rather than
        # read back from aiohttp's Server.
        self.handler_kwargs = handler_kwargs
        self.settings = settings
        self.max_connections = max_connections
        self.open_connections = 0

    def __call__(self) -> GatewayProtocol:
        return GatewayProtocol(self, loop=self.loop, **self.handler_kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.open_connections += 1

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.open_connections -= 1


class GatewayRunner(web.AppRunner):
    """AppRunner serving `app` with the [server] settings of `config`."""

    def __init__(self, app: web.Application, config: Config, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=config.server.keepalive_timeout_s,
                         max_line_size=REQUEST_LINE_MAX, max_field_size=HEADER_LINE_MAX,
                         **kwargs)
        self.settings = config.server
        self.max_connections = connection_cap(config)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # the app's startup, then aiohttp's own Server
        return GatewayServer(
            expect_later(plain.request_handler),
            request_factory=checked_requests(plain.request_factory),
            handler_cancellation=plain.handler_cancellation, settings=self.settings,
            max_connections=self.max_connections,
            **plain._kwargs,  # the connection options AppRunner assembled (timeouts, logging)
        )


def checked_requests(make: Callable[..., web.BaseRequest]) -> Callable[..., web.BaseRequest]:
    """aiohttp's request factory, refusing (REFUSED, answered by `expect_later`'s handler) an
    HTTP version other than 1.0 and 1.1 (its answer goes out as HTTP/1.1, not in the version
    the client claimed) and a head larger than MAX_HEAD_BYTES in all."""

    def factory(message: RawRequestMessage, *args: Any, **kwargs: Any) -> web.BaseRequest:
        refused = None
        if message.version not in HTTP_VERSIONS:
            refused = GatewayError(ErrorKind.HTTP_VERSION_NOT_SUPPORTED,
                                   "this server speaks HTTP/1.1 (and 1.0)")
            message = message._replace(version=HttpVersion11)
        elif len(message.path) + sum(len(k) + len(v) + 4 for k, v in message.raw_headers) \
                > MAX_HEAD_BYTES:
            refused = _HEAD_TOO_LARGE
        request = make(message, *args, **kwargs)
        if refused is not None:
            request[REFUSED] = refused
        return request

    return factory


def expect_later(handle: Handler) -> Handler:
    """Take `Expect` out of aiohttp's hands. Before any check it would answer `100-continue`
    (so a refused upload is sent anyway) and any other expectation with a text/plain 417 that
    echoes it. Here `100-continue` is answered where the body is first read, after auth and the
    checks that need no body (proxy.http.body), and a refusal before that closes the connection
    (the client holds its body back); other expectations are ignored (RFC 9110 §10.1.1; nginx
    does the same)."""

    def handler(request: web.BaseRequest) -> Awaitable[web.StreamResponse]:
        refused = request.get(REFUSED)
        if refused is not None:
            return refusing(refused)
        expect = request.headers.get(hdrs.EXPECT)
        if expect is None:
            return handle(request)  # the app's own coroutine: nothing added on the usual path
        return expecting(request, expect)

    async def refusing(error: GatewayError) -> web.StreamResponse:
        response = web.Response(status=error.status, body=error.json(),
                                content_type="application/json",
                                headers={"X-Request-Id": hex_id()})
        response.force_close()
        return response

    async def expecting(request: web.BaseRequest, expect: str) -> web.StreamResponse:
        headers = request.headers.copy()
        del headers[hdrs.EXPECT]
        request = request.clone(headers=headers)
        if request.version == HttpVersion11 and expect.strip().lower() == "100-continue":
            request[EXPECTS_CONTINUE] = True  # until proxy.http.body sends it
        response = await handle(request)
        if request.get(EXPECTS_CONTINUE) and not response.prepared:
            response.force_close()  # the body was never asked for: it may never come
        return response

    return handler


def raise_fd_limit() -> None:
    """Lift this process's soft open-file limit to the hard one (no privilege needed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        # A container may refuse: connection_cap then fits the lower limit.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def connection_cap(config: Config) -> int:
    """max_connections, lowered to fit under the open-file limit: a worker out of descriptors
    cannot even accept a connection to refuse it. Each client connection may hold one upstream
    connection (the backends' summed max_concurrency bounds those, when smaller), and the worker
    keeps FD_HEADROOM for itself."""
    wanted = config.server.max_connections
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = soft - FD_HEADROOM
    upstream = min(sum(backend.max_concurrency for backend in config.backends), room // 2)
    cap = max(1, min(wanted, room - upstream))
    if cap < wanted:
        log.warning("max_connections lowered from %d to %d to fit the open-file limit (%d); "
                    "raise `ulimit -n` to allow more", wanted, cap, soft)
    return cap
