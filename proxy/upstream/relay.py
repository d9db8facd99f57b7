"""Answers going back to the client: a whole one (`send_whole`), or an upstream SSE stream
relayed event by event as it arrives (`relay_stream`). Either way the request's `Result` says
how far it got, which is what the settlement charges.

The client's format (OpenAI SSE, Anthropic events, Ollama NDJSON) is the encoder's business.

Never buffered beyond what one upstream read returned; each write waits for the client to drain
(backpressure). Response headers go out only once the first client-bound event exists, so an
upstream that fails before that (an in-band error, a cut) is an `UpstreamFailure` the caller may
retry on another backend, or else a real HTTP status. After that the status is fixed at 200
and a failure (in-band error, cut connection, idle timeout) becomes exactly one error event
followed by the normal terminator. A client that goes away cancels the handler, which closes the
upstream request (see `Upstreams.exchange`); so does one that reads nothing for
`[server] write_timeout_s`, whose connection proxy.http.server cuts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp
from aiohttp import web

from proxy.credits.meter import Result
from proxy.errors import ErrorKind, GatewayError
from proxy.http.sse import DONE, Event, SSEDecoder
from proxy.observe.trace import TRACE
from proxy.outcome import Outcome
from proxy.styles.base import StreamEncoder
from proxy.styles.wire import ChunkFilter, UpstreamStreamError
from proxy.upstream import http1
from proxy.upstream.client import UpstreamFailure
from proxy.upstream.pool import RETRY_AFTER_S

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def send_whole(request: web.Request, response: web.Response, result: Result
                     ) -> web.Response:
    """Send a whole answer whose usage `result` already holds (`Result.answered`: charged as
    made for a client that leaves while it goes out); delivered once it is out."""
    await response.prepare(request)
    await response.write_eof()
    result.delivered()
    return response


async def relay_stream(
    request: web.Request,
    upstream: http1.Response,
    chunks: ChunkFilter,
    encoder: StreamEncoder,
    headers: Mapping[str, str],
    result: Result,
    max_s: float | None = None,
) -> web.StreamResponse:
    """Upstream SSE -> `chunks` (normalise, meter) -> `encoder` (client's format) -> client;
    `result` learns how it ended and what reached the client (the chunk filter's count).

    `result.captured`, when set, receives every byte sent (an idempotent request's replay).
    `max_s` bounds the whole stream: a request must end before its credit hold could expire."""
    response = web.StreamResponse(
        status=200, headers={"Content-Type": encoder.content_type, **STREAM_HEADERS, **headers}
    )
    decoder = SSEDecoder()
    pending: list[bytes] = []
    capture = result.captured
    result.tally = chunks
    outcome, error = Outcome.COMPLETED, None

    def take(events: list[Event]) -> bool:
        """Queue the client's frames for these events; True once the upstream said [DONE]."""
        for event in events:
            if event.data == DONE:
                return True
            data = chunks.feed(event.data)
            if data is not None and (out := encoder.chunk(data)):
                pending.append(out)
        return False

    deadline = asyncio.timeout(max_s)
    try:
        done = False
        async with deadline:
            async for chunk in upstream.chunks():
                done = take(decoder.feed(chunk))
                if pending:
                    await _send(request, response, b"".join(pending), capture)
                    pending.clear()
                if done:
                    break
            else:
                done = take(decoder.finish())
        if not done and not chunks.finished:
            outcome, error = _failed(Outcome.CUT, ErrorKind.UPSTREAM_ERROR,
                                     "the model server closed the stream before it finished")
    except UpstreamStreamError as exc:  # busy is not broken (see Upstreams.exchange)
        outcome, error = _failed(Outcome.FAILED,
                                 ErrorKind.UNAVAILABLE if exc.busy else ErrorKind.UPSTREAM_ERROR,
                                 exc.message)
        if exc.reported and not exc.busy:
            # The upstream failed though its stream ended cleanly: mark its body so that the
            # exchange counts a failure (and has the backend probed) rather than a success.
            upstream.mark_broken(UpstreamStreamError(exc.message))
    except TimeoutError:  # the stream's own deadline, or the upstream's idle gap
        outcome, error = _failed(
            Outcome.TIMEOUT, ErrorKind.UPSTREAM_TIMEOUT,
            "the stream ran longer than this gateway allows" if deadline.expired()
            else "the model server stopped sending before the stream finished")
    except (http1.Disconnected, http1.BadResponse):
        outcome, error = _failed(Outcome.CUT, ErrorKind.UPSTREAM_ERROR,
                                 "the model server closed the stream before it finished")

    except ClientGone:
        result.status = Outcome.CLIENT_GONE
        return response

    if error is not None and not response.prepared and not pending:
        # Nothing for the client yet: a real HTTP status, or another backend's answer. Time
        # spent waiting is not spent twice.
        result.tally = None  # nothing reached the client: nothing to charge
        raise UpstreamFailure(error.kind, error.message, retryable=outcome is not Outcome.TIMEOUT,
                              headers=error.headers)
    tail = pending
    tail.append(encoder.error(error) if error else encoder.end(chunks.usage))
    try:
        await _send(request, response, b"".join(tail), capture)
        await response.write_eof()
    except (ClientGone, ConnectionError):
        outcome = Outcome.CLIENT_GONE
    result.status = outcome
    return response


class ClientGone(Exception):
    """The client closed its connection mid-stream (not an upstream failure)."""


async def _send(request: web.Request, response: web.StreamResponse, data: bytes,
                capture: list[bytes] | None) -> None:
    if capture is not None:
        capture.append(data)
    try:
        if not response.prepared:
            await response.prepare(request)
            trace = request.get(TRACE)
            if trace is not None:
                trace.first_byte()  # the first content event goes out now
        await response.write(data)
    except (ConnectionError, aiohttp.ClientConnectionError) as exc:
        raise ClientGone from exc


def _failed(outcome: Outcome, kind: ErrorKind, message: str) -> tuple[Outcome, GatewayError]:
    busy = {"Retry-After": RETRY_AFTER_S} if kind is ErrorKind.UNAVAILABLE else None
    return outcome, GatewayError(kind, message, headers=busy)
