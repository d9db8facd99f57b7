"""Per-tier request rates on Redis through `limits`, exact across workers and gateways.

Strategy: the moving window (a sliding log of timestamps, one atomic Lua script in Redis). It is
exact — at most N requests in ANY 60-second span, with no double burst at a window boundary as a
fixed window allows — and its cost is bounded by the largest tier rate (≤ a few hundred entries
per account). Admission is `hit()` only: never `test()` then `hit()`, which would race.

When Redis is unreachable each tier follows its policy: fail open to a small per-process limit
(counted in `failed_open`), or fail closed with 503 + Retry-After. Redis errors are counted in
`store_errors`; service returns to normal on its own when Redis answers again.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage, RedisStorage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.errors import StorageError
from redis.exceptions import ConnectionError as RedisConnectionError

from proxy.config import TierPolicy
from proxy.errors import ErrorKind, GatewayError, store_unavailable

log = logging.getLogger("proxy.policy.admission")


@dataclass(frozen=True, slots=True)
class Admission:
    limit: int
    remaining: int
    reset_s: int  # seconds until the window frees a slot
    degraded: bool = False  # decided by the per-process fallback (Redis unreachable)

    def headers(self) -> dict[str, str]:
        return {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(self.remaining),
            "X-RateLimit-Reset": str(self.reset_s),
        }


class RateLimiter:
    def __init__(self, redis_url: str) -> None:
        scheme, _, rest = redis_url.partition("://")
        scheme = "redis+unix" if scheme == "unix" else scheme
        self._storage = RedisStorage(
            f"async+{scheme}://{rest}", implementation="redispy", wrap_exceptions=True,
            key_prefix="igw:rl", socket_timeout=1.0, socket_connect_timeout=1.0,
        )
        self._limiter = MovingWindowRateLimiter(self._storage)
        self._fallback = MovingWindowRateLimiter(MemoryStorage())
        self.store_errors = 0
        self.failed_open = 0

    async def admit(self, tier_name: str, tier: TierPolicy, bucket: str) -> Admission:
        """Count this request against `bucket`'s tier rate; 429 (or 503) when it may not pass."""
        item = RateLimitItemPerMinute(tier.requests_per_minute)
        try:
            allowed = await self._limiter.hit(item, tier_name, bucket)
            stats = await self._limiter.get_window_stats(item, tier_name, bucket)
        except StorageError:
            self.store_errors += 1
            return await self._store_down(tier_name, tier, bucket)
        admission = _admission(item.amount, stats.remaining, stats.reset_time)
        if not allowed:
            raise _rate_limited(admission, f"the {tier_name} tier allows "
                                f"{tier.requests_per_minute} requests per minute")
        return admission

    async def peek(self, tier_name: str, tier: TierPolicy, bucket: str) -> Admission:
        """The window as it stands, without counting a request (raises RedisError if down)."""
        item = RateLimitItemPerMinute(tier.requests_per_minute)
        try:
            stats = await self._limiter.get_window_stats(item, tier_name, bucket)
        except StorageError as exc:
            raise RedisConnectionError("rate-limit store unreachable") from exc
        return _admission(item.amount, stats.remaining, stats.reset_time)

    async def _store_down(self, tier_name: str, tier: TierPolicy, bucket: str) -> Admission:
        if tier.store_down == "closed":
            raise store_unavailable("rate-limit store")
        item = RateLimitItemPerMinute(tier.fallback_requests_per_minute)
        allowed = await self._fallback.hit(item, tier_name, bucket)
        stats = await self._fallback.get_window_stats(item, tier_name, bucket)
        admission = _admission(item.amount, stats.remaining, stats.reset_time, degraded=True)
        if not allowed:
            raise _rate_limited(admission, "rate limit reached (reduced limit while degraded)")
        self.failed_open += 1
        if self.failed_open == 1 or self.failed_open % 1000 == 0:
            log.warning("rate-limit store unreachable: admitting on the fallback limit "
                        "(%d so far)", self.failed_open)
        return admission


def _admission(limit: int, remaining: int, reset_time: float, degraded: bool = False
               ) -> Admission:
    reset_s = max(0, math.ceil(reset_time - time.time()))
    return Admission(limit, max(0, remaining), reset_s, degraded)


def _rate_limited(admission: Admission, message: str) -> GatewayError:
    wait = max(1, admission.reset_s)
    return GatewayError(ErrorKind.RATE_LIMITED, f"{message}; retry in {wait} s",
                        headers={**admission.headers(), "Retry-After": str(wait)})
