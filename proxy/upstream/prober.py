"""The per-worker loops that keep each `Backend`'s health current (the I/O half of `health`).

- `Prober`: active probes, one task per backend. The cheap probe is `GET <health_path>` (2xx =
  OK); the deep probe is a one-token, non-streamed `POST /v1/chat/completions` for the backend's
  first model (a 2xx JSON answer with `choices` = OK; 429 and 503 say busy, which is alive),
  or for an embedding server the vector of one word (`/v1/embeddings`, TEI's `/embed`).
  `BackendHealth.probe_kind` picks the tier; a cheap probe that just recovered is followed by
  the deep one at once. Probes run every `interval_s`, and at once (at most every
  `WAKE_GAP_S`) when a request to the backend failed: a dead engine then fails its probe and is
  out of rotation before a run of requests could fail on it.
- Engine limits: for vLLM backends, `GET /v1/models` gives each served model's `max_model_len`
  (TEI's `GET /info` its `max_input_length` and `max_client_batch_size`); it is read after the
  first good probe and again whenever the backend comes back into rotation
  (a restarted engine may have another context), never on a request's path.
- `FleetSync`: reads the supervisor's records (`fleet_state`) from Redis, so a supervised backend
  is routable only while its process is ready, and a replaced process starts with clean health.

Probes carry `User-Agent: inference-gateway-health` so server logs can tell them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import aiohttp
import orjson
from redis.exceptions import RedisError

from proxy.config import HealthSection
from proxy.store.client import Store
from proxy.upstream.fleet_state import POLL_S, READY, FleetRecord
from proxy.upstream.health import Probe
from proxy.upstream.pool import Backend, health_path
from proxy.upstream.signals import SIGNAL_KINDS, EngineSignals

log = logging.getLogger("proxy.health")

PROBE_HEADERS = {"User-Agent": "inference-gateway-health"}
DEEP_PROBE_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
BUSY = frozenset({429, 503})  # a deep probe answered "busy": the engine is alive
WAKE_GAP_S = 0.25  # failures wake the probe at most this often
# Kinds that report each model's context length: vLLM's /v1/models (`max_model_len`), TEI's
# /info (`max_input_length`, and the inputs one request may carry).
CONTEXT_KINDS = frozenset({"vllm", "tei"})
INFO_PATH = "/info"


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


def _deep_request(backend: Backend) -> tuple[str, dict[str, object], str]:
    """(path, body, the key a good answer has) of the backend's deep probe."""
    model = backend.spec.models[0]
    if backend.spec.kind == "tei":
        return "/embed", {"inputs": "ping"}, ""
    if backend.spec.serves == "embed":
        return "/v1/embeddings", {"model": model, "input": "ping"}, "data"
    return DEEP_PROBE_PATH, {"model": model, "max_tokens": 1, "stream": False,
                             "messages": [{"role": "user", "content": "ping"}]}, "choices"


async def deep_probe(session: aiohttp.ClientSession, backend: Backend) -> bool:
    path, body, key = _deep_request(backend)
    try:
        async with session.post(backend.base_url + path, data=orjson.dumps(body),
                                headers={**PROBE_HEADERS, **backend.auth,
                                         "Content-Type": "application/json"},
                                allow_redirects=False) as response:
            raw = await response.read()
            if response.status in BUSY:
                return True
            if not 200 <= response.status < 300:
                return False
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
    try:
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    if not key:  # TEI's /embed: a list of vectors
        return isinstance(answer, list) and bool(answer)
    return isinstance(answer, dict) and "error" not in answer and bool(answer.get(key))


async def read_context(session: aiohttp.ClientSession, backend: Backend) -> dict[str, int] | None:
    """model -> max_model_len from the engine's /v1/models (TEI: its /info, and the inputs one
    request may carry noted on `backend`); None when it cannot be read."""
    tei = backend.spec.kind == "tei"
    try:
        async with session.get(backend.base_url + (INFO_PATH if tei else MODELS_PATH),
                               headers={**PROBE_HEADERS, **backend.auth},
                               allow_redirects=False) as response:
            raw = await response.read()
            if response.status != 200:
                return None
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None
    if not tei:
        return context_lengths(raw)
    longest, batch = tei_limits(raw)
    backend.batch_inputs = batch
    return None if longest is None else dict.fromkeys(backend.spec.models, longest)


