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

from proxy.appkeys import LEDGER, LIVE, METRICS, ROUTER, SETTLER, TASKS
from proxy.credits.admission import Hold
from proxy.credits.meter import ChatMeter, Meter, Result, Stage
from proxy.credits.pricing import units_cost
from proxy.errors import ErrorKind, GatewayError
from proxy.families.handlers import Answer, Ctx, Family
from proxy.identity.principal import Principal, PrincipalKind
from proxy.outcome import Outcome
from proxy.pipeline import complete_chat, fetch_completion, parsed_call
from proxy.styles.base import ChatStyle
from proxy.tasks.network import agreed, record
from proxy.tasks.spec import TaskSpec
from proxy.upstream.quorum import fingerprint

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
    finally:
        if meter.charged is not None:
            app[METRICS].settled(meter.model, meter.principal.tier, *meter.charged)


async def _produce(family: Family, ctx: Ctx, spec: TaskSpec) -> Answer:
    policies = ctx.app[LIVE].current.policies
    job = family.parse(orjson.loads(spec.body), policies, spec.params)
    pool = family.pool(ctx.app[ROUTER], job, policies, spec.mode)
    if spec.mode != "network":
        return await family.produce(ctx, job, pool)
    done = await agreed(ctx.app, pool, lambda one: family.produce(ctx, job, one),
                        lambda answer: fingerprint(answer.body), spec.request_id)
    await record(ctx.app, spec.account, done, {"task_id": spec.id})
    answer: Answer = done.answer
    return Answer(answer.body, answer.content_type, answer.used,
                  {**answer.headers, "X-Task-Address": done.address})


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
    pool = app[ROUTER].pool("chat", call.model, spec.mode)
    policies = app[LIVE].current.policies
    chat = ChatMeter(meter, policies.prices.for_model(spec.model, spec.mode), call.openai_body)
    outcome = Result(status=Outcome.UPSTREAM_ERROR)
    cap = spec.cap or policies.prices.default_max_tokens
    try:
        if spec.mode == "network":
            seed = policies.requests.network.seed
            done = await agreed(app, pool, lambda one: fetch_completion(ctx, call, cap, one, seed),
                                fingerprint, spec.request_id)
            rendered = style.response(done.answer, call, spec.id, "network")
            rendered["task_address"] = done.address
            await record(app, spec.account, done, rendered)
            outcome.usage = done.answer.get("usage")
            body = orjson.dumps(rendered)
        else:
            body, outcome.usage = await complete_chat(ctx, style, call, cap, pool, spec.mode,
                                                      spec.id)
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

