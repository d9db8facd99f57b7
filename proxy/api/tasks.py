"""Polling async tasks and fetching their media, by their owner only.

    GET /v2/tasks/{task_id}          {task_id, status, result | error, created_at, updated_at}
    GET /v2/audio/media/{media_key}  the audio (or video) a finished task produced; Range works

Both look under the caller's own account (proxy.tasks.store, proxy.blobs): another account's task
or media, and an expired one, are a plain 404. A credential that is present must be valid; guests
see their own (by client address). Not counted against the rate limit: polling is expected.
"""

from __future__ import annotations

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.appkeys import LIVE, MEDIA, REQUEST_ID, TASKS
from proxy.blobs.base import StoreFailed
from proxy.blobs.media import send_stored
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.http.ranges import byte_range
from proxy.tasks.spec import poll_answer


async def _owner(request: web.Request) -> str:
    snapshot = request.app[LIVE].current
    return (await snapshot.auth.principal(request.headers, request.remote)).account


async def poll(request: web.Request) -> web.Response:
    account = await _owner(request)
    task_id = request.match_info["task_id"]
    try:
        record = await request.app[TASKS].record(account, task_id)
    except RedisError:
        raise store_unavailable("task store") from None
    if record is None:
        raise GatewayError(ErrorKind.NOT_FOUND, "no such task (or it has expired)")
    return web.Response(body=orjson.dumps(poll_answer(task_id, record)),
                        content_type="application/json")


async def media(request: web.Request) -> web.StreamResponse:
    account = await _owner(request)
    try:
        found = await request.app[MEDIA].find(account, request.match_info["media_key"])
    except StoreFailed:
        raise store_unavailable("media store") from None
    if found is None:
        raise GatewayError(ErrorKind.NOT_FOUND, "no such media (or it has expired)")
    span = None
    wanted = request.headers.get("Range")
    if wanted is not None:
        span = byte_range(wanted, found.stat.size)
        if span is None:
            return web.Response(status=416,
                                headers={"Content-Range": f"bytes */{found.stat.size}"})
    # Sent before the middleware sees the response: its request id goes with it.
    return await send_stored(request, found, span=span,
                             headers={"X-Request-Id": request[REQUEST_ID]})
