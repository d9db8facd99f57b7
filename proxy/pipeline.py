"""The request path of every route that runs a model: `chat` (every chat style) and `task`
(speech synthesis, speech recognition, image and video), each in one function.

    auth (401) -> parse + validate (400/413/415/422) -> model (404), its engines' context (422)
    + tier access (403) + the tier's queue budget (503 pool_saturated) -> admission: rate
    limit (429) + credit hold (402), one Redis step -> idempotency (409/replay) -> route (503)
    -> translate -> upstream (502/503/504, one retry on another backend before the client's
    first byte) -> relay (JSON, or a stream event by event) -> meter + settle (queued, once)
    (`async: true`: after admission the request becomes a task, 202; proxy.tasks runs the rest.
    `mode: network`: the request runs on several backends, the answer a quorum agrees on is
    returned with its task address; proxy.tasks.network)

The completion cap the hold assumes (the client's, else the tier's, else `default_max_tokens`)
is what the upstream gets, bounded by the context its engines report (`Pool.context_limit`,
learned in the background by the prober): a request that names no cap fits, one that names
more than the context is refused here.

A request refused before admission is still counted against the caller's rate limit, and its 429
beats its own error (DESIGN §6: every identified attempt counts, the limit is checked first).
Each step returns a value or raises `GatewayError`; the middleware renders it in the route's
style. A rejected request never reaches an upstream, and nothing runs before its hold is placed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy import ids
from proxy.appkeys import (
    ADMITTER,
    CONFIG,
    LEDGER,
    LIVE,
    METRICS,
    REDIS,
    REQUEST_ID,
    RESPONSE_HEADERS,
    ROUTER,
    SETTLER,
    UPSTREAMS,
)
from proxy.config import TierPolicy
from proxy.credits import idempotency
from proxy.credits.admission import Window
from proxy.credits.ledger import InsufficientCredits
from proxy.credits.meter import Meter, Result, Stage, open_chat_meter, open_meter
from proxy.credits.pricing import Units, format_credits, units_cost
from proxy.errors import ErrorKind, GatewayError, store_unavailable, validation_failed
from proxy.families.handlers import Answer, Ctx, Family, Job, TaskResult
from proxy.http.body import parse_json_object, read_capped
from proxy.identity.principal import Principal
from proxy.observe.trace import TRACE
from proxy.outcome import Outcome
from proxy.policy.tiers import check_access, check_queue_budget, completion_cap, tier_of
from proxy.styles import wire
from proxy.styles.base import ChatCall, ChatStyle
from proxy.tasks.network import Agreed, agreed, choose_mode, record
from proxy.tasks.submit import submit
from proxy.upstream import http1
from proxy.upstream.client import UpstreamFailure, read_answer
from proxy.upstream.pool import Backend, Pool
from proxy.upstream.quorum import fingerprint
from proxy.upstream.relay import relay_stream
from proxy.upstream.routing import SESSION_HEADER, prefix_key
from proxy.validate import RequestInvalid

CHAT_UPSTREAM_PATH = "/v1/chat/completions"
COMPLETION_MAX_BYTES = 64 * 1024 * 1024  # a whole chat answer; more is not a completion
# Streams that broke after the 200 went out: the client saw an in-band error event.
_BROKEN_STREAMS = frozenset({Outcome.CUT, Outcome.TIMEOUT, Outcome.FAILED})

log = logging.getLogger("proxy.pipeline")


def task_route(family: Family) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await task(request, family)

    return handler


def chat_route(style: ChatStyle) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await chat(request, style)

    return handler


async def chat(request: web.Request, style: ChatStyle) -> web.StreamResponse:
    """A chat request in any style, start to finish."""
    app = request.app
    snapshot = app[LIVE].current  # one policy version for the whole request
    config = app[CONFIG]
    principal = await snapshot.auth.principal(request.headers, request.remote)
    _traced(request, principal)
    tier = tier_of(snapshot.policies.tiers, principal.tier)
    try:
        raw = await read_capped(request, config.policies.requests.chat.max_body_bytes)
        call = parsed_call(style, parse_json_object(raw))
        mode = choose_mode(app[ROUTER], "chat", call.model, call.mode, stream=call.stream)
        app[ROUTER].require("chat", call.model)  # 404: no such chat model, before access
        request[TRACE].model = call.model
        check_access(snapshot.policies.tiers, principal.tier, family="chat", model=call.model,
                     mode=mode)
        pool = app[ROUTER].pool("chat", call.model, mode)  # 404: not offered in that mode
        _push_back(pool, tier, principal.tier)  # 503 while its engines queue past the budget
        context = pool.context_limit()  # the engines' own limit (read by the prober)
        _check_context(call, context)
        cap = completion_cap(tier, principal.tier, call.max_tokens)
        claim = idempotency.claim_for(principal.account, style.name, request.headers, raw)
    except GatewayError:
        await _count_refused(request, principal, tier)
        raise

    prices = snapshot.policies.prices
    cap = cap or prices.default_max_tokens  # what the hold assumes is what the upstream gets
    if context is not None:
        cap = min(cap, context)  # the engine stops at its context anyway: hold no more
    request_id = request[REQUEST_ID]
    meter = open_chat_meter(prices, principal, call.model, call.openai_body, cap, mode,
                            style.name, request_id)
    result = Result(captured=[] if claim else None)
    response: web.StreamResponse | None = None
    claimed = False
    try:  # entered before the first await that can place a hold or a claim
        if claim is not None:
            replay = await _acquire(request, claim, principal, tier)
            if replay is not None:
                return replay  # the first result again: nothing run, nothing held
            claimed = True  # ours from here, whatever happens to this request
        request[RESPONSE_HEADERS] = (await _admit(request, meter.meter, tier)).headers()
        if call.async_:  # the hold goes with the task; a worker runs it (proxy.tasks)
            return await submit(request, meter.meter, route=f"chat:{style.name}", body=raw,
                                task_id=ids.task_id(mode), mode=mode, cap=cap)
        if mode == "network":  # on several backends, the answer a quorum agrees on
            response = await _network_chat(request, style, call, cap, pool, result,
                                           principal.account)
        else:
            response = await _forward(request, style, call, cap, pool, mode, request_id,
                                      result)
        return response
    except asyncio.CancelledError:
        result.status = Outcome.CLIENT_GONE
        raise
    finally:
        if result.status in _BROKEN_STREAMS and response is not None:
            log.warning("stream on %s ended %s after %d content chunk(s) (request %s)",
                        request.path, result.status, result.chunks.chunks if result.chunks else 0,
                        request_id)
        meter.settle(app[SETTLER], app[LEDGER].settle_script, result)
        _settled(request, meter.meter)
        if claimed and claim is not None:
            _keep_or_release(request, claim, result, response)


async def task(request: web.Request, family: Family) -> web.StreamResponse:
    """A speech, transcription, image or video request, start to finish: the chat path's order
    (auth, parse, model, access, admission: limit + hold of the worst case), then the family
    runs it (proxy.families.handlers) and the settlement charges the units it used."""
    app = request.app
    snapshot = app[LIVE].current
    policies = snapshot.policies
    principal = await snapshot.auth.principal(request.headers, request.remote)
    _traced(request, principal)
    tier = tier_of(policies.tiers, principal.tier)
    try:
        body = await family.read(request, policies)
        job = family.parse(body, policies, request.match_info)
        model = family.model(job, policies)  # None: a provider's pool names it
        mode = choose_mode(app[ROUTER], family.name, model, job.mode) if model else (
            "network" if job.mode == "network" else "direct")
        if model is not None:
            app[ROUTER].require(family.name, model)  # 404: no such model, before access
            check_access(policies.tiers, principal.tier, family=family.name, model=model,
                         mode=mode)
        pool = family.pool(app[ROUTER], job, policies, mode)  # 404 (not in that mode)
        request[TRACE].model = pool.model
        if model is None:
            check_access(policies.tiers, principal.tier, family=family.name, model=pool.model,
                         mode=mode)
        _push_back(pool, tier, principal.tier)
    except GatewayError:
        await _count_refused(request, principal, tier)
        raise

    rates = policies.prices.for_model(pool.model, mode)
    meter = open_meter(policies.prices, principal, pool.model, mode, family.name,
                       request[REQUEST_ID], units_cost(rates, job.worst))
    result = TaskResult()
    try:  # entered before the first await that can place a hold
        request[RESPONSE_HEADERS] = (await _admit(request, meter, tier)).headers()
        if job.async_:  # the hold goes with the task; a worker runs it (proxy.tasks)
            return await submit(request, meter, route=family.name, body=orjson.dumps(body),
                                task_id=ids.task_id(mode), mode=mode)
        if mode == "network":
            return await _network_task(request, family, job, pool, result, meter.principal)
        return await family.run(request, job, pool, result)
    except asyncio.CancelledError:
        result.status = Outcome.CLIENT_GONE
        raise
    finally:
        if result.status not in (Outcome.COMPLETED, Outcome.CLIENT_GONE):
            result.used = Units()  # failed before the answer went out: nothing to charge
        meter.charge(app[SETTLER], app[LEDGER].settle_script, result.status,
                     units_cost(rates, result.used), result.used.counts(), {})
        _settled(request, meter)


def _traced(request: web.Request, principal: Principal) -> None:
    trace = request[TRACE]
    trace.tier = principal.tier
    if principal.kind != "guest":
        trace.account = principal.account


def _settled(request: web.Request, meter: Meter) -> None:
    """What the settlement charges, on the request's trace and in the metrics."""
    if meter.charged is None:
        return
    trace = request[TRACE]
    trace.cost, trace.units = meter.charged
    request.app[METRICS].settled(meter.model, meter.principal.tier, *meter.charged)


