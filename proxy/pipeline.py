"""The request path of every chat route, in one function.

    auth (401) -> rate limit (429) -> parse + validate (400/413/422) -> model + tier access
    (404/403) -> credit hold (402) -> route (503) -> translate -> upstream (502/503/504, one retry
    before the first byte) -> relay (JSON, or a stream event by event) -> meter + settle

Each step returns a value or raises `GatewayError`; the error middleware renders it in the route's
style. A rejected request never reaches an upstream.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.appkeys import (
    CONFIG,
    LEDGER,
    LIMITER,
    LIVE,
    REDIS,
    REQUEST_ID,
    RESPONSE_HEADERS,
    ROUTER,
    SETTLEMENTS,
    STYLE,
    UPSTREAMS,
)
from proxy.credits import idempotency
from proxy.credits.meter import ChatMeter, Result, open_chat_meter
from proxy.errors import ErrorKind, GatewayError, store_unavailable, validation_failed
from proxy.http.body import parse_json_object, read_capped
from proxy.outcome import Outcome
from proxy.policy.tiers import check_access, completion_cap, tier_of
from proxy.styles.base import ChatCall, ChatStyle
from proxy.upstream import wire
from proxy.upstream.pool import Pool
from proxy.upstream.relay import relay_stream
from proxy.validate import RequestInvalid

CHAT_UPSTREAM_PATH = "/v1/chat/completions"


def chat_route(style: ChatStyle) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await chat(request, style)

    return handler


async def chat(request: web.Request, style: ChatStyle) -> web.StreamResponse:
    """A chat request in any style, start to finish."""
    app = request.app
    request[STYLE] = style
    snapshot = app[LIVE].current  # one policy version for the whole request

    principal = await snapshot.auth.principal(request.headers, request.remote)
    tier = tier_of(snapshot.policies.tiers, principal.tier)
    admission = await app[LIMITER].admit(principal.tier, tier, principal.account)
    request[RESPONSE_HEADERS] = admission.headers()

    raw = await read_capped(request, app[CONFIG].policies.requests.chat.max_body_bytes)
    call = _parsed(style, parse_json_object(raw))
    pool = app[ROUTER].chat_pool(call.model)  # 404 for an unknown model, before access
    check_access(snapshot.policies.tiers, principal.tier, family="chat", model=call.model,
                 mode="network" if call.mode == "network" else "direct")
    mode = _direct_mode(call)
    limit = completion_cap(tier, principal.tier, call.max_tokens)
    if limit is not None and call.max_tokens is None:
        call.openai_body["max_tokens"] = limit
    if call.async_:
        raise GatewayError(ErrorKind.NOT_IMPLEMENTED, "async chat tasks are not available yet")

    request_id = request[REQUEST_ID]
    remembered = await _idempotency_claim(request, principal.account, style.name, raw)
    if isinstance(remembered, web.Response):
        return remembered  # a retry: the first result again, nothing run, nothing charged
    try:
        meter = await open_chat_meter(app[LEDGER], snapshot.policies.prices, principal, call,
                                      limit, mode, style.name, request_id)  # 402: nothing runs
    except GatewayError:
        if remembered is not None:
            await remembered.release()
        raise
    outcome = Result(captured=[] if remembered else None)
    response: web.StreamResponse | None = None
    try:
        response = await _forward(request, style, call, pool, mode, request_id, outcome)
        return response
    except asyncio.CancelledError:
        outcome.status = Outcome.CLIENT_GONE
        raise
    finally:
        # In its own task, not awaited: the answer goes out without waiting for the ledger, and
        # a client that goes away (cancelling this handler) cannot stop the settlement or the
        # idempotency record. Shutdown waits for these tasks (app.py); a crash leaves the hold
        # to expire and the sweeper releases it.
        done = asyncio.create_task(_close(meter, outcome, remembered, response))
        app[SETTLEMENTS].add(done)
        done.add_done_callback(app[SETTLEMENTS].discard)


async def _close(meter: ChatMeter, outcome: Result, remembered: idempotency.Claim | None,
                 response: web.StreamResponse | None) -> None:
    """Settle exactly once; then keep the result for idempotent retries, or give the key back."""
    await meter.settle(outcome)
    if remembered is None:
        return
    try:
        if response is None or outcome.status != Outcome.COMPLETED:
            await remembered.release()  # nothing charged: a retry runs for real
        elif isinstance(response, web.Response) and isinstance(response.body, bytes):
            await remembered.store(response.status, response.content_type, response.body)
        else:
            await remembered.store(response.status, response.headers["Content-Type"],
                                   b"".join(outcome.captured or ()))
    except RedisError:
        pass  # the claim expires with its TTL


async def _idempotency_claim(request: web.Request, account: str, route: str, raw: bytes
                             ) -> idempotency.Claim | web.Response | None:
    try:
        return await idempotency.claim(request.app[REDIS], account, route, request, raw)
    except RedisError:
        raise store_unavailable("idempotency store") from None


async def _forward(request: web.Request, style: ChatStyle, call: ChatCall, pool: Pool,
                   mode: str, request_id: str, outcome: Result) -> web.StreamResponse:
    """Translate, call the upstream, relay the answer; record the outcome for metering."""
    app = request.app
    task_id = f"{mode}:{uuid.uuid4()}"
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if call.stream else "application/json",
        "X-Request-Id": request_id,
    }
    try:
        async with app[UPSTREAMS].call(
            pool, CHAT_UPSTREAM_PATH,
            lambda backend: wire.upstream_body(call.openai_body, call.stream,
                                                        backend.spec.kind),
            headers, request.headers,
        ) as (backend, upstream):
            if call.stream:
                outcome.chunks = wire.ChunkFilter(backend.spec.kind, call.model,
                                                           call.want_usage)
                response, result = await relay_stream(
                    request, upstream, outcome.chunks, style.encoder(call, task_id),
                    {**request.get(RESPONSE_HEADERS, {}), "X-Request-Id": request_id,
                     "X-Task-Id": task_id},
                    capture=outcome.captured,
                )
                outcome.status = result.outcome
                return response
            completion = await _read_completion(upstream)
    except GatewayError:
        outcome.status = Outcome.UPSTREAM_ERROR
        raise
    completion = wire.fix_response(completion, backend.spec.kind, call.model)
    outcome.status, outcome.usage = Outcome.COMPLETED, completion.get("usage")
    return web.Response(
        body=orjson.dumps(style.response(completion, call, task_id, mode)),
        content_type="application/json", headers={"X-Task-Id": task_id},
    )


def _parsed(style: ChatStyle, body: dict[str, Any]) -> ChatCall:
    try:
        return style.parse(body)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None


def _direct_mode(call: ChatCall) -> str:
    """`auto` and `direct` run on the model's direct pool; no network-mode pools exist yet."""
    if call.mode == "network":
        raise GatewayError(
            ErrorKind.NOT_FOUND, "network mode is not offered for this model; use direct or auto"
        )
    return "direct"


async def _read_completion(upstream: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        raw = await upstream.read()
    except (aiohttp.ServerTimeoutError, TimeoutError):
        raise GatewayError(ErrorKind.UPSTREAM_TIMEOUT, "the model server did not finish in time")\
            from None
    except aiohttp.ClientError:
        raise GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server broke off its answer")\
            from None
    try:
        completion = orjson.loads(raw)
    except orjson.JSONDecodeError:
        completion = None
    if not isinstance(completion, dict) or "error" in completion:
        raise GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server sent an unusable answer")
    return completion
