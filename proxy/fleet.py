"""This worker's part of the upstream fleet: health loops, drain, and `GET /admin/backends`.

`setup_fleet(app)` adds a cleanup_ctx that, before the worker serves:
  - reads the supervisor's records from Redis (supervised backends are routable only when ready;
    see `upstream.fleet_state`), then keeps following them;
  - probes every backend once, then keeps probing (`upstream.prober`, `upstream.health`).
Passive outcomes come from `Upstreams.exchange`; `Pool.pick` reads the result through
`Backend.healthy`.

Drain (SIGTERM, driven by `serve`): `/readyz` fails at once and every new request gets 503 with
Retry-After; requests already running finish, up to the deadline; then the upstream streams
still open are closed, which makes each relay end its client's stream with one error event.
The counting and refusing is a middleware because it must see every route, and nothing else is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.admin_api import require_admin
from proxy.appkeys import CONFIG, REDIS, ROUTER, UPSTREAMS
from proxy.errors import ErrorKind, GatewayError
from proxy.tasks import stop_task
from proxy.upstream.client import Upstreams
from proxy.upstream.fleet_state import STARTING, fleet_key
from proxy.upstream.pool import Backend, Router
from proxy.upstream.prober import FleetSync, Prober, probe_session

log = logging.getLogger("proxy.fleet")

# Answered while draining: the load balancer must keep seeing them.
_ALWAYS_SERVED = frozenset({"/healthz", "/readyz"})
_ABORT_GRACE_S = 2.0  # after closing the upstreams, how long relays get to send their last event


class Fleet:
    """Drain state and in-flight count of this worker."""

    def __init__(self, router: Router, upstreams: Upstreams) -> None:
        self.router = router
        self.upstreams = upstreams
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, deadline_s: float) -> None:
        """Refuse new requests; wait for running ones up to `deadline_s`, then cut upstreams."""
        self.draining = True
        log.info("draining: %d request(s) in flight, up to %.0f s", self.in_flight, deadline_s)
        try:
            await asyncio.wait_for(self._idle.wait(), deadline_s)
            return
        except TimeoutError:
            pass
        cut = self.upstreams.abort_open()
        log.warning("drain deadline passed: closing %d upstream stream(s)", cut)
        try:
            await asyncio.wait_for(self._idle.wait(), _ABORT_GRACE_S)
        except TimeoutError:
            log.warning("%d request(s) still running; they will be cancelled", self.in_flight)


FLEET = web.AppKey("fleet", Fleet)


@web.middleware
async def drain_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in _ALWAYS_SERVED:
        return await handler(request)
    fleet = request.app[FLEET]
    if fleet.draining:
        raise GatewayError(ErrorKind.UNAVAILABLE, "the gateway is shutting down; retry shortly",
                           headers={"Retry-After": "1", "Connection": "close"})
    fleet.enter()
    try:
        return await handler(request)
    finally:
        fleet.leave()


def setup_fleet(app: web.Application) -> None:
    """Health loops, supervisor-state sync and drain for this worker (cleanup_ctx + routes)."""
    app.middlewares.append(drain_gate)  # inside the error middleware, which renders its 503
    app.cleanup_ctx.append(_fleet_ctx)
    app.router.add_get("/admin/backends", list_backends)


async def _fleet_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    router = app[ROUTER]
    app[FLEET] = Fleet(router, app[UPSTREAMS])
    session = probe_session(config.health.timeout_s)
    prober = Prober(router.backends, config.health, session)
    sync = FleetSync(router.backends, app[REDIS], fleet_key(config.root))
    tasks: list[asyncio.Task[None]] = []
    try:
        if sync.backends:
            await sync.read_once()
            tasks.append(asyncio.create_task(sync.run(prober)))
        await prober.first_round()
        tasks.append(asyncio.create_task(prober.run()))
        yield
    finally:
        for task in tasks:
            await stop_task(task)
        await session.close()


async def list_backends(request: web.Request) -> web.Response:
    """Every backend as this worker sees it (health and load are per worker; the supervisor's
    state, pid and restarts are the master's)."""
    await require_admin(request)
    backends = request.app[ROUTER].backends
    body = {"object": "list", "worker_pid": os.getpid(),
            "data": [backend_view(b) for b in backends]}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def backend_view(backend: Backend) -> dict[str, Any]:
    health = backend.health
    now = time.monotonic()
    ejected_until = None
    if health.ejected_until is not None:  # monotonic -> unix time, for people
        ejected_until = round(time.time() + (health.ejected_until - now), 3)
    record = backend.record
    if backend.supervised:
        state = record.state if record is not None else STARTING
    else:
        state = "unhealthy" if health.probe_down else "ready"
    last = health.last_probe
    return {
        "name": backend.name,
        "kind": backend.spec.kind,
        "url": backend.base_url,
        "models": list(backend.spec.models),
        "supervised": backend.supervised,
        "state": state,
        "healthy": backend.healthy,
        "ejected_until": ejected_until,
        "half_open": health.half_open(now),
        "consecutive_failures": health.consecutive_failures,
        "outstanding": backend.outstanding,
        "restarts": record.restarts if record is not None else 0,
        "pid": record.pid if record is not None else None,
        "last_probe": {"kind": last[0].value, "ok": last[1]} if last is not None else None,
    }