def _push_back(pool: Pool, tier: TierPolicy, tier_name: str) -> None:
    """The tier's queue budget against the engines' own queues (their fresh figures only)."""
    if tier.queue_budget is None:
        return
    saturation = pool.saturation(time.time())
    if saturation is not None:
        check_queue_budget(tier, tier_name, pool.model, saturation.waiting_per_replica,
                           saturation.retry_after_s)


async def _count_refused(request: web.Request, principal: Principal, tier: TierPolicy) -> None:
    """Count a request refused before admission; a 429 replaces its own error, an unreachable
    store does not (the client's own fault is the better answer then)."""
    try:
        window = await request.app[ADMITTER].count(principal, principal.tier, tier)
    except GatewayError as exc:
        if exc.kind is ErrorKind.RATE_LIMITED:
            raise
        return
    request[RESPONSE_HEADERS] = window.headers()


async def _admit(request: web.Request, meter: Meter, tier: TierPolicy) -> Window:
    principal = meter.principal
    meter.stage = Stage.ADMITTING
    try:
        window = await request.app[ADMITTER].admit(principal, principal.tier, tier, meter.hold)
    except InsufficientCredits as exc:
        meter.stage = Stage.REFUSED
        raise GatewayError(
            ErrorKind.INSUFFICIENT_CREDITS,
            f"this request may cost up to {format_credits(exc.needed)} credits and "
            f"{format_credits(exc.available)} are available",
        ) from None
    except GatewayError as exc:
        if exc.kind is not ErrorKind.UNAVAILABLE:  # 429: refused for sure; 503: unknown
            meter.stage = Stage.REFUSED
        raise
    meter.stage = Stage.ADMITTED
    return window


