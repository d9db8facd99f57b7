"""The one middleware: a request id, header-name hygiene, the drain gate, every error in the
documented shape, and each request's trace, metrics and access-log line (proxy.observe)."""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.typedefs import Handler
from redis.exceptions import RedisClusterException, RedisError

from proxy.appkeys import (
    ACCESS_LOG,
    DRAIN,
    METRICS,
    REQUEST_ID,
    RESPONSE_HEADERS,
    ROUTE_STYLES,
    SHADOW,
    STYLE,
    TALLY,
    TRACING,
)
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.headers import request_id_from
from proxy.ids import hex_id
from proxy.observe.trace import CURRENT, TRACE, Trace
from proxy.policy.shadowing import SHADOWED

log = logging.getLogger("proxy")

_HTTP_KINDS = {
    404: ErrorKind.NOT_FOUND,
    405: ErrorKind.METHOD_NOT_ALLOWED,
    413: ErrorKind.PAYLOAD_TOO_LARGE,
    415: ErrorKind.UNSUPPORTED_MEDIA_TYPE,
}
# Answered while draining: the load balancer and Prometheus must keep seeing them. Polled every
# few seconds, they are counted in the metrics but not access-logged.
_ALWAYS_SERVED = frozenset({"/healthz", "/readyz", "/metrics"})
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before its answer


@web.middleware
async def gateway_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request_id_from(request.headers.get("X-Request-Id"), hex_id())
    request[REQUEST_ID] = request_id
    resource = request.match_info.route.resource
    trace = Trace(resource.canonical if resource is not None else "unmatched")
    request[TRACE] = trace
    logged = request.path not in _ALWAYS_SERVED
    tracing = request.app[TRACING] if logged else None
    if tracing is not None:
        trace.spans = tracing.begin(request.headers)
    context = CURRENT.set(trace)
    metrics = request.app[METRICS]
    metrics.started(trace.route)
    status = CLIENT_CLOSED  # unless an answer is made: the handler was cancelled
    try:
        response = await _answer(request, handler, request_id, trace)
        status = response.status
        return response
    finally:
        CURRENT.reset(context)
        if tracing is not None:
            tracing.finish(trace, status, request.method)
        metrics.answered(trace, status)
        if logged:
            request.app[TALLY].note(trace, status, request_id)
            _log(request, trace, status, request_id)


def _log(request: web.Request, trace: Trace, status: int, request_id: str) -> None:
    """The request's access-log line; a request shadow policies judge gets it with their
    verdict, a moment later (proxy.policy.shadowing)."""
    access_log = request.app[ACCESS_LOG]
    line = access_log.line(request, trace, status, request_id)
    shadowed = request.get(SHADOWED)
    if shadowed is not None and request.app[SHADOW].judge(shadowed, trace, status, line):
        return
    if line is not None:
        access_log.put(line)


async def _answer(request: web.Request, handler: Handler, request_id: str,
                  trace: Trace) -> web.StreamResponse:
    style = request.app[ROUTE_STYLES].get(request.match_info.handler)
    if style is not None:  # errors in the route's own shape, from here on
        request[STYLE] = style
    drain = request.app[DRAIN]
    counted = request.path not in _ALWAYS_SERVED
    try:
        if _underscore_in_header_names(request):
            # Envoy's edge rule (reliability.md I5): `X_Api_Key` and `X-Api-Key` must never
            # be two spellings of one header to some server behind us.
            raise GatewayError(ErrorKind.INVALID_REQUEST,
                               "header names must not contain underscores")
        if counted:
            if drain.draining:
                raise GatewayError(ErrorKind.UNAVAILABLE,
                                   "the gateway is shutting down; retry shortly",
                                   headers={"Retry-After": "1", "Connection": "close"})
            drain.enter()
        try:
            response = await handler(request)
        finally:
            if counted:
                drain.leave()
    except GatewayError as exc:
        response = error_response(request, exc)
        trace.error = exc.kind.type
        if exc.store is not None:
            request.app[METRICS].redis_errors.labels(exc.store).inc()
        if exc.status >= 500:  # the operator's business: upstream failures, outages
            log.warning("%s %s -> %d %s (request %s)", request.method, request.path,
                        exc.status, exc.kind.type, request_id)
    except (RedisError, RedisClusterException):
        # A store failure no step handled itself (e.g. mid-failover of a Cluster): the store's
        # trouble, not ours: 503, never a 500.
        error = store_unavailable("state store")
        response = error_response(request, error)
        trace.error = error.kind.type
        request.app[METRICS].redis_errors.labels("state store").inc()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = _HTTP_KINDS.get(exc.status, ErrorKind.INVALID_REQUEST)
        message = "no such route" if exc.status == 404 else exc.reason
        response = error_response(request, GatewayError(kind, message))
        trace.error = kind.type
        if exc.status == 405:
            response.headers["Allow"] = exc.headers.get("Allow", "")
    except Exception:
        # Our bug, not the client's: log it here, never send its text.
        log.exception("unhandled error", extra={"request_id": request_id})
        response = error_response(request, GatewayError(ErrorKind.INTERNAL_ERROR, "internal error"))
        trace.error = ErrorKind.INTERNAL_ERROR.type
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
        extra = request.get(RESPONSE_HEADERS)
        if extra:
            response.headers.update(extra)
    return response


def error_response(request: web.Request, error: GatewayError) -> web.Response:
    """The error in the route's own style (OpenAI/FastAPI, Anthropic, Ollama)."""
    style = request.get(STYLE)
    body = style.error_body(error) if style is not None else error.json()
    response = web.Response(
        status=error.status, body=body, content_type="application/json", headers=error.headers,
    )
    if error.headers.get("Connection") == "close":
        response.force_close()  # the header alone does not make aiohttp close the connection
    return response


def _underscore_in_header_names(request: web.Request) -> bool:
    return any(b"_" in name for name, _ in request.raw_headers)
