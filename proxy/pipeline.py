"""The request path of every route that runs a model: `chat` (every chat style) and `task`
(speech synthesis, speech recognition, image, video and embeddings), each in one function; and
`queued`, the same path's second half for an async task, run by whichever worker takes it.

    auth (401) -> parse + validate (400/413/415/422) -> model (404), its engines' context (422)
    + tier access (403) + the tier's queue budget (503 pool_saturated) -> admission: rate
    limit (429) + credit hold (402), one Redis step -> idempotency (409/replay) -> route (503)
    -> translate -> upstream (502/503/504, one retry on another backend before the client's
    first byte) -> relay (JSON, or a stream event by event) -> meter + settle (queued, once)
    (`async: true`: after admission the request becomes a task, 202; proxy.tasks runs the rest.
    `mode: network`: the request runs on several backends, the answer a quorum agrees on is
    returned with its task address; proxy.tasks.network)

Each entry point takes one policy snapshot (`app[LIVE].current`) and everything below reads
that snapshot (`Ctx.policies`), never the live one again: a reload mid-request changes nothing
for it. The request's money is one `Meter` (proxy.credits.meter): opened with the worst case,
admitted, then settled once from the one `Result` the path fills in.

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
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy import ids
from proxy.appkeys import (
    CONFIG,
    FETCHER,
    KEEPER,
    LIVE,
    MEDIA,
    METERING,
    REDIS,
    REQUEST_ID,
    RESPONSE_HEADERS,
    ROUTER,
    SETTLER,
    TALLY,
    TASKS,
    TRACING,
    UPSTREAMS,
)
from proxy.blobs.base import StoreFailed
from proxy.blobs.media import send_stored
from proxy.config import Policies, TierPolicy
from proxy.credits import idempotency
from proxy.credits.admission import Window
from proxy.credits.meter import Meter, Result
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.families import chat as chat_family
from proxy.families.base import Ctx, Family
from proxy.http.body import parse_json_object, read_capped
from proxy.identity.principal import Principal
from proxy.observe.trace import CURRENT, OPERATIONS, TRACE, Trace
from proxy.outcome import Outcome
from proxy.policy.live import PolicySnapshot
from proxy.policy.shadowing import SHADOWED, Shadowed
from proxy.policy.tiers import check_access, check_queue_budget, completion_cap, tier_of
from proxy.styles.base import ChatStyle
from proxy.tasks.network import choose_mode, network_answer, network_chat
from proxy.tasks.run import Runnable, run_task
from proxy.tasks.submit import submit
from proxy.upstream.early import Early
from proxy.upstream.pool import Pool
from proxy.upstream.queue import ticket_for
from proxy.upstream.relay import send_whole

# Streams that broke after the 200 went out: the client saw an in-band error event.
_BROKEN_STREAMS = frozenset({Outcome.CUT, Outcome.TIMEOUT, Outcome.FAILED})

log = logging.getLogger("proxy.pipeline")


def chat_route(style: ChatStyle) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await chat(request, style)

    return handler


def task_route(family: Family) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await task(request, family)

    return handler


async def chat(request: web.Request, style: ChatStyle) -> web.StreamResponse:
    """A chat request in any style, start to finish."""
    app = request.app
    snapshot = app[LIVE].current  # one policy version for the whole request
    policies = snapshot.policies
    began = time.monotonic()
    principal = await snapshot.auth.principal(request.headers, request.remote)
    _traced(request, snapshot, principal, began, "chat")
    tier = tier_of(policies.tiers, principal.tier)
    router = app[ROUTER]
    try:
        raw = await read_capped(request, policies.requests.chat.max_body_bytes)
        body = parse_json_object(raw)
        call = chat_family.parsed_call(style, body)
        # Media inline only, bounded (422/413): nothing a client names is fetched upstream.
        chat_family.check_media(call, policies.requests.chat,
                                exact=style.name in ("openai", "served"))
        mode = choose_mode(router, "chat", call.model, call.mode, stream=call.stream)
        router.require("chat", call.model)  # 404: no such chat model, before access
        trace = request[TRACE]
        trace.model, trace.mode, trace.asked_tokens = call.model, mode, call.max_tokens
        check_access(policies.tiers, principal.tier, family="chat", model=call.model, mode=mode)
        pool = router.pool("chat", call.model, mode)  # 404: not offered in that mode
        _push_back(request, pool, tier, principal.tier)  # 503: its engines queue past budget
        context = pool.context_limit()  # the engines' own limit (read by the prober)
        chat_family.check_context(call, context)
        cap = completion_cap(tier, principal.tier, call.max_tokens)
        claim = idempotency.claim_for(principal.account, style.name, request.headers, body)
    except GatewayError:
        await _count_refused(request, principal, tier)
        raise

    cap = cap or policies.prices.default_max_tokens  # what the hold assumes, the upstream gets
    if context is not None:
        cap = min(cap, context)  # the engine stops at its context anyway: hold no more
    ctx = _ctx(request, policies, principal)
    meter = app[METERING].chat(policies.prices, principal, call.model, mode, style.name,
                               ctx.request_id, call.openai_body, cap,
                               snapshot.token_windows.of(principal.tier, tier,
                                                         policies.tiers.group_of(call.model)))
    result = Result(captured=[] if claim else None)
    response: web.StreamResponse | None = None
    claimed = False
    dispatcher = app[UPSTREAMS].dispatcher
    early: Early | None = None
    try:  # entered before the first await that can place a hold or a claim
        replay = await _acquire(request, claim, principal, tier)
        if replay is not None:
            return replay  # the first result again: nothing run, nothing held
        claimed = claim is not None  # ours from here, whatever happens to this request
        if mode == "direct" and not call.async_:  # its slot's round trip beside admission's
            early = dispatcher.start(pool, ctx.ticket,
                                     chat_family.affinity(pool, call, request.headers))
        request[RESPONSE_HEADERS] = (await _admit(request, meter, tier)).headers(style.name)
        task_id = ids.task_id(mode)
        if call.async_:  # the hold goes with the task; a worker runs it (proxy.tasks)
            response = await submit(ctx, app[TASKS], meter, route=f"chat:{style.name}",
                                    body=raw, params={}, task_id=task_id, mode=mode, cap=cap)
            return response
        result.status = Outcome.UPSTREAM_ERROR  # until an answer is delivered
        headers = _reply_headers(request, task_id)
        if mode == "network":  # on several backends, the answer a quorum agrees on
            rendered, usage, address = await network_chat(ctx, app[TASKS], principal.account,
                                                          style, call, cap, pool, task_id)
            result.answered(usage=usage)
            response = await send_whole(request, web.Response(
                body=orjson.dumps(rendered), headers={
                    **headers, "X-Task-Address": address, "Content-Type": "application/json"}),
                result)
        else:
            response = await chat_family.forward(request, ctx, style, call, cap, pool, mode,
                                                 task_id, headers, result, early)
            if call.stream:
                request[TRACE].outcome = result.status
        return response
    except GatewayError as exc:
        result.failed(exc)
        raise
    except asyncio.CancelledError:
        result.status = Outcome.CLIENT_GONE
        raise
    finally:
        if call.stream and result.status in _BROKEN_STREAMS and response is not None:
            log.warning("stream on %s ended %s after %d content chunk(s) (request %s)",
                        request.path, result.status, result.tally.chunks if result.tally else 0,
                        ctx.request_id)
        dispatcher.forget(early)  # a slot taken early and never used goes back
        meter.settle_on(request[TRACE], result)
        if claimed and claim is not None:
            _keep_or_release(request, claim, result, response, policies)


async def task(request: web.Request, family: Family) -> web.StreamResponse:
    """A speech, transcription, image, video or embeddings request, start to finish: the chat
    path's order (auth, parse, model, access, admission: limit + hold of the worst case, input
    tokens in the token limits), then the family runs it (proxy.families) and the settlement
    charges the units it used."""
    app = request.app
    snapshot = app[LIVE].current  # one policy version for the whole request
    policies = snapshot.policies
    began = time.monotonic()
    principal = await snapshot.auth.principal(request.headers, request.remote)
    _traced(request, snapshot, principal, began, family.name)
    tier = tier_of(policies.tiers, principal.tier)
    router = app[ROUTER]
    try:
        body = await family.read(request, policies)
        job = family.parse(body, policies, request.match_info)
        model = family.model(job, policies)  # None: a provider's pool names it
        mode = choose_mode(router, family.name, model, job.mode) if model else (
            "network" if job.mode == "network" else "direct")
        if model is not None:
            router.require(family.name, model)  # 404: no such model, before access
            check_access(policies.tiers, principal.tier, family=family.name, model=model,
                         mode=mode)
        pool = family.pool(router, job, policies, mode)  # 404 (not in that mode)
        request[TRACE].model, request[TRACE].mode = pool.model, mode
        if model is None:
            check_access(policies.tiers, principal.tier, family=family.name, model=pool.model,
                         mode=mode)
        _push_back(request, pool, tier, principal.tier)
        claim = idempotency.claim_for(principal.account, request.path, request.headers, body)
    except GatewayError:
        await _count_refused(request, principal, tier)
        raise

    ctx = _ctx(request, policies, principal)
    # Only a request that counts tokens (embeddings) looks up the token windows it counts in.
    windows = snapshot.token_windows.of(principal.tier, tier, policies.tiers.group_of(
        pool.model)) if job.worst.prompt_tokens else ()
    meter = app[METERING].units(policies.prices, principal, pool.model, mode, family.name,
                                ctx.request_id, job.worst, windows)
    result = Result()
    response: web.StreamResponse | None = None
    claimed = False
    dispatcher = app[UPSTREAMS].dispatcher
    early: Early | None = None
    try:  # entered before the first await that can place a hold or a claim
        replay = await _acquire(request, claim, principal, tier)
        if replay is not None:
            return replay  # the first result again: nothing run, nothing held
        claimed = claim is not None  # ours from here, whatever happens to this request
        if mode == "direct" and not job.async_ and family.early_slot(job):
            early = dispatcher.start(pool, ctx.ticket, None)  # beside admission's round trip
            ctx = dataclasses.replace(ctx, early=early)
        request[RESPONSE_HEADERS] = (await _admit(request, meter, tier)).headers()
        task_id = ids.task_id(mode)
        if job.async_:  # the hold goes with the task; a worker runs it (proxy.tasks)
            response = await submit(ctx, app[TASKS], meter, route=family.name,
                                    body=orjson.dumps(body), params=dict(request.match_info),
                                    task_id=task_id, mode=mode, media=app[MEDIA])
            return response
        result.status = Outcome.UPSTREAM_ERROR  # until an answer is delivered
        headers = _reply_headers(request, task_id)
        if mode == "network":  # speech, so far: the audio a quorum agrees on
            answer = await network_answer(
                ctx, app[TASKS], principal.account, family, job, pool,
                lambda answer: {"content_type": answer.content_type, "bytes": len(answer.body)})
            result.answered(used=answer.used)
            response = await send_whole(request, web.Response(body=answer.body, headers={
                **headers, **answer.headers, "Content-Type": answer.content_type}), result)
        else:
            response = await family.run(request, ctx, job, pool, result, headers)
        return response
    except GatewayError as exc:
        result.failed(exc)
        raise
    except asyncio.CancelledError:
        result.status = Outcome.CLIENT_GONE
        raise
    finally:
        dispatcher.forget(early)  # a slot taken early and never used goes back
        meter.settle_on(request[TRACE], result)
        if claimed and claim is not None:
            _keep_or_release(request, claim, result, response, policies)


async def queued(app: web.Application, routes: Mapping[str, Runnable], account: str,
                 task_id: str) -> None:
    """An async task, run by the worker that took it from the queue: the request path after
    admission, under the policies in force now (proxy.tasks.run)."""
    store = app[TASKS]
    found = await store.spec(account, task_id)
    if found is None or found[0] != "running":
        return  # expired, or another worker ended it
    spec = found[1]
    policies = app[LIVE].current.policies
    ctx = Ctx(policies, app[ROUTER], app[UPSTREAMS], app[FETCHER], spec.request_id,
              spec.headers, ticket_for(spec.tier, policies.tiers.tiers, spec.account))
    # Its own trace, linked to the request that submitted it (a run may come hours later).
    trace = Trace(f"task {spec.route}", tier=spec.tier, model=spec.model,
                  account=None if spec.kind == "guest" else spec.account,
                  operation=OPERATIONS.get(spec.route.partition(":")[0]))
    tracing = app[TRACING]
    if tracing is not None:
        trace.spans = tracing.begin({})
        tracing.link(trace.spans, spec.traceparent)
    context = CURRENT.set(trace)
    status = 499  # cancelled: the worker stopped under it
    try:
        status = await run_task(ctx, store, app[MEDIA], app[METERING], spec,
                                routes.get(spec.route))
    finally:
        CURRENT.reset(context)
        if tracing is not None:
            tracing.finish(trace, status, None)
        app[TALLY].note(trace, status, spec.request_id)  # its charge, in the console's spend


def _ctx(request: web.Request, policies: Policies, principal: Principal) -> Ctx:
    app = request.app
    return Ctx(policies, app[ROUTER], app[UPSTREAMS], app[FETCHER], request[REQUEST_ID],
               request.headers, ticket_for(principal.tier, policies.tiers.tiers,
                                           principal.account))


def _traced(request: web.Request, snapshot: PolicySnapshot, principal: Principal, began: float,
            family: str) -> None:
    """Who is calling and for what, on the request's trace; the auth step (from `began`)
    timed. With shadow policies, the request is one they judge once it has ended."""
    if snapshot.shadow is not None:
        request[SHADOWED] = Shadowed(snapshot.shadow, principal)
    trace = request[TRACE]
    trace.stage("auth", began)
    trace.operation = OPERATIONS.get(family)
    trace.family = family
    trace.tier = principal.tier
    if principal.kind != "guest":
        trace.account = principal.account


async def _admit(request: web.Request, meter: Meter, tier: TierPolicy) -> Window:
    """Admission (rate and token limits + the hold: one Redis step), timed on the trace."""
    began = time.monotonic()
    trace = request[TRACE]
    try:
        window = await meter.admit(tier)
    finally:
        trace.stage("admission", began)
    trace.admitted = True
    return window


def _reply_headers(request: web.Request, task_id: str) -> dict[str, str]:
    """Sent with the answer (which goes out before the middleware sees it)."""
    return {**request.get(RESPONSE_HEADERS, {}), "X-Request-Id": request[REQUEST_ID],
            "X-Task-Id": task_id}


def _push_back(request: web.Request, pool: Pool, tier: TierPolicy, tier_name: str) -> None:
    """The tier's queue budget against the engines' own queues (their fresh figures only;
    kept on the trace for a shadow policy's budget)."""
    if tier.queue_budget is None and SHADOWED not in request:
        return
    saturation = pool.saturation(time.time())
    if saturation is not None:
        request[TRACE].waiting = saturation.waiting_per_replica
        check_queue_budget(tier, tier_name, pool.model, saturation.waiting_per_replica,
                           saturation.retry_after_s)


async def _count_refused(request: web.Request, principal: Principal, tier: TierPolicy) -> None:
    """Count a request refused before admission; a 429 replaces its own error, an unreachable
    store does not (the client's own fault is the better answer then)."""
    try:
        window = await request.app[METERING].count(principal, tier)
    except GatewayError as exc:
        if exc.kind is ErrorKind.RATE_LIMITED:
            raise
        return
    request[RESPONSE_HEADERS] = window.headers()


async def _acquire(request: web.Request, claim: idempotency.Claim | None, principal: Principal,
                   tier: TierPolicy) -> web.StreamResponse | None:
    """Claim the Idempotency-Key (if one came) before anything is held. A replay, a duplicate
    still running (409) or a key reused for another body (422) is counted like any refused
    request."""
    if claim is None:
        return None
    pending_ttl = int(request.app[CONFIG].upstream.longest_request_s) + 60
    try:
        replay = await claim.acquire(request.app[REDIS], pending_ttl)
    except RedisError:
        raise store_unavailable("idempotency store") from None
    except GatewayError:
        await _count_refused(request, principal, tier)
        raise
    if replay is None:
        return None
    await _count_refused(request, principal, tier)
    headers = {"Content-Type": replay.content_type, "Idempotent-Replayed": "true"}
    if replay.blob is None:
        return web.Response(status=replay.status, body=replay.body, headers=headers)
    try:
        found = await request.app[MEDIA].find(principal.account, replay.blob)
    except StoreFailed:
        raise store_unavailable("media store") from None
    if found is None:
        raise GatewayError(ErrorKind.CONFLICT, "a request with this Idempotency-Key already "
                           "completed; its kept answer has expired", headers=headers)
    return await send_stored(request, found, status=replay.status, headers={
        **request.get(RESPONSE_HEADERS, {}), **headers, "X-Request-Id": request[REQUEST_ID]})


def _keep_or_release(request: web.Request, claim: idempotency.Claim, result: Result,
                     response: web.StreamResponse | None, policies: Policies) -> None:
    """Queued after the settlement: keep a completed result for retries, else give the key
    back (nothing was charged, so a retry runs for real)."""
    handed_off = response is not None and response.status == 202  # a task: its 202 is kept
    if response is None or (result.status != Outcome.COMPLETED and not handed_off):
        request.app[SETTLER].add(claim.key, claim.release())
        return
    if isinstance(response, web.Response) and isinstance(response.body, bytes):
        content_type, body = response.content_type, response.body
    else:
        content_type, body = response.headers["Content-Type"], b"".join(result.captured or ())
    request.app[KEEPER].keep(claim, response.status, content_type, body,
                             policies.requests.tasks.max_media_bytes_per_account)
