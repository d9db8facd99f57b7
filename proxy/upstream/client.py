"""Calls to upstream servers over the keep-alive client (proxy.upstream.http1), their timeouts
and failure mapping.

Timeouts are separate, as a streaming proxy needs: connect; first byte (headers and then the first
body bytes: covers queueing and prefill); idle gap between body chunks once data flows. Failures
are `UpstreamFailure`s that say whether another backend may be tried: one that left the client
without a byte and says nothing about the request itself (refused or reset connection, 429, 503,
a 500 or 502 from a server whose engine died, a stream that failed before its first event). A
timeout is not retried (the time is spent), nor is TGI's 424 (the request itself may be what
fails). Everything maps to 502/503/504 with a public message, never the upstream's exception text.

Every exchange also reports its outcome to the backend's health (passive ejection): a refused or
reset connection, a timeout, a 5xx (or TGI's 424 generation failure), a stream cut, gone silent or
ended by an error event (the relay marks its body) are failures, and each failure asks for a
probe of that backend at once, so a dead server is out of rotation after its first failure rather
than its fifth; a complete answer, or a client error the server judged properly (4xx), a
success; 429 and 503 (busy, not broken: vLLM's full queue) and a cancelled request (the client
went away) count as neither.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import TypeVar

import orjson

from proxy.config import UpstreamSection
from proxy.errors import ErrorKind, GatewayError
from proxy.observe.metrics import Metrics
from proxy.observe.trace import CURRENT, Stage, new_span_id
from proxy.upstream import http1
from proxy.upstream.dispatch import Dispatcher
from proxy.upstream.early import Early
from proxy.upstream.pool import RETRY_AFTER_S, Backend, Pool
from proxy.upstream.prefixes import Prompt
from proxy.upstream.queue import Ticket

log = logging.getLogger("proxy.upstream")
T = TypeVar("T")

_ERROR_BODY_LIMIT = 64 * 1024
_MESSAGE_LIMIT = 300
# Statuses that say nothing about the backend's health: busy, or not our business.
_NEUTRAL_STATUSES = frozenset({429, 503})
# Server errors retried on another backend (besides 429 and 503): a vLLM whose engine died
# answers 500 until its server exits; a proxy in front of a dead server, 502.
_RETRIED_ERRORS = frozenset({500, 502})
# Raised inside an exchange by whoever reads the body: the upstream's fault.
_UPSTREAM_KINDS = frozenset({ErrorKind.UPSTREAM_ERROR, ErrorKind.UPSTREAM_TIMEOUT})


class UpstreamFailure(GatewayError):
    """The upstream failed before sending a usable response; `retryable` if nothing was started."""

    def __init__(self, kind: ErrorKind, message: str, *, retryable: bool,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(kind, message, headers=headers)
        self.retryable = retryable


class Upstreams:
    """The worker's keep-alive connections to every backend (proxy.upstream.http1)."""

    def __init__(self, settings: UpstreamSection, metrics: Metrics,
                 dispatcher: Dispatcher | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.dispatcher = dispatcher or Dispatcher(None, metrics)
        self.http = http1.Client(connect_timeout_s=settings.connect_timeout_s,
                                 first_byte_timeout_s=settings.first_byte_timeout_s,
                                 idle_timeout_s=settings.idle_timeout_s)
        self._open: set[http1.Response] = set()  # responses whose body is being relayed
        self._aborting = False

    async def close(self) -> None:
        await self.http.close()

    def _failed(self, backend: Backend, kind: str) -> None:
        name = self.metrics.labels.backend(backend.name)
        self.metrics.upstream_failures.labels(name, kind).inc()
        backend.probe_soon()  # a dead server fails its probe: out at once, not after N errors
        if backend.record_failure():
            self.metrics.ejections.labels(name).inc()
            until = backend.health.ejected_until or 0.0
            log.warning("backend %r ejected for %.0f s after %d failure(s) in a row",
                        backend.name, until - time.monotonic(),
                        backend.health.consecutive_failures)

    def _record_status(self, backend: Backend, status: int) -> None:
        if status in _NEUTRAL_STATUSES:
            return
        if status >= 500 or status == 424:  # 424: TGI's "generation failed"
            self._failed(backend, f"status_{status // 100}xx" if status != 424 else "status_424")
        else:
            backend.record_success()  # it judged a bad request properly: alive and well

    def abort_open(self) -> int:
        """Close every upstream response still being read (the drain deadline passed).

        Each relay then sees the upstream break off and ends its stream with one error event,
        so a client gets a proper end instead of a cut connection. Returns how many.
        """
        self._aborting = True
        open_now = list(self._open)
        for response in open_now:
            response.close()
        return len(open_now)

    async def call(
        self,
        pool: Pool,
        path: str | Callable[[Backend], str],
        body_for: Callable[[Backend], bytes],
        headers: Mapping[str, str],
        client_headers: Mapping[str, str],
        use: Callable[[Backend, http1.Response], Awaitable[T]],
        prompt: Prompt | None = None,
        ticket: Ticket | None = None,
        early: Early | None = None,
    ) -> T:
        """`exchange` with a backend picked from `pool`, its 2xx response given to `use`;
        retried once on another backend when the failure is retryable. `prompt`: the
        request's prompt blocks (proxy.upstream.prefixes), for pools that pick by them.

        A failure is retryable only while the client has had no byte: an error status, or one
        that `use` raises as retryable (a stream that failed before its first event). `path` may
        depend on the backend (ASR servers of two wires in one pool).

        The backend comes from the dispatcher (proxy.upstream.dispatch): with a slot held for
        this request, waiting in `ticket`'s place in the queue while the pool has none free
        (`early`: the one taken while the request was admitted, for its first call).
        """
        trace = CURRENT.get()
        began = time.monotonic()
        backend = await (early.take() if early is not None and not early.used
                         else self.dispatcher.acquire(pool, ticket, prompt=prompt))
        if trace is not None:
            trace.stage("engine slot", began, {"igw.backend": backend.name})
        retried = False
        while True:
            taken_at = time.monotonic()
            sent = {**headers, **backend.forward.select(client_headers), **backend.auth}
            try:
                where = path if isinstance(path, str) else path(backend)
                async with self.exchange(backend, where, body_for(backend), sent) as response:
                    return await use(backend, response)
            except UpstreamFailure as failure:
                if retried or not failure.retryable or self._aborting:  # not while draining
                    raise
                failed = failure
            finally:
                self.dispatcher.release(pool, backend, time.monotonic() - taken_at)
            began = time.monotonic()
            try:
                backend = await self.dispatcher.acquire(pool, ticket, prompt=prompt,
                                                        exclude=backend)
            except GatewayError:
                raise failed from None
            if trace is not None:
                trace.stage("engine slot", began, {"igw.backend": backend.name, "igw.retry": True})
            retried = True

    @asynccontextmanager
    async def exchange(
        self, backend: Backend, path: str, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[http1.Response]:
        """POST `body` to `backend`; yield a 2xx response whose body is still unread.

        The backend counts the request as outstanding until the block exits, and leaving the block
        (normally, by error or by cancellation when the client goes away) closes the upstream
        request, which is the only cancellation signal inference servers understand.
        """
        trace = CURRENT.get()
        spans = trace.spans if trace is not None else None
        stage = None
        sent_at = time.monotonic()
        if trace is not None:
            trace.backend = backend.name
        if spans is not None:  # the engine's spans go under this exchange's
            origin = backend.target(path).origin
            stage = Stage("upstream", sent_at, sent_at, {
                "igw.backend": backend.name, "igw.backend.kind": backend.spec.kind,
                "server.address": origin[1], "server.port": origin[2],
                "http.request.method": "POST"}, span_id=new_span_id(), client=True)
            headers = {**headers, **spans.headers(stage.span_id)}
        backend.outstanding += 1
        name = self.metrics.upstream_started(backend.name)
        try:
            response = await self._post(backend, path, body, headers)
            answered = time.monotonic()
            self.metrics.upstream_answered(name, answered - sent_at)
            if stage is not None:
                if response.connect_s is not None:  # a new connection (else a pooled one)
                    stage.events.append(("connected", sent_at + response.connect_s))
                stage.events.append(("response_headers", answered))
                stage.attrs["http.response.status_code"] = response.status
            self._open.add(response)
            try:
                if response.status >= 400:
                    self._record_status(backend, response.status)
                    raise await _failure_from(backend, response)
                try:
                    yield response
                except GatewayError as exc:
                    if exc.kind in _UPSTREAM_KINDS and not self._aborting:
                        self._failed(backend, "bad_body")  # the body was unusable or broke off
                    raise
                if self._aborting:
                    pass  # cut by our own drain: says nothing about the backend
                elif response.broken is not None:
                    self._failed(backend, "stream_broken")  # the stream broke off or went silent
                else:
                    backend.record_success()
            except BaseException:
                # An unfinished body: drop the connection so the upstream stops generating.
                response.close()
                raise
            finally:
                self._open.discard(response)
                response.release()
        except GatewayError as exc:
            if stage is not None:
                stage.attrs["error.type"] = exc.kind.type
            raise
        finally:
            backend.outstanding -= 1
            self.metrics.upstream_ended(name)
            if stage is not None and spans is not None:
                stage.end = time.monotonic()
                spans.stages.append(stage)

    async def _post(self, backend: Backend, path: str, body: bytes,
                    headers: Mapping[str, str]) -> http1.Response:
        """The request sent and its answer's head read; failures mapped and recorded."""
        try:
            return await self.http.post(backend.target(path), body, headers)
        except http1.ConnectFailed:
            self._failed(backend, "unreachable")
            raise UpstreamFailure(ErrorKind.UPSTREAM_ERROR,
                                  f"backend {backend.name!r} is unreachable",
                                  retryable=True) from None
        except TimeoutError:  # connect or first byte
            self._failed(backend, "timeout")
            raise UpstreamFailure(ErrorKind.UPSTREAM_TIMEOUT,
                                  f"backend {backend.name!r} did not answer in time",
                                  retryable=False) from None
        except http1.Disconnected:
            # Closed or reset before any response byte (a server going down mid-request):
            # nothing reached the client, so another backend may answer it.
            self._failed(backend, "disconnected")
            raise UpstreamFailure(ErrorKind.UPSTREAM_ERROR,
                                  f"backend {backend.name!r} closed the connection",
                                  retryable=True) from None
        except http1.BadResponse:
            self._failed(backend, "bad_response")
            raise UpstreamFailure(ErrorKind.UPSTREAM_ERROR,
                                  f"backend {backend.name!r} sent an unusable response",
                                  retryable=False) from None
        except http1.BadHeader:
            raise GatewayError(ErrorKind.INVALID_REQUEST,
                               "header values must not contain line breaks") from None


async def read_answer(upstream: http1.Response, cap: int) -> bytes:
    """A whole (non-streamed) answer, at most `cap` bytes; failures mapped: a timeout is 504, a
    broken-off body may be retried on another backend (nothing reached the client), an answer
    over the cap is unusable."""
    if upstream.content_length is not None and upstream.content_length > cap:
        raise GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server's answer is too large")
    parts: list[bytes] = []
    size = 0
    try:
        while chunk := await upstream.read_chunk():
            size += len(chunk)
            if size > cap:
                raise GatewayError(ErrorKind.UPSTREAM_ERROR,
                                   "the model server's answer is too large")
            parts.append(chunk)
    except TimeoutError:
        raise GatewayError(ErrorKind.UPSTREAM_TIMEOUT, "the model server did not finish in time")\
            from None
    except (http1.Disconnected, http1.BadResponse):
        raise UpstreamFailure(ErrorKind.UPSTREAM_ERROR, "the model server broke off its answer",
                              retryable=True) from None
    return b"".join(parts)


async def _failure_from(backend: Backend, response: http1.Response) -> UpstreamFailure:
    """Map an upstream error status to ours; keep the upstream's message only for client faults."""
    status = response.status
    try:
        raw = await asyncio.wait_for(response.read(_ERROR_BODY_LIMIT), 5)
    except (http1.Disconnected, http1.BadResponse, TimeoutError):
        raw = b""
    name = backend.name
    if status in (400, 413, 422):
        detail = upstream_message(raw)
        text = f"the model server rejected the request: {detail}" if detail else \
            "the model server rejected the request"
        return UpstreamFailure(ErrorKind.INVALID_REQUEST, text, retryable=False)
    if status in (429, 503):
        retry_after = response.headers.get("Retry-After", "")
        return UpstreamFailure(
            ErrorKind.UNAVAILABLE, f"backend {name!r} is overloaded", retryable=True,
            headers={"Retry-After": retry_after if retry_after.isdigit() else RETRY_AFTER_S},
        )
    if status == 504:
        return UpstreamFailure(ErrorKind.UPSTREAM_TIMEOUT, f"backend {name!r} timed out",
                               retryable=False)
    return UpstreamFailure(ErrorKind.UPSTREAM_ERROR, f"backend {name!r} failed (HTTP {status})",
                           retryable=status in _RETRIED_ERRORS)


def upstream_message(raw: bytes) -> str:
    """The human message inside a TGI, vLLM, OpenAI or Ollama error body, shortened."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return ""
    message: object = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = error.get("message")
        elif isinstance(error, str):
            message = error
        else:
            message = body.get("message")
    if not isinstance(message, str):
        return ""
    return message[:_MESSAGE_LIMIT]
