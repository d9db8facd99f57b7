"""Running one queued task: the request path after admission, without a client connection.

The task's spec says which route's path runs it and carries the client's body; the worker parses it
again under the policies in force when it runs, picks the pool, produces the answer as the route
would (proxy.families, proxy.tasks.network), keeps it (audio and video in the media store,
proxy.blobs, for `/v2/audio/media/{key}`), and settles the hold placed at submission: charged what
it used when it completed, released when it failed. A task that is no longer running (finished by a
worker whose entry was reclaimed, or expired) is left alone.
"""

from __future__ import annotations

from typing import Any, cast

import orjson

from proxy.blobs.base import StoreFailed
from proxy.blobs.media import MediaStore
from proxy.credits.admission import Hold
from proxy.credits.meter import Meter, Metering, Result
from proxy.errors import ErrorKind, GatewayError, media_cap_reached, store_unavailable
from proxy.families.base import Answer, Ctx, Family
from proxy.families.chat import complete, parsed_call
from proxy.identity.principal import Principal, PrincipalKind
from proxy.observe.trace import CURRENT
from proxy.outcome import Outcome
from proxy.styles.base import ChatStyle
from proxy.tasks.network import network_answer, network_chat
from proxy.tasks.spec import TaskSpec
from proxy.tasks.store import TaskStore

Runnable = Family | ChatStyle  # what a task's `route` names


async def run_task(ctx: Ctx, store: TaskStore, media: MediaStore, metering: Metering,
                   spec: TaskSpec, runnable: Runnable | None) -> int:
    """Run `spec` (its record says it is still running), keep its result, settle its hold;
    the HTTP status its answer would have had (for its trace)."""
    policies = ctx.policies
    ttl = policies.requests.tasks.result_ttl_s
    meter = _meter(metering, ctx, spec, runnable)
    result = Result(status=Outcome.UPSTREAM_ERROR)  # until it has an answer
    try:
        if runnable is None:
            raise GatewayError(ErrorKind.INTERNAL_ERROR, "this task's route no longer exists")
        if isinstance(runnable, Family):
            answer = await _produce(ctx, store, runnable, spec)
            result.answered(used=answer.used)
            kept = await _kept(ctx, media, spec, answer)
        else:
            kept = await _chat(ctx, store, runnable, spec, result)
        result.delivered()
        meter.settle_on(CURRENT.get(), result)
        await store.finish(spec.account, spec.id, result=kept, ttl_s=ttl)
        return 200
    except GatewayError as exc:
        failed = Result(status=Outcome.UPSTREAM_ERROR)  # nothing is charged for a failure
        failed.failed(exc)
        meter.settle_on(CURRENT.get(), failed)
        trace = CURRENT.get()
        if trace is not None:
            trace.error = exc.kind.type
        await store.finish(spec.account, spec.id, ttl_s=ttl, error={
            "type": exc.kind.type, "message": exc.message, "status": exc.status,
            **({"detail": exc.detail} if exc.detail is not None else {})})
        return exc.status



async def _produce(ctx: Ctx, store: TaskStore, family: Family, spec: TaskSpec) -> Answer:
    job = family.parse(orjson.loads(spec.body), ctx.policies, spec.params)
    pool = family.pool(ctx.router, job, ctx.policies, spec.mode)
    if spec.mode != "network":
        return await family.produce(ctx, job, pool)
    return await network_answer(ctx, store, spec.account, family, job, pool,
                                lambda answer: {"task_id": spec.id})


async def _kept(ctx: Ctx, media: MediaStore, spec: TaskSpec, answer: Answer) -> Any:
    """The task's result: JSON answers as they are; audio, images and video kept in the media
    store, under the account's cap (past it the task fails, and is not charged)."""
    if answer.content_type.partition(";")[0].strip().lower() == "application/json":
        return orjson.loads(answer.body)
    policy = ctx.policies.requests.tasks
    try:
        key = await media.keep(spec.account, answer.content_type, answer.body,
                               ttl_s=policy.result_ttl_s, cap=policy.max_media_bytes_per_account)
    except StoreFailed:
        raise store_unavailable("media store") from None
    if key is None:
        raise media_cap_reached(policy.max_media_bytes_per_account)
    return {"media_key": key, "media_url": f"/v2/audio/media/{key}",
            "content_type": answer.content_type, "bytes": len(answer.body),
            **{k.lower().replace("-", "_").removeprefix("x_"): v
               for k, v in answer.headers.items()}}


async def _chat(ctx: Ctx, store: TaskStore, style: ChatStyle, spec: TaskSpec, result: Result
                ) -> Any:
    call = parsed_call(style, orjson.loads(spec.body))
    pool = ctx.router.pool("chat", call.model, spec.mode)
    cap = spec.cap or ctx.policies.prices.default_max_tokens
    if spec.mode == "network":
        rendered, usage, _ = await network_chat(ctx, store, spec.account, style, call, cap,
                                                pool, spec.id)
    else:
        rendered, usage = await complete(ctx, style, call, cap, pool, spec.mode, spec.id)
    result.answered(usage=usage)
    return rendered


def _meter(metering: Metering, ctx: Ctx, spec: TaskSpec, runnable: Runnable | None) -> Meter:
    """The submission's meter again: its hold, already placed."""
    prices = ctx.policies.prices
    principal = Principal(kind=cast(PrincipalKind, spec.kind), account=spec.account,
                          tier=spec.tier, key_id=spec.key_id)
    hold = Hold(spec.hold_id, spec.held, prices.hold_ttl_s) if spec.hold_id else None
    body = orjson.loads(spec.body) if isinstance(runnable, ChatStyle) else None
    return metering.resume(prices, principal, spec.model, spec.mode, spec.details, hold, body)
