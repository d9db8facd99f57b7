"""Handing an admitted request over to the task queue (`async: true`): 202 and a poll URL.

The request was admitted like any other (rate limit counted, worst case held); the hold goes
with the task (`Meter.handed_off`), and the worker that runs it settles it. Past the account's
cap on open tasks, or while it keeps
all the media it may (a task that would make media), the answer is 429 and the hold is released
as for any refused request.
"""

from __future__ import annotations

import time

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.blobs.base import StoreFailed
from proxy.blobs.media import MediaStore
from proxy.credits.meter import Meter
from proxy.errors import ErrorKind, GatewayError, media_cap_reached, store_unavailable
from proxy.families.base import Ctx
from proxy.observe.trace import CURRENT
from proxy.tasks.spec import TaskSpec
from proxy.tasks.store import TaskStore


async def submit(ctx: Ctx, store: TaskStore, meter: Meter, *, route: str, body: bytes,
                 params: dict[str, str], task_id: str, mode: str, cap: int | None = None,
                 media: MediaStore | None = None) -> web.Response:
    """Queue the request as a task (`route` names the path that runs it, `body` the client's
    JSON, `params` the route's path parameters) and answer 202. `media`: where its answer would
    be kept (a family's task), checked for room first."""
    policy = ctx.policies.requests.tasks
    principal, hold = meter.principal, meter.hold
    if media is not None:
        try:
            room = await media.room(principal.account, policy.max_media_bytes_per_account)
        except StoreFailed:
            raise store_unavailable("media store") from None
        if not room.fits:
            raise media_cap_reached(policy.max_media_bytes_per_account)
    spec = TaskSpec(
        id=task_id, route=route, body=body, params=params, headers=_forwardable(ctx),
        account=principal.account, tier=principal.tier, kind=principal.kind,
        key_id=principal.key_id, request_id=ctx.request_id, mode=mode, model=meter.model,
        hold_id=hold.hold_id if hold else "", held=hold.amount if hold else 0,
        details=meter.details, cap=cap, created_at=int(time.time()),
        traceparent=_traceparent())
    try:
        queued = await store.submit(spec, max_open=policy.max_open_per_account,
                                    record_ttl_s=policy.result_ttl_s + policy.max_run_s)
    except RedisError:
        raise store_unavailable("task store") from None
    if not queued:
        raise GatewayError(ErrorKind.RATE_LIMITED,
                           f"this account has {policy.max_open_per_account} tasks still "
                           "running; poll them before submitting more",
                           headers={"Retry-After": "5"})
    meter.handed_off()
    poll = f"/v2/tasks/{task_id}"
    return web.Response(status=202, content_type="application/json", body=orjson.dumps({
        "task_id": task_id, "status": "running", "poll_url": poll,
        "message": f"accepted; poll {poll} until the status is completed or failed"}))


def _traceparent() -> str:
    """The submitting request's own span, for the run's trace to link to (tracing on)."""
    trace = CURRENT.get()
    spans = trace.spans if trace is not None else None
    return spans.traceparent() if spans is not None else ""


def _forwardable(ctx: Ctx) -> dict[str, str]:
    """The client headers some backend forwards (`forward_headers`); nothing else is kept."""
    kept: dict[str, str] = {}
    for backend in ctx.router.backends:
        kept.update(backend.forward.select(ctx.client_headers))
    return kept
