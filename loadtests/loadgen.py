"""The load generator: a fixed number of workers on one keep-alive aiohttp session per target.

Every response is checked by `loadtests.checks`; a failed check is counted as an error under a
short reason, never dropped. Latency runs from sending the request to the last body byte; time to
first token (TTFT) to the first SSE event that carries generated text.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from loadtests.checks import StreamCheck, completion_problem

# Generous: the simulators answer instantly, so anything near this is a hang worth an error.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=5)


@dataclass(frozen=True)
class Target:
    name: str  # "direct" or "gateway"
    chat_url: str
    headers: Mapping[str, str]


@dataclass
class Tally:
    """Raw results for one target in one phase, summed over its rounds."""

    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    events: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    elapsed_s: float = 0.0
    client_cpu_s: float = 0.0
    server_cpu_s: dict[str, float] = field(default_factory=dict)

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
            "ttft_p99_ms": percentile(self.ttfts_s, 99) * 1000,
            "events": self.events,
            "events_per_s": self.events / elapsed,
            "events_per_request": self.events / ok if ok else math.nan,
            "client_cpu_pct": 100 * self.client_cpu_s / elapsed,
            "server_cpu_pct": {k: 100 * v / elapsed for k, v in self.server_cpu_s.items()},
        }


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile; NaN when there is nothing to rank."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def chat_body(model: str, *, stream: bool, max_tokens: int) -> bytes:
    return orjson.dumps({
        "model": model,
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": max_tokens,
        "stream": stream,
    })


def new_session(target: Target, concurrency: int) -> aiohttp.ClientSession:
    # One pooled connection per worker, kept alive across requests and rounds.
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60)
    headers = {"Content-Type": "application/json", **target.headers}
    return aiohttp.ClientSession(connector=connector, headers=headers, timeout=REQUEST_TIMEOUT)


RequestFn = Callable[[aiohttp.ClientSession, Target, bytes, Tally], Awaitable[None]]


async def run_round(
    session: aiohttp.ClientSession, target: Target, body: bytes, request: RequestFn,
    *, concurrency: int, duration_s: float, max_requests: int, tally: Tally,
) -> None:
    """Workers send back to back until the deadline or the request cap; the round lasts until
    the last in-flight request ends, so every counted request falls inside `elapsed_s`."""
    issued = 0
    start = time.perf_counter()
    deadline = start + duration_s
    cpu_start = time.process_time()

    async def worker() -> None:
        nonlocal issued
        while issued < max_requests and time.perf_counter() < deadline:
            issued += 1
            await request(session, target, body, tally)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    tally.elapsed_s += time.perf_counter() - start
    tally.client_cpu_s += time.process_time() - cpu_start


async def chat_once(
    session: aiohttp.ClientSession, target: Target, body: bytes, tally: Tally
) -> None:
    start = time.perf_counter()
    try:
        async with session.post(target.chat_url, data=body) as resp:
            payload = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        tally.fail(type(exc).__name__)
        return
    elapsed = time.perf_counter() - start
    problem = completion_problem(status, payload)
    if problem:
        tally.fail(problem)
    else:
        tally.latencies_s.append(elapsed)


async def stream_once(
    session: aiohttp.ClientSession, target: Target, body: bytes, tally: Tally
) -> None:
    start = time.perf_counter()
    ttft = 0.0
    check = StreamCheck()
    try:
        async with session.post(target.chat_url, data=body) as resp:
            if resp.status != 200:
                await resp.read()
                tally.fail(f"HTTP {resp.status}")
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
