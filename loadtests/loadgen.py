"""The load generator: aiohttp on uvloop, keep-alive connections, three ways of sending.

- closed loop (`run_round`): a fixed number of workers, each sending its next request as soon as
  the previous one is done: the highest rate the target sustains at that concurrency.
- open loop (`run_open_loop`): requests start on a fixed schedule (request i at start + i/rate,
  never before: `loadtests.clock`), whether or not earlier ones have finished; latency runs from
  the *scheduled* start, so queueing anywhere (in the target or in this client) counts. The
  client's own lateness (actual start minus scheduled start) is recorded as `lags_s`, so a
  client that cannot keep up shows.
- held streams (`hold_streams`): N streams opened and kept open, for the memory figure.

Every response is checked by `loadtests.checks`; a failed check is counted as an error under a
short reason, never dropped. Requests to the gateway rotate over many API keys (round robin).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtests.checks import StreamCheck, completion_problem
from loadtests.clock import Clock

# Generous: the upstream mocks answer instantly, so anything near this is a hang worth an error.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=10)
# Held streams live as long as the phase: only silence is an error.
HOLD_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)
SSE_ACCEPT = "text/event-stream"
JSON_ACCEPT = "application/json"


@dataclass
class Target:
    """Where to send, and the API keys to rotate over (none for an upstream)."""

    name: str  # "direct" or "gateway"
    chat_url: str
    keys: tuple[str, ...] = ()
    _turn: int = 0

    def headers(self, stream: bool) -> dict[str, str]:
        # Accept: the nginx mock picks its answer by it (the gateway sets it upstream itself).
        headers = {"Accept": SSE_ACCEPT if stream else JSON_ACCEPT}
        if self.keys:
            headers["X-API-Key"] = self.keys[self._turn % len(self.keys)]
            self._turn += 1
        return headers


@dataclass
class Tally:
    """Raw results for one target in one phase, summed over its rounds."""

    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    lags_s: list[float] = field(default_factory=list)
    events: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: dict[str, float] = field(default_factory=dict)
    core_busy_s: dict[str, list[float]] = field(default_factory=dict)  # role -> [busy, total]
    figures: dict[str, float] = field(default_factory=dict)  # phase-specific extras

    def fail(self, reason: str) -> None:
        self.errors[reason] += 1

    def summary(self) -> dict[str, Any]:
        ok = len(self.latencies_s)
        elapsed = self.elapsed_s or math.nan
        return {
            "requests": ok,
            "errors": sum(self.errors.values()),
            "error_kinds": dict(self.errors),
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": ok / elapsed,
            "p50_ms": percentile(self.latencies_s, 50) * 1000,
            "p99_ms": percentile(self.latencies_s, 99) * 1000,
            "ttft_p50_ms": percentile(self.ttfts_s, 50) * 1000,
            "events": self.events,
            "events_per_s": self.events / elapsed,
            "events_per_request": self.events / ok if ok else math.nan,
            "lag_p50_ms": percentile(self.lags_s, 50) * 1000,
            "lag_p99_ms": percentile(self.lags_s, 99) * 1000,
            "lag_max_ms": max(self.lags_s) * 1000 if self.lags_s else math.nan,
            "client_cpu_pct": 100 * self.client_cpu_s / elapsed,
            "server_cpu_pct": {k: 100 * v / elapsed for k, v in self.server_cpu_s.items()},
            "core_busy_pct": {k: 100 * b / t if t else math.nan
                              for k, (b, t) in self.core_busy_s.items()},
            **self.figures,
        }


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile; NaN when there is nothing to rank."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def chat_body(model: str, *, stream: bool, max_tokens: int) -> bytes:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    if stream:  # the usage chunk too, as many clients ask: the same 52 events on both sides
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def new_session(limit: int, timeout: aiohttp.ClientTimeout = REQUEST_TIMEOUT
                ) -> aiohttp.ClientSession:
    # Pooled connections, kept alive across requests and rounds.
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=timeout,
                                 headers={"Content-Type": "application/json"})


# (session, target, body, tally, scheduled start or None) -> None
RequestFn = Callable[[aiohttp.ClientSession, Target, bytes, Tally, float | None],
                     Coroutine[Any, Any, None]]


async def run_round(
    session: aiohttp.ClientSession, target: Target, body: bytes, request: RequestFn,
    *, concurrency: int, duration_s: float, max_requests: int, tally: Tally,
) -> None:
    """Closed loop: workers send back to back until the deadline or the request cap; the round
    lasts until the last in-flight request ends, so every counted request falls inside
    `elapsed_s`."""
    issued = 0
    start = time.perf_counter()
    deadline = start + duration_s
    cpu_start = time.process_time()

    async def worker() -> None:
        nonlocal issued
        while issued < max_requests and time.perf_counter() < deadline:
            issued += 1
            await request(session, target, body, tally, None)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    tally.elapsed_s += time.perf_counter() - start
    tally.client_cpu_s += time.process_time() - cpu_start


async def run_open_loop(
    session: aiohttp.ClientSession, target: Target, body: bytes, request: RequestFn,
    *, rate: float, duration_s: float, tally: Tally,
) -> None:
    """Open loop: request i starts at start + i/rate, never waiting for earlier ones. The round
    lasts until the last one ends."""
    count = max(1, round(rate * duration_s))
    interval = 1 / rate
    tasks: set[asyncio.Task[None]] = set()
    cpu_start = time.process_time()
    start = time.perf_counter() + 0.002
    with contextlib.closing(Clock()) as clock:
        for i in range(count):
            due = start + i * interval
            await clock.until(due)
            task = asyncio.create_task(request(session, target, body, tally, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    tally.elapsed_s += time.perf_counter() - start
    tally.client_cpu_s += time.process_time() - cpu_start


def http_problem(status: int, payload: bytes) -> str:
    """`HTTP 503: <the error's message, shortened>`: the reason a failure is counted under."""
    message = ""
    with contextlib.suppress(orjson.JSONDecodeError):
        doc = orjson.loads(payload)
        error = doc.get("error") if isinstance(doc, dict) else None
        found = error.get("message") if isinstance(error, dict) else error
        message = found[:80] if isinstance(found, str) else ""
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def _started(tally: Tally, due: float | None) -> float:
    """The instant latency is measured from: the scheduled start when there is one."""
    now = time.perf_counter()
    if due is None:
        return now
    tally.lags_s.append(now - due)
    return due


async def chat_once(
    session: aiohttp.ClientSession, target: Target, body: bytes, tally: Tally,
    due: float | None = None,
) -> None:
    start = _started(tally, due)
    try:
        async with session.post(target.chat_url, data=body,
                                headers=target.headers(False)) as resp:
            payload = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.fail(type(exc).__name__)
        return
    elapsed = time.perf_counter() - start
    problem = (completion_problem(status, payload) if status == 200
               else http_problem(status, payload))
    if problem:
        tally.fail(problem)
    else:
        tally.latencies_s.append(elapsed)


async def stream_once(
    session: aiohttp.ClientSession, target: Target, body: bytes, tally: Tally,
    due: float | None = None,
) -> None:
    start = _started(tally, due)
    ttft = 0.0
    check = StreamCheck()
    try:
        async with session.post(target.chat_url, data=body,
                                headers=target.headers(True)) as resp:
            if resp.status != 200:
                tally.fail(http_problem(resp.status, await resp.read()))
                return
            async for chunk in resp.content.iter_any():
                if check.feed(chunk):
                    ttft = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.fail(type(exc).__name__)
        return
    elapsed = time.perf_counter() - start
    problem = check.finish()
    if problem:
        tally.fail(problem)
        return
    tally.latencies_s.append(elapsed)
    tally.ttfts_s.append(ttft)
    tally.events += check.events


async def hold_streams(
    session: aiohttp.ClientSession, target: Target, body: bytes, *, count: int,
    open_timeout_s: float, connecting: int, tally: Tally,
    while_open: Callable[[], Awaitable[None]],
) -> int:
    """Open `count` streams (at most `connecting` of them between request and first token at a
    time, so the target's listen backlog is not flooded), await `while_open()` once all are open
    and streaming (each has delivered a token), then close them all. Returns how many were open.

    A stream that fails to open, or ends while it should be held, is an error."""
    gate = asyncio.Semaphore(connecting)
    opened = 0
    start = time.perf_counter()

    settled = asyncio.Event()  # every stream is open or has failed

    def note() -> None:
        if opened + sum(tally.errors.values()) >= count:
            settled.set()

    async def one() -> None:
        nonlocal opened
        check = StreamCheck()
        waiting = True
        await gate.acquire()
        try:
            async with session.post(target.chat_url, data=body,
                                    headers=target.headers(True)) as resp:
                if resp.status != 200:
                    tally.fail(http_problem(resp.status, await resp.read()))
                    return
                async for chunk in resp.content.iter_any():
                    if check.feed(chunk) and waiting:
                        waiting = False
                        gate.release()
                        opened += 1
                        tally.latencies_s.append(time.perf_counter() - start)
                        note()
                tally.fail(check.finish() or "stream ended while held")
        except (aiohttp.ClientError, TimeoutError) as exc:
            tally.fail(type(exc).__name__)
        finally:
            if waiting:
                gate.release()
            note()

    cpu_start = time.process_time()
    tasks = [asyncio.create_task(one()) for _ in range(count)]
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(settled.wait(), open_timeout_s)
        tally.figures["open_s"] = time.perf_counter() - start
        open_now = opened
        missing = count - opened - sum(tally.errors.values())
        if missing > 0:  # neither open nor failed: hung
            tally.errors[f"not open after {open_timeout_s:g} s"] += missing
        if opened == count:
            await while_open()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tally.elapsed_s += time.perf_counter() - start
        tally.client_cpu_s += time.process_time() - cpu_start
    return open_now
