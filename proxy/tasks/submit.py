"""Handing an admitted request over to the task queue (`async: true`): 202 and a poll URL.

The request was admitted like any other (rate limit counted, worst case held); the hold goes
with the task (`Stage.HANDED_OFF`), and the worker that runs it settles it. Past the account's
cap on open tasks the answer is 429 and the hold is released as for any refused request.
"""

from __future__ import annotations

import time

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.appkeys import LIVE, REQUEST_ID, ROUTER, TASKS
from proxy.credits.meter import Meter, Stage
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.tasks.spec import TaskSpec


async def submit(request: web.Request, meter: Meter, *, route: str, body: bytes, task_id: str,
                 mode: str, cap: int | None = None) -> web.Response:
    policy = request.app[LIVE].current.policies.requests.tasks
    principal, hold = meter.principal, meter.hold
    spec = TaskSpec(
        id=task_id, route=route, body=body, params=dict(request.match_info),
        headers=_forwardable(request), account=principal.account, tier=principal.tier,
        kind=principal.kind, key_id=principal.key_id, request_id=request[REQUEST_ID],
        mode=mode, model=meter.model, hold_id=hold.hold_id if hold else "",
        held=hold.amount if hold else 0, details=meter.details, cap=cap,
        created_at=int(time.time()))
    try:
        queued = await request.app[TASKS].submit(
            spec, max_open=policy.max_open_per_account,
            record_ttl_s=policy.result_ttl_s + policy.max_run_s)
    except RedisError:
        raise store_unavailable("task store") from None
    if not queued:
        raise GatewayError(ErrorKind.RATE_LIMITED,
                           f"this account has {policy.max_open_per_account} tasks still "
                           "running; poll them before submitting more",
                           headers={"Retry-After": "5"})
    meter.stage = Stage.HANDED_OFF
    poll = f"/v2/tasks/{task_id}"
    return web.Response(status=202, content_type="application/json", body=orjson.dumps({
        "task_id": task_id, "status": "running", "poll_url": poll,
        "message": f"accepted; poll {poll} until the status is completed or failed"}))


def _forwardable(request: web.Request) -> dict[str, str]:
    """The client headers some backend forwards (`forward_headers`); nothing else is kept."""
    kept: dict[str, str] = {}
    for backend in request.app[ROUTER].backends:
        kept.update(backend.forward.select(request.headers))
    return kept
