"""The master's scrape of every pooled engine's own load: one task per host, not one per worker.

Every `[health] engine_signals_s` (default 0.25 s) it reads each vLLM and TGI backend's
`/metrics` (proxy.upstream.signals parses it) and writes what it found to one Redis hash per
gateway instance, which the workers follow as they follow the supervisor's records:

    igw:fleet:signals:<hostname>:<config folder>    field = backend name
                                                     value = JSON {waiting, running, kv, at}

The hash expires if the master stops writing; a backend whose scrape failed keeps no entry, so a
worker never routes on a stale figure (`SIGNALS_FRESH_S`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence

import aiohttp
from redis.exceptions import RedisError

from proxy.config import BackendSpec
from proxy.store.client import Store
from proxy.upstream.signals import (
    MAX_TEXT,
    SIGNAL_KINDS,
    SIGNALS_FRESH_S,
    EngineSignals,
    parse_signals,
)

log = logging.getLogger("proxy.runtime.signals")



class SignalScraper:
    def __init__(self, specs: Sequence[BackendSpec], redis: Store, key: str,
                 interval_s: float) -> None:
        self.specs = [s for s in specs if s.kind in SIGNAL_KINDS]
        self.redis = redis
        self.key = key
        self.interval_s = interval_s
        self._failing: set[str] = set()
        self._store_down = False

    async def run(self) -> None:
        """Scrape and publish every interval until cancelled."""
        if not self.specs or self.interval_s <= 0:
            return
        timeout = aiohttp.ClientTimeout(total=max(0.1, min(1.0, 2 * self.interval_s)))
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False,
                                         cookie_jar=aiohttp.DummyCookieJar()) as session:
            while True:
                started = time.monotonic()
                found = await asyncio.gather(*(self._scrape(session, s) for s in self.specs))
                await self._publish({s.name: f for s, f in zip(self.specs, found, strict=True)
                                     if f is not None})
                await asyncio.sleep(max(0.0, started + self.interval_s - time.monotonic()))

    async def _scrape(self, session: aiohttp.ClientSession,
                      spec: BackendSpec) -> EngineSignals | None:
        headers = {}
        token = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with session.get(spec.url.rstrip("/") + "/metrics", headers=headers,
                                   allow_redirects=False) as response:
                if response.status != 200:
                    raise ValueError(f"status {response.status}")
                raw = await response.content.read(MAX_TEXT + 1)
            signals = parse_signals(spec.kind, raw.decode("utf-8", "replace"), time.time())
            if signals is None:
                raise ValueError("no load figures in its /metrics")
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            if spec.name not in self._failing:  # once per outage, not every 250 ms
                log.info("engine signals of %r unavailable (%s); its workers pick on their own "
                         "counts", spec.name, exc or type(exc).__name__)
            self._failing.add(spec.name)
            return None
        self._failing.discard(spec.name)
        return signals

    async def _publish(self, found: dict[str, EngineSignals]) -> None:
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(self.key)  # a failed scrape leaves no stale entry behind
                if found:
                    pipe.hset(self.key, mapping={k: v.encode() for k, v in found.items()})
                    pipe.expire(self.key, max(1, int(SIGNALS_FRESH_S)))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            if not self._store_down:
                log.warning("cannot publish engine signals to Redis (%s)", type(exc).__name__)
            self._store_down = True
            return
        self._store_down = False
