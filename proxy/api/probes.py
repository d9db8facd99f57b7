"""The probes a load balancer or orchestrator polls: alive (`/healthz`) and ready (`/readyz`)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from redis.asyncio import RedisCluster

from proxy.appkeys import COUNTERS, DRAIN, REDIS, ROUTER
from proxy.store.client import Store


async def healthz(request: web.Request) -> web.Response:
    """Alive: the process answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready: not draining, the state store and the rate-limit store answer (one Redis or two),
    and a backend may take traffic."""
    checks: dict[str, bool] = {"accepting": not request.app[DRAIN].draining}
    checks["redis"], checks["rate_limit_redis"] = await asyncio.gather(
        _answers(request.app[REDIS]), _answers(request.app[COUNTERS]))
    # Supervised and ready (if supervised), probes fine, not ejected: see Backend.healthy.
    checks["backends"] = any(b.healthy for b in request.app[ROUTER].backends)
    ready = all(checks.values())
    body = {"status": "ready" if ready else "not ready", "checks": checks}
    return web.json_response(body, status=200 if ready else 503)


async def _answers(redis: Store) -> bool:
    """The store answers: its one server, or every primary of a Cluster (replicas do not
    serve requests, so one that is down does not make the gateway unready)."""
    try:
        if isinstance(redis, RedisCluster):
            return bool(await redis.ping(target_nodes=RedisCluster.PRIMARIES))
        return bool(await redis.ping())
    except Exception:  # any failure to reach the store means not ready; its text is not public
        return False