async def _acquire(request: web.Request, claim: idempotency.Claim, principal: Principal,
                   tier: TierPolicy) -> web.Response | None:
    """Claim the Idempotency-Key before anything is held. A replay, a duplicate still running
    (409) or a key reused for another body (422) is counted like any refused request."""
    pending_ttl = int(request.app[CONFIG].upstream.longest_request_s) + 60
    try:
        replay = await claim.acquire(request.app[REDIS], pending_ttl)
    except RedisError:
        raise store_unavailable("idempotency store") from None
    except GatewayError:
        await _count_refused(request, principal, tier)
        raise
    if replay is not None:
        await _count_refused(request, principal, tier)
    return replay


def _keep_or_release(request: web.Request, claim: idempotency.Claim, result: Result,
                     response: web.StreamResponse | None) -> None:
    """Queued after the settlement: keep a completed result for retries, else give the key
    back (nothing was charged, so a retry runs for real)."""
    settler = request.app[SETTLER]
    if response is None or result.status != Outcome.COMPLETED:
        settler.add(claim.key, claim.release())
    elif isinstance(response, web.Response) and isinstance(response.body, bytes):
        settler.add(claim.key, claim.store(response.status, response.content_type,
                                           response.body))
    else:
        settler.add(claim.key, claim.store(response.status, response.headers["Content-Type"],
                                           b"".join(result.captured or ())))