def tei_limits(raw: bytes) -> tuple[int | None, int | None]:
    """TEI's /info -> (max_input_length, max_client_batch_size), each None if not there. Pure."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(body, dict):
        return None, None
    found = [body.get(name) for name in ("max_input_length", "max_client_batch_size")]
    longest, batch = (n if type(n) is int and n > 0 else None for n in found)
    return longest, batch


def context_lengths(raw: bytes) -> dict[str, int] | None:
    """`{"data": [{"id": ..., "max_model_len": ...}]}` -> {id: max_model_len}. Pure."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    entries = body.get("data") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        return None
    return {e["id"]: e["max_model_len"] for e in entries
            if isinstance(e, dict) and isinstance(e.get("id"), str)
            and type(e.get("max_model_len")) is int and e["max_model_len"] > 0}


class Prober:
    """Active probes for every backend with a health path, each on its own schedule."""

    def __init__(self, backends: Sequence[Backend], settings: HealthSection,
                 session: aiohttp.ClientSession) -> None:
        self.backends = [b for b in backends if health_path(b.spec)]
        self.settings = settings
        self.session = session
        self._wake = {b.name: asyncio.Event() for b in self.backends}
        for backend in self.backends:
            backend.wake = self._wake[backend.name].set

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
        if (ok and backend.spec.kind in CONTEXT_KINDS
                and (not backend.max_model_len or (was_out and backend.healthy))):
            await self._learn_context(backend)

    async def _learn_context(self, backend: Backend) -> None:
        learned = await read_context(self.session, backend)
        if learned is not None and learned != backend.max_model_len:
            log.info("backend %r: context length %s", backend.name,
                     ", ".join(f"{model} {n}" for model, n in sorted(learned.items())) or "none")
            backend.max_model_len = learned

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
        wake = self._wake[backend.name]
        last = time.monotonic()
        woken_at = -WAKE_GAP_S
        while True:
            due = backend.health.next_probe_at(last, self.settings.interval_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, due - time.monotonic())):
                    await wake.wait()  # a failed request: look now
            if wake.is_set():
                await asyncio.sleep(max(0.0, woken_at + WAKE_GAP_S - time.monotonic()))
                woken_at = time.monotonic()
            wake.clear()  # failures from here on ask for the next probe
            last = time.monotonic()
            try:
                await self.probe(backend)
            except Exception:  # a bug here must not end probing for good
                log.exception("health probe of %r failed unexpectedly", backend.name)


class FleetSync:
    """Follows the master's records in Redis: the supervisor's states of supervised backends,
    and the engines' own load (vLLM and TGI backends, proxy.runtime.signal_scraper), read as
    often as the master scrapes them (`signals_s`) so a pick's figures are at most two scrapes
    old."""

    def __init__(self, backends: Sequence[Backend], redis: Store, key: str,
                 signals_key: str | None = None, signals_s: float = POLL_S) -> None:
        self.backends = [b for b in backends if b.supervised]
        self.signalled = [b for b in backends if b.spec.kind in SIGNAL_KINDS] \
            if signals_key else []
        self.redis = redis
        self.key = key
        self.signals_key = signals_key
        self.interval_s = min(POLL_S, max(0.1, signals_s)) if self.signalled else POLL_S
        self._redis_down = False
        self._ready_pid: dict[str, int | None] = {}  # the process last seen ready, per backend

    @property
    def needed(self) -> bool:
        return bool(self.backends or self.signalled)

    async def read_once(self) -> list[Backend]:
        """Take in the records; returns the backends that just became ready (to probe now)."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.hgetall(self.key)
                if self.signals_key:
                    pipe.hgetall(self.signals_key)
                raw, *signals = await pipe.execute()
        except (RedisError, OSError) as exc:
            if not self._redis_down:  # keep the last known states until Redis is back
                log.warning("cannot read backend states from Redis (%s)", type(exc).__name__)
            self._redis_down = True
            return []
        self._redis_down = False
        for backend in self.signalled:
            value = _field(signals[0], backend.name)
            backend.take_signals(EngineSignals.decode(value) if value is not None else None)
        fresh = []
        for backend in self.backends:
            value = _field(raw, backend.name)
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
            await asyncio.sleep(self.interval_s)
            fresh = await self.read_once()
            await asyncio.gather(*(prober.probe(b) for b in fresh))  # in rotation at once


def _field(raw: dict[bytes | str, bytes | str], name: str) -> bytes | str | None:
    return raw.get(name.encode(), raw.get(name))
