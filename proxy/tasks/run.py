"""Running one queued task: the request path after admission, without a client connection.

The task's spec says which route's path runs it and carries the client's body; the worker parses
it again, picks the pool, produces the answer as the route would (proxy.families.handlers,
proxy.pipeline.complete_chat), keeps it (audio and video as media, for
`/v2/audio/media/{key}`), and settles the hold placed at submission: charged what it used when it
completed, released when it failed. A task that is no longer running (finished by a worker whose
entry was reclaimed, or expired) is left alone.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import orjson
from aiohttp import web

from proxy.appkeys import LEDGER, LIVE, ROUTER, SETTLER, TASKS
from proxy.credits.meter import ChatMeter, Meter, Result, Stage
from proxy.credits.pricing import units_cost
from proxy.errors import ErrorKind, GatewayError
from proxy.families.handlers import Answer, Ctx, Family
from proxy.identity.principal import Principal, PrincipalKind
from proxy.outcome import Outcome
from proxy.pipeline import complete_chat, parsed_call
from proxy.policy.admission import Hold
from proxy.styles.base import ChatStyle
from proxy.tasks.spec import TaskSpec

log = logging.getLogger("proxy.tasks")

Runnable = Family | ChatStyle  # what a task's `route` names


async def run_task(app: web.Application, routes: dict[str, Runnable], account: str,
                   task_id: str) -> None:
    store = app[TASKS]
    found = await store.spec(account, task_id)
    if found is None or found[0] != "running":
        return  # expired, or another worker ended it
    spec = found[1]
    policies = app[LIVE].current.policies
    ttl = policies.requests.tasks.result_ttl_s
    meter = _meter(app, spec)
    ctx = Ctx(app, spec.request_id, spec.headers)
    runnable = routes.get(spec.route)
    try:
        if runnable is None:
            raise GatewayError(ErrorKind.INTERNAL_ERROR, "this task's route no longer exists")
        if isinstance(runnable, Family):
            answer = await _produce(runnable, ctx, spec)
            result = await _kept(app, spec, answer, ttl)
            meter.charge(app[SETTLER], app[LEDGER].settle_script, Outcome.COMPLETED,
                         units_cost(policies.prices.for_model(spec.model, spec.mode),
                                    answer.used), answer.used.counts(), {"async": True})
        else:
            result = await _chat(app, runnable, ctx, spec, meter)
        await store.finish(account, task_id, result=result, ttl_s=ttl)
    except GatewayError as exc:
        meter.charge(app[SETTLER], app[LEDGER].settle_script, Outcome.UPSTREAM_ERROR, 0, {},
                     {"async": True})
        await store.finish(account, task_id, ttl_s=ttl, error={
            "type": exc.kind.type, "message": exc.message, "status": exc.status,
            **({"detail": exc.detail} if exc.detail is not None else {})})


async def _produce(family: Family, ctx: Ctx, spec: TaskSpec) -> Answer:
    policies = ctx.app[LIVE].current.policies
    job = family.parse(orjson.loads(spec.body), policies, spec.params)
    pool = family.pool(ctx.app[ROUTER], job, policies)
    return await family.produce(ctx, job, pool)


async def _kept(app: web.Application, spec: TaskSpec, answer: Answer, ttl: int) -> Any:
    """The task's result: JSON answers as they are; audio and video kept as media."""
    media = answer.content_type.partition(";")[0].strip().lower()
    if media == "application/json":
        return orjson.loads(answer.body)
    key = await app[TASKS].put_media(spec.account, answer.content_type, answer.body, ttl)
    return {"media_key": key, "media_url": f"/v2/audio/media/{key}",
            "content_type": answer.content_type, "bytes": len(answer.body),
            **{k.lower().replace("-", "_").removeprefix("x_"): v
               for k, v in answer.headers.items()}}


async def _chat(app: web.Application, style: ChatStyle, ctx: Ctx, spec: TaskSpec,
                meter: Meter) -> Any:
    call = parsed_call(style, orjson.loads(spec.body))
    pool = app[ROUTER].chat_pool(call.model)
    chat = ChatMeter(meter, app[LIVE].current.policies.prices.for_model(spec.model, spec.mode),
                     call.openai_body)
    outcome = Result(status=Outcome.UPSTREAM_ERROR)
    try:
        body, outcome.usage = await complete_chat(ctx, style, call, spec.cap or 1, pool,
                                                  spec.mode, spec.id)
        outcome.status = Outcome.COMPLETED
    finally:
        chat.settle(app[SETTLER], app[LEDGER].settle_script, outcome)
    return orjson.loads(body)


def _meter(app: web.Application, spec: TaskSpec) -> Meter:
    """The submission's meter again: its hold, already placed."""
    prices = app[LIVE].current.policies.prices
    principal = Principal(kind=cast(PrincipalKind, spec.kind), account=spec.account,
                          tier=spec.tier, key_id=spec.key_id)
    hold = Hold(spec.hold_id, spec.held, prices.hold_ttl_s) if spec.hold_id else None
    return Meter(principal, prices, spec.model, dict(spec.details), hold, Stage.ADMITTED)

