"""The request lifecycle every inference route runs through (`inference()`).

It records the request for `/_sim/requests`, applies the `x-sim-*` faults, renders errors in
the server's own envelope and turns a client disconnect into the "cancelled" outcome, then
settles the request into the server's counters. Handlers only generate. Media routes opt
into form parsing (`form=True`: multipart uploads, recorded as their fields and file sizes,
never the raw bytes) and into an error envelope of their own (`errors=`).
"""

from __future__ import annotations

import asyncio
import gzip
import math
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import hdrs, web

from proxy.simulators.bodies import form_summary, read_form
from proxy.simulators.errors import (
    ENGINE_DEAD,
    ENGINE_DEAD_TYPE,
    BadRequest,
    ErrorStyle,
    HttpError,
)
from proxy.simulators.exchange import Exchange
from proxy.simulators.faults import (
    ClientGone,
    FaultHeaderError,
    Faults,
    StreamEnded,
    before_response,
    error_response,
    pause,
    tgi_error_type,
)
from proxy.simulators.state import STATE, SimState
from proxy.simulators.textgen import LENGTH

__all__ = ["Handler", "inference"]

Handler = Callable[[Exchange], Awaitable[web.StreamResponse]]


def _simulated(status: int) -> HttpError:
    """The error an `x-sim-status` asks for, worded as faults.error_response words it."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return HttpError(status, f"simulated {status} {phrase}".rstrip())


def _bad_request_response(kind: str, exc: BadRequest) -> web.Response:
    if kind != "tgi":
        if exc.param is None:
            return error_response(kind, 400, exc.message)
        # vLLM's VLLMValidationError names the parameter and its value.
        return error_response(kind, 400, f"{exc.message} (parameter={exc.param}, "
                              f"value={exc.value})", param=exc.param)
    if exc.level == "syntax":
        return web.Response(status=400, text=f"Failed to parse the request body as JSON: {exc}")
    if exc.level == "type":
        text = f"Failed to deserialize the JSON body into the target type: {exc}"
        return web.Response(status=422, text=text)
    return error_response(kind, 422, f"Input validation error: {exc}", "validation")


def inference(
    handler: Handler, *, form: bool = False, errors: ErrorStyle | None = None
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap an inference handler with recording, faults, error rendering and accounting.

    `form`: parse the body as a form into `Exchange.fields` (recorded as a summary);
    `errors`: render this route's errors (faults included) in its own envelope.
    """

    async def route(request: web.Request) -> web.StreamResponse:
        state = request.app[STATE]
        ex = Exchange(request, state)
        ex.errors = errors
        if form:
            ex.record.form = {}  # a form route never shows raw bytes, even before parsing
        state.records.append(ex.record)
        state.in_flight += 1
        state.total += 1
        state.requests += 1
        try:
            return await _run(ex, handler, form)
        except asyncio.CancelledError:
            ex.outcome = "cancelled"
            raise
        finally:
            _settle(state, ex)

    return route


async def _run(ex: Exchange, handler: Handler, form: bool) -> web.StreamResponse:
    kind = ex.state.kind
    try:
        if form:
            ex.fields = await read_form(ex.request)
            ex.record.form = form_summary(ex.fields)
        else:
            ex.record.body = await ex.request.read()
        if ex.state.dead:
            ex.state.close_soon(0)  # vLLM's error handler shuts its server down
            raise HttpError(500, ENGINE_DEAD, ENGINE_DEAD_TYPE)
        ex.faults = Faults.of(ex.request)
        forced = await before_response(ex.request, ex.faults, kind)
        if forced is not None and ex.errors is not None:
            styled = ex.errors(_simulated(forced.status))  # x-sim-status, this route's way
            if (retry := forced.headers.get(hdrs.RETRY_AFTER)) is not None:
                styled.headers[hdrs.RETRY_AFTER] = retry
            forced = styled
        response = forced or await handler(ex)
        if not response.prepared and ex.faults.hang_after == 0:
            await pause(ex.request, math.inf)
    except FaultHeaderError as exc:
        response = web.Response(status=400, text=str(exc))
    except BadRequest as exc:
        if ex.errors is None:
            response = _bad_request_response(kind, exc)
        else:
            response = ex.errors(HttpError(400, exc.message, param=exc.param))
    except HttpError as exc:
        ex.error_type = exc.error_type
        if ex.errors is None:
            response = error_response(kind, exc.status, exc.message, exc.error_type, exc.param)
        else:
            response = ex.errors(exc)
    except StreamEnded as end:
        ex.outcome = end.outcome
        return ex.stream or web.Response()
    except (ClientGone, ConnectionError):
        ex.outcome = "cancelled"
        return ex.stream or web.Response()
    if ex.faults.gzip and isinstance(response, web.Response) and not response.prepared:
        assert isinstance(response.body, bytes)
        response.body = gzip.compress(response.body, compresslevel=1)
        response.headers["Content-Encoding"] = "gzip"
    if response.status >= 400:
        ex.outcome = "error"
        ex.error_type = ex.error_type or tgi_error_type(response.status)
    else:
        ex.outcome = "completed"
    return response


def _settle(state: SimState, ex: Exchange) -> None:
    outcome = ex.record.outcome = ex.outcome or "error"
    state.in_flight -= 1
    if ex.seq is not None:
        state.engine.release(ex.seq)
    if outcome == "completed":
        now = time.monotonic()
        state.latency.e2e.observe(now - ex.started)
        state.latency.ttft.observe((ex.first_token or now) - ex.started)
        if (seq := ex.seq) is not None and seq.first_token < math.inf:
            state.latency.prefill.observe(seq.first_token - seq.prefill_started)
            state.latency.computed.observe(seq.prompt_tokens - seq.cached_tokens)
        state.successes += 1
        state.prompt_tokens[ex.model] += ex.prompt_tokens
        for generation in ex.generations:
            reason = "length" if generation.finish == LENGTH else "stop"
            state.finished[ex.model, reason] += 1
            state.generation_tokens[ex.model] += generation.completion_tokens
    elif outcome == "cancelled":
        state.cancelled += 1
        state.failures["dropped"] += 1
        if ex.model:
            state.finished[ex.model, "abort"] += 1
    elif outcome == "cut":
        state.failures["incomplete"] += 1
    else:
        state.failures[ex.error_type or "generation"] += 1