async def _forward(request: web.Request, style: ChatStyle, call: ChatCall, cap: int, pool: Pool,
                   mode: str, request_id: str, result: Result) -> web.StreamResponse:
    """Translate, call the upstream, relay the answer; record the outcome for metering."""
    app = request.app
    task_id = ids.task_id(mode)
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if call.stream else "application/json",
        "X-Request-Id": request_id,
    }
    reply_headers = {**request.get(RESPONSE_HEADERS, {}), "X-Request-Id": request_id,
                     "X-Task-Id": task_id}
    result.status = Outcome.UPSTREAM_ERROR  # until an answer is delivered

    def body_for(backend: Backend) -> bytes:
        return wire.upstream_body(call.openai_body, call.stream, backend.spec.kind, cap)

    async def relay(backend: Backend, upstream: http1.Response) -> web.StreamResponse:
        if not call.stream:
            return await _complete(request, style, call, backend, upstream, task_id, mode,
                                   reply_headers, result)
        result.chunks = wire.ChunkFilter(backend.spec.kind, call.model, call.want_usage)
        try:
            response, stream = await relay_stream(
                request, upstream, result.chunks, style.encoder(call, task_id), reply_headers,
                capture=result.captured, max_s=app[CONFIG].upstream.max_stream_s,
            )
        except UpstreamFailure:
            result.chunks = None  # nothing reached the client: nothing to charge
            raise
        result.status = request[TRACE].outcome = stream.outcome
        return response

    return await app[UPSTREAMS].call(pool, CHAT_UPSTREAM_PATH, body_for, headers,
                                     request.headers, relay,
                                     affinity(pool, call, request.headers))


async def _complete(request: web.Request, style: ChatStyle, call: ChatCall, backend: Backend,
                    upstream: http1.Response, task_id: str, mode: str,
                    reply_headers: dict[str, str], result: Result) -> web.Response:
    """A whole (non-streamed) answer, read, rendered in the style and sent."""
    body, usage = await _rendered(style, call, backend, upstream, task_id, mode)
    response = web.Response(body=body, content_type="application/json", headers=reply_headers)
    result.status = Outcome.CLIENT_GONE  # until the answer is out
    await response.prepare(request)
    await response.write_eof()
    result.status, result.usage = Outcome.COMPLETED, usage
    return response


async def complete_chat(ctx: Ctx, style: ChatStyle, call: ChatCall, cap: int, pool: Pool,
                        mode: str, task_id: str) -> tuple[bytes, dict[str, Any] | None]:
    """A whole chat answer without a client connection (an async task): the rendered body and
    the upstream's usage."""
    completion = await fetch_completion(ctx, call, cap, pool)
    return orjson.dumps(style.response(completion, call, task_id, mode)), completion.get("usage")


async def _rendered(style: ChatStyle, call: ChatCall, backend: Backend,
                    upstream: http1.Response, task_id: str, mode: str
                    ) -> tuple[bytes, dict[str, Any] | None]:
    completion = wire.fix_response(await _read_completion(upstream), backend.spec.kind,
                                   call.model)
    body = orjson.dumps(style.response(completion, call, task_id, mode))  # may refuse: 502
    return body, completion.get("usage")


async def _network_chat(request: web.Request, style: ChatStyle, call: ChatCall, cap: int,
                        pool: Pool, result: Result, account: str) -> web.Response:
    """Network mode: the completion a quorum of replicas agrees on, with its task address."""
    app, ctx = request.app, Ctx.of(request)
    seed = app[LIVE].current.policies.requests.network.seed
    result.status = Outcome.UPSTREAM_ERROR  # until an answer is delivered
    done = await agreed(app, pool, lambda one: fetch_completion(ctx, call, cap, one, seed),
                        fingerprint, ctx.request_id)
    task_id = ids.task_id("network")
    rendered = style.response(done.answer, call, task_id, "network")
    rendered["task_address"] = done.address
    await _record(request, account, done, rendered)
    result.usage = done.answer.get("usage")
    return await _send_whole(request, orjson.dumps(rendered), "application/json", result, {
        "X-Task-Id": task_id, "X-Task-Address": done.address})


