"""What the operator console shows of the whole fleet, beside the per-worker metrics: spend and
refusals per account, and errors by type, gathered in Redis from every worker and gateway host.

Each worker tallies its answered requests in memory (`note`, called by the middleware, and by
the task runner for an async task's run: a few dict updates, never awaited), and a background
task writes them to Redis in one pipeline about once a second (`run`). `/admin/overview` reads
them back (`overview`). Every key carries the `{console}` hash tag, so on a Redis Cluster they
share one slot and one ZUNION may span them.

    igw:{console}:spend:<hour>     sorted set  account -> micro-credits charged in that UTC hour
    igw:{console}:refused:<hour>   sorted set  account -> refusals that hour: 402, 403, 429, and
                                               503 pool_saturated              (both kept 25 h)
    igw:{console}:errors:<minute>  hash        "<type> <status>" -> error answers (kept 61 min)
    igw:{console}:recent           list        the last 50 error answers (JSON), newest first

A recent error is {ts, status, type, route, model, request_id}: the route's template and a model
the router knows, never a key, token, header or body. A write Redis refuses is dropped, not
retried (a retry could count twice): counted in igw_redis_errors_total{store="console tally"}
and logged once per outage, the figures missing what it carried.

It lives in api/, not observe/, because it formats charges with proxy.credits, which itself sits
above observe/.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from aiohttp import web
from redis.exceptions import RedisClusterException, RedisError

from proxy.credits.ledger import as_text
from proxy.credits.pricing import format_credits
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
        except (RedisError, RedisClusterException) as exc:
            self.failed += 1
            self.metrics.redis_errors.labels("console tally").inc()
            if not self._failing:
                log.warning("the console's tally could not be written to Redis (%s); its "
                            "figures miss what was dropped", type(exc).__name__)
            self._failing = True
            return
        self._failing = False


# The worker's tally (set up in app.py's cleanup_ctx). Named here, not in proxy.appkeys: this
# module is in api/, which appkeys, imported by every api module, must not import.
TALLY: Final = web.AppKey("fleet_tally", FleetTally)


async def overview(redis: Store, top: int, now: float) -> dict[str, Any]:
    """The fleet's top `top` accounts by spend and by refusals over the last 24 hourly
    buckets, and its errors by type over the last 60 minutes and the last 50 of them."""
    hours = range(int(now // 3600) - SPEND_HOURS + 1, int(now // 3600) + 1)
    minutes = range(int(now // 60) - ERROR_MINUTES + 1, int(now // 60) + 1)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zunion([spend_key(hour) for hour in hours], withscores=True)
        pipe.zunion([refused_key(hour) for hour in hours], withscores=True)
        pipe.lrange(RECENT, 0, RECENT_MAX - 1)
        for minute in minutes:
            pipe.hgetall(errors_key(minute))
        spend, refused, recent, *errors = await pipe.execute()
    return {
        "window_s": SPEND_HOURS * 3600,
        "top_spend": [{"account": account, "credits": format_credits(micro),
                       "micro_credits": micro} for account, micro in _top(spend, top)],
        "top_refused": [{"account": account, "refusals": count}
                        for account, count in _top(refused, top)],
        "errors": {"window_s": ERROR_MINUTES * 60, "by_type": _by_type(errors),
                   "recent": [orjson.loads(entry) for entry in recent]},
    }


def _top(scored: list[tuple[Any, float]], top: int) -> list[tuple[str, int]]:
    """The `top` highest (ties by account), scores as the integers they were summed from."""
    pairs = sorted(((as_text(member), round(score)) for member, score in scored),
                   key=lambda pair: (-pair[1], pair[0]))
    return pairs[:top]


def _by_type(minutes: list[dict[Any, Any]]) -> dict[str, dict[str, int]]:
    """Error answers per type, most first; its status the one it was answered with most."""
    counts: Counter[tuple[str, int]] = Counter()
    for fields in minutes:
        for kind, count in fields.items():
            error, _, answered = as_text(kind).rpartition(" ")
            counts[error, int(answered)] += int(count)
    by_type: dict[str, dict[str, int]] = {}
    for (error, status), count in counts.most_common():
        seen = by_type.setdefault(error, {"count": 0, "status": status})
        seen["count"] += count
    return dict(sorted(by_type.items(), key=lambda item: (-item[1]["count"], item[0])))
