"""What the operator console shows of the whole fleet, beside the per-worker metrics: spend and
refusals per account, and errors by type, gathered in Redis from every worker and gateway host.

Each worker tallies its answered requests in memory (`note`, called by the middleware, and by
the task runner for an async task's run: a few dict updates, never awaited), and a background
task writes them to Redis in one pipeline about once a second (`run`). `/admin/overview` reads
them back (proxy.api.console). Every key carries the `{console}` hash tag, so on a Redis
Cluster they share one slot and one ZUNION may span them.

    igw:{console}:spend:<hour>     sorted set  account -> micro-credits charged in that UTC hour
    igw:{console}:refused:<hour>   sorted set  account -> refusals that hour: 402, 403, 429, and
                                               503 pool_saturated              (both kept 25 h)
    igw:{console}:errors:<minute>  hash        "<type> <status>" -> error answers (kept 61 min)
    igw:{console}:recent           list        the last 50 error answers (JSON), newest first

A recent error is {ts, status, type, route, model, request_id}: the route's template and a model
the router knows, never a key, token, header or body. A write Redis refuses is dropped, not
retried (a retry could count twice): counted in igw_redis_errors_total{store="console tally"}
and logged once per outage, the figures missing what it carried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import orjson
from redis.exceptions import RedisError

from proxy.errors import ErrorKind
from proxy.observe.metrics import Metrics
from proxy.observe.trace import Trace
from proxy.store.client import Store

log = logging.getLogger("proxy")

SPEND_HOURS: Final = 24  # the hourly buckets a read sums: this hour and the 23 before it
KEEP_HOURS: Final = 25  # an hour's bucket lives this long past its start
ERROR_MINUTES: Final = 60  # the minute buckets a read sums
KEEP_MINUTES: Final = 61
RECENT_MAX: Final = 50
FLUSH_S: Final = 1.0
REFUSED: Final = frozenset({402, 403, 429})  # and 503 pool_saturated: the tier's own limits
_TAG: Final = "igw:{console}"
RECENT: Final = f"{_TAG}:recent"


def spend_key(hour: int) -> str:
    return f"{_TAG}:spend:{hour}"


def refused_key(hour: int) -> str:
    return f"{_TAG}:refused:{hour}"


def errors_key(minute: int) -> str:
    return f"{_TAG}:errors:{minute}"


def is_refusal(status: int, error: str | None) -> bool:
    """An answer refused by the caller's own limits, credits or access (not an outage)."""
    return status in REFUSED or (status == 503 and error == ErrorKind.POOL_SATURATED.type)


@dataclass
class _Pending:
    """What this worker noted since its last write."""

    spend: Counter[tuple[int, str]] = field(default_factory=Counter)  # (hour, account)
    refused: Counter[tuple[int, str]] = field(default_factory=Counter)  # (hour, account)
    errors: Counter[tuple[int, str]] = field(default_factory=Counter)  # (minute, "type status")
    recent: deque[bytes] = field(default_factory=lambda: deque(maxlen=RECENT_MAX))  # oldest 1st

    def __bool__(self) -> bool:
        return bool(self.spend or self.refused or self.errors or self.recent)


class FleetTally:
    """`note` on the request path; `run` writes the notes to Redis until cancelled."""

    def __init__(self, redis: Store, metrics: Metrics,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.metrics = metrics
        self.clock = clock
        self.failed = 0  # writes Redis refused (what they carried is not counted)
        self._pending = _Pending()
        self._failing = False

    def note(self, trace: Trace, status: int, request_id: str) -> None:
        """One answered request: its charge and refusal (keyed callers only), its error."""
        now = self.clock()
        pending = self._pending
        if trace.account is not None:
            hour = int(now // 3600)
            if trace.charged:
                pending.spend[hour, trace.account] += trace.charged
            if is_refusal(status, trace.error):
                pending.refused[hour, trace.account] += 1
        if trace.error is not None and status >= 400:
            pending.errors[int(now // 60), f"{trace.error} {status}"] += 1
            pending.recent.append(orjson.dumps({
                "ts": round(now, 3), "status": status, "type": trace.error,
                "route": trace.route, "model": trace.model, "request_id": request_id}))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()

    async def flush(self) -> None:
        """Write what was noted since the last write, in one pipeline."""
        pending, self._pending = self._pending, _Pending()
        if not pending:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for (hour, account), micro in pending.spend.items():
                    pipe.zincrby(spend_key(hour), micro, account)
                for (hour, account), count in pending.refused.items():
                    pipe.zincrby(refused_key(hour), count, account)
                for hour in {hour for hour, _ in (*pending.spend, *pending.refused)}:
                    pipe.expireat(spend_key(hour), (hour + KEEP_HOURS) * 3600)
                    pipe.expireat(refused_key(hour), (hour + KEEP_HOURS) * 3600)
                for (minute, kind), count in pending.errors.items():
                    pipe.hincrby(errors_key(minute), kind, count)
                for minute in {minute for minute, _ in pending.errors}:
                    pipe.expireat(errors_key(minute), (minute + KEEP_MINUTES) * 60)
                if pending.recent:
                    pipe.lpush(RECENT, *pending.recent)  # the newest ends up first
                    pipe.ltrim(RECENT, 0, RECENT_MAX - 1)
                await pipe.execute()
        except RedisError as exc:
            self.failed += 1
            self.metrics.redis_errors.labels("console tally").inc()
            if not self._failing:
                log.warning("the console's tally could not be written to Redis (%s); its "
                            "figures miss what was dropped", type(exc).__name__)
            self._failing = True
            return
        self._failing = False