async def _network_task(request: web.Request, family: Family, job: Job, pool: Pool,
                        result: TaskResult, principal: Principal) -> web.Response:
    """Network mode for a task family (speech, so far): the audio a quorum agrees on."""
    app, ctx = request.app, Ctx.of(request)
    result.status = Outcome.UPSTREAM_ERROR
    done = await agreed(app, pool, lambda one: family.produce(ctx, job, one),
                        lambda answer: fingerprint(answer.body), ctx.request_id)
    answer: Answer = done.answer
    await _record(request, principal.account, done, {"content_type": answer.content_type,
                                                     "bytes": len(answer.body)})
    result.used = answer.used
    return await _send_whole(request, answer.body, answer.content_type, result, {
        **answer.headers, "X-Task-Id": ids.task_id("network"), "X-Task-Address": done.address})


async def _record(request: web.Request, account: str, done: Agreed, result: Any) -> None:
    try:
        await record(request.app, account, done, result)
    except RedisError:  # the answer stands; only its record is missing
        log.warning("network-mode run %s could not be recorded (request %s)", done.address,
                    request[REQUEST_ID])


async def _send_whole(request: web.Request, body: bytes, content_type: str,
                      result: Result | TaskResult, headers: dict[str, str]) -> web.Response:
    response = web.Response(body=body, headers={
        **request.get(RESPONSE_HEADERS, {}), "X-Request-Id": request[REQUEST_ID], **headers,
        "Content-Type": content_type})
    result.status = Outcome.CLIENT_GONE  # until the answer is out
    await response.prepare(request)
    await response.write_eof()
    result.status = Outcome.COMPLETED
    return response


async def fetch_completion(ctx: Ctx, call: ChatCall, cap: int, pool: Pool,
                           seed: int | None = None) -> dict[str, Any]:
    """One whole completion from `pool` as OpenAI shapes it (the backend's dialect fixed);
    `seed` sent unless the client set one (network mode's replicas must sample alike)."""
    body = call.openai_body if seed is None or "seed" in call.openai_body else {
        **call.openai_body, "seed": seed}
    headers = {"Content-Type": "application/json", "Accept": "application/json",
               "X-Request-Id": ctx.request_id}

    async def use(backend: Backend, upstream: http1.Response) -> dict[str, Any]:
        return wire.fix_response(await _read_completion(upstream), backend.spec.kind,
                                 call.model)

    return await ctx.app[UPSTREAMS].call(
        pool, CHAT_UPSTREAM_PATH,
        lambda backend: wire.upstream_body(body, False, backend.spec.kind, cap), headers,
        ctx.client_headers, use, affinity(pool, call, ctx.client_headers))


def affinity(pool: Pool, call: ChatCall, headers: Mapping[str, str]) -> bytes | None:
    """The prefix a "prefix" pool keeps on one replica (hashed only where it is used)."""
    if pool.pick_kind != "prefix":
        return None
    return prefix_key(call.openai_body, headers.get(SESSION_HEADER))


def parsed_call(style: ChatStyle, body: dict[str, Any]) -> ChatCall:
    try:
        return style.parse(body)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None


def _check_context(call: ChatCall, context: int | None) -> None:
    """422 for a cap no engine of the pool can give: prompt and completion share its context
    (vLLM refuses it with a 400; better refused here, before anything is held)."""
    if context is not None and call.max_tokens is not None and call.max_tokens > context:
        raise validation_failed([{
            "loc": list(call.cap_loc), "type": "less_than_equal",
            "msg": f"Input should be less than or equal to {context}, the model's context "
                   f"length (prompt and completion together)",
        }])


async def _read_completion(upstream: http1.Response) -> dict[str, Any]:
    raw = await read_answer(upstream, COMPLETION_MAX_BYTES)
    try:
        completion = orjson.loads(raw)
    except orjson.JSONDecodeError:
        completion = None
    if not isinstance(completion, dict) or "error" in completion:
        raise GatewayError(ErrorKind.UPSTREAM_ERROR, "the model server sent an unusable answer")
    return completion
