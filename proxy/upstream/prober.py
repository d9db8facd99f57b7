"""The per-worker loops that keep each `Backend`'s health current (the I/O half of `health`).

- `Prober`: active probes, one task per backend. The cheap probe is `GET <health_path>` (2xx =
  OK); the deep probe is a one-token, non-streamed `POST /v1/chat/completions` for the backend's
  first model (a 2xx JSON answer with `choices` = OK). `BackendHealth.probe_kind` picks the
  tier; a cheap probe that just recovered is followed by the deep one at once.
- `FleetSync`: reads the supervisor's records (`fleet_state`) from Redis, so a supervised backend
  is routable only while its process is ready, and a replaced process starts with clean health.

Probes carry `User-Agent: inference-gateway-health` so server logs can tell them apart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import aiohttp
import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from proxy.config import HealthSection
from proxy.runtime.fleet_state import POLL_S, READY, FleetRecord
from proxy.upstream.health import Probe
from proxy.upstream.pool import Backend, health_path

log = logging.getLogger("proxy.health")

PROBE_HEADERS = {"User-Agent": "inference-gateway-health"}
DEEP_PROBE_PATH = "/v1/chat/completions"


def probe_session(timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(limit=0, force_close=True),  # a probe is a fresh connect
        trust_env=False,
    )


async def cheap_probe(session: aiohttp.ClientSession, backend: Backend) -> bool:
    try:
        async with session.get(backend.base_url + health_path(backend.spec),
                               headers={**PROBE_HEADERS, **backend.auth},
                               allow_redirects=False) as response:
            await response.read()
            return 200 <= response.status < 300
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def deep_probe(session: aiohttp.ClientSession, backend: Backend) -> bool:
    body = {"model": backend.spec.models[0], "max_tokens": 1, "stream": False,
            "messages": [{"role": "user", "content": "ping"}]}
    try:
        async with session.post(backend.base_url + DEEP_PROBE_PATH, data=orjson.dumps(body),
                                headers={**PROBE_HEADERS, **backend.auth,
                                         "Content-Type": "application/json"},
                                allow_redirects=False) as response:
            raw = await response.read()
            if not 200 <= response.status < 300:
                return False
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(answer, dict) and "error" not in answer and bool(answer.get("choices"))


class Prober:
    """Active probes for every backend with a health path, each on its own schedule."""

    def __init__(self, backends: Sequence[Backend], settings: HealthSection,
                 session: aiohttp.ClientSession) -> None:
        self.backends = [b for b in backends if health_path(b.spec)]
        self.settings = settings
        self.session = session

    async def probe(self, backend: Backend) -> None:
        """One round for one backend: the tier its health asks for, then deep if just recovered."""
        if not backend.ready:
            return  # the supervisor is starting it; its own readiness probe decides
        health = backend.health
        kind = health.probe_kind(time.monotonic())
        was_out = not backend.healthy
        ok = await self._send(backend, kind)
        health.record_probe(time.monotonic(), kind, ok)
        if ok and kind is Probe.CHEAP and health.probe_kind(time.monotonic()) is Probe.DEEP:
            kind = Probe.DEEP
            ok = await self._send(backend, kind)
            health.record_probe(time.monotonic(), kind, ok)
        if was_out != (not backend.healthy):
            log.log(logging.INFO if backend.healthy else logging.WARNING,
                    "backend %r is %s (%s probe %s)", backend.name,
                    "in rotation" if backend.healthy else "out of rotation",
                    kind.value, "ok" if ok else "failed")

    async def _send(self, backend: Backend, kind: Probe) -> bool:
        if kind is Probe.DEEP:
            return await deep_probe(self.session, backend)
        return await cheap_probe(self.session, backend)

    async def first_round(self) -> None:
        """Probe everything once before serving, so a dead backend gets no first requests."""
        await asyncio.gather(*(self.probe(b) for b in self.backends))

    async def run(self) -> None:
        """Forever: each backend on its own schedule (sooner when a cool-down ends)."""
        await asyncio.gather(*(self._loop(b) for b in self.backends))

    async def _loop(self, backend: Backend) -> None:
        last = time.monotonic()
        while True:
            due = backend.health.next_probe_at(last, self.settings.interval_s)
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            last = time.monotonic()
            try:
                await self.probe(backend)
            except Exception:  # a bug here must not end probing for good
                log.exception("health probe of %r failed unexpectedly", backend.name)


class FleetSync:
    """Follows the supervisor's records in Redis (supervised backends only)."""

    def __init__(self, backends: Sequence[Backend], redis: Redis, key: str) -> None:
        self.backends = [b for b in backends if b.supervised]
        self.redis = redis
        self.key = key
        self._redis_down = False
        self._ready_pid: dict[str, int | None] = {}  # the process last seen ready, per backend

    async def read_once(self) -> list[Backend]:
        """Take in the records; returns the backends that just became ready (to probe now)."""
        try:
            raw: dict[bytes | str, bytes | str] = await self.redis.hgetall(self.key)
        except (RedisError, OSError) as exc:
            if not self._redis_down:  # keep the last known states until Redis is back
                log.warning("cannot read backend states from Redis (%s)", type(exc).__name__)
            self._redis_down = True
            return []
        self._redis_down = False
        fresh = []
        for backend in self.backends:
            value = raw.get(backend.name.encode(), raw.get(backend.name))
            record = FleetRecord.decode(value) if value is not None else None
            if record is not None and record.state == READY:
                if self._ready_pid.get(backend.name, 0) != record.pid:
                    # A new process: the old one's failures are not its own, and it is proven
                    # by a probe before it gets a request.
                    backend.health.reset(verified=backend.fresh_verified)
                    fresh.append(backend)
                elif not backend.ready:  # back from unhealthy: see for ourselves, now
                    fresh.append(backend)
                self._ready_pid[backend.name] = record.pid
            backend.record = record
        return fresh

    async def run(self, prober: Prober) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            fresh = await self.read_once()
            await asyncio.gather(*(prober.probe(b) for b in fresh))  # in rotation at once
