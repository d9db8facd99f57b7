"""A simulated server's state (counters, the request log, its engine, whether it is dead) and
the routes that show and steer it: `/_sim/requests`, `/_sim/stats`, `/_sim/reset`,
`/_sim/health`, and the media servers' `/health` that the last one fails."""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web

from proxy.simulators.bodies import json_object, json_response
from proxy.simulators.config import SimConfig
from proxy.simulators.engine import Latencies
from proxy.simulators.errors import BadRequest
from proxy.simulators.scheduler import Scheduler

RECORDS_KEPT = 1000


class Record:
    """One inference request as `/_sim/requests` shows it; the body is parsed only on read."""

    __slots__ = ("body", "form", "headers", "outcome", "path")

    def __init__(self, path: str, headers: Mapping[str, str]) -> None:
        self.path = path
        self.headers = headers
        self.body = b""
        self.form: dict[str, object] | None = None  # form bodies: summarised when read
        self.outcome: str | None = None  # null while in flight

    def as_json(self) -> dict[str, object]:
        body: object = self.form
        if body is None:
            try:
                body = orjson.loads(self.body) if self.body else None
            except orjson.JSONDecodeError:
                body = None
        headers = {name.lower(): value for name, value in self.headers.items()}
        return {"path": self.path, "headers": headers, "body": body, "outcome": self.outcome}


class SimState:
    """Counters and the request log of one simulated server."""

    def __init__(self, kind: str, config: SimConfig) -> None:
        self.kind = kind
        self.config = config
        self.healthy = True
        self.records: deque[Record] = deque(maxlen=RECORDS_KEPT)
        self.in_flight = self.total = self.cancelled = 0
        self.requests = 0  # like `total`, but never reset: Prometheus counters only grow
        self.successes = 0
        self.failures: Counter[str] = Counter()  # TGI error_type, "dropped" or "incomplete"
        self.finished: Counter[tuple[str, str]] = Counter()  # (model, stop|length|abort)
        self.prompt_tokens: Counter[str] = Counter()
        self.generation_tokens: Counter[str] = Counter()
        self.rejected = 0  # vLLM admission rejections (queue full)
        self.engine = Scheduler(config, reserve_whole=kind == "tgi")
        self.latency = Latencies(config.max_model_len)
        # The engine died (vLLM: its EngineCore); then the port closes, as the server exits.
        self.dead = False
        # Stops listening (set by whoever runs the app: the CLI exits, a test stops its site).
        self.close_port: Callable[[], Awaitable[None]] | None = None
        self._closing: asyncio.Task[None] | None = None
        self._close_at = math.inf

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def waiting(self) -> int:
        return len(self.engine.waiting)

    @property
    def full(self) -> bool:
        """vLLM's admission control: in flight (running and waiting) at --max-num-queued-reqs."""
        limit = self.config.max_queued
        return limit is not None and self.engine.in_flight >= limit

    def die(self) -> None:
        """The engine is gone: /health 503, requests 500, live streams end with an error
        event, and the port closes after `death_close_s` or at the first request that meets the
        dead engine (vLLM's API server shuts down from its error handler)."""
        self.dead = True
        self.healthy = False
        self.close_soon(self.config.death_close_s)

    def close_soon(self, delay_s: float) -> None:
        """Close the port in `delay_s` (or sooner, if a close is already due sooner)."""
        loop = asyncio.get_running_loop()
        at = loop.time() + delay_s
        if self._closing is not None:
            if self._closing.done() or self._close_at <= at:
                return
            self._closing.cancel()
        self._close_at = at
        self._closing = loop.create_task(self._close(delay_s))

    async def _close(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self.close_port is not None:
            await self.close_port()

    def reset(self) -> None:
        self.records.clear()
        self.total = self.cancelled = 0


STATE = web.AppKey("sim_state", SimState)


async def _requests(request: web.Request) -> web.Response:
    return json_response([record.as_json() for record in request.app[STATE].records])


async def _stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response(
        {"in_flight": state.in_flight, "total": state.total, "cancelled": state.cancelled}
    )


async def _reset(request: web.Request) -> web.Response:
    request.app[STATE].reset()
    return web.Response(status=204)


async def _health(request: web.Request) -> web.Response:
    """`{"healthy": false}` makes /health fail (the only way to see TGI's 503 body)."""
    try:
        body = json_object(await request.read()) if request.can_read_body else {}
    except BadRequest as exc:
        return web.Response(status=400, text=str(exc))
    request.app[STATE].healthy = bool(body.get("healthy", True))
    return web.Response(status=204)


async def health_status(request: web.Request) -> web.Response:
    """Media servers' /health: 200 `{"status":"ok"}` (whisper.cpp's body; a status-only probe
    of vLLM or a FastAPI facade is as happy), 503 while unhealthy (`/_sim/health`)."""
    if request.app[STATE].healthy:
        return json_response({"status": "ok"})
    return json_response({"status": "loading model"}, status=503)


def add_sim_routes(app: web.Application) -> None:
    app.router.add_get("/_sim/requests", _requests)
    app.router.add_get("/_sim/stats", _stats)
    app.router.add_post("/_sim/reset", _reset)
    app.router.add_post("/_sim/health", _health)
