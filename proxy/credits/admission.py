"""Admission: the tier's rate limit and the credit hold, in one Redis round trip.

One Lua script (credits/lua/admit.lua), pipelined with the other admissions in flight on one
connection (runtime.script_pipe), counts the request in the caller's sliding window (at most
N requests in ANY 60 s, exact across every worker and gateway: no double burst at a window edge),
reads the figures the rate-limit headers need from that same step, and places the credit hold.
A keyed caller's window lives beside its balance (same hash tag, same Redis); a guest holds
nothing, so its window lives on the counters' Redis, off the ledger's fsync path.

Every identified attempt counts: a request refused before its hold (bad body, no access) is
counted by `count` (the same script without a hold), and the 429 beats its own error. A request
the limit refuses counts nothing.

When the store is unreachable: a keyed request cannot be metered, so it gets 503 (metered routes
fail closed); a guest follows its tier's `store_down`: `open` admits up to the per-process
fallback rate of `limits`' in-memory moving window (counted in `failed_open`), `closed` answers
503. A busy connection pool is not a store that is down: it answers 503 "busy" and never opens
the fallback.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import MovingWindowRateLimiter
from redis.exceptions import RedisError

from proxy.config import TierPolicy
from proxy.credits.ledger import ACCOUNTS, AccountKeys, InsufficientCredits, Ledger
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.identity.principal import Principal
from proxy.store.client import Primaries, Store, StoreBusy
from proxy.store.script_pipe import SERVER_RUN, ScriptPipes

log = logging.getLogger("proxy.credits.admission")

WINDOW_MS = 60_000
ADMITTED, LIMITED, INSUFFICIENT, DUPLICATE_HOLD = 1, 0, 2, 3


@dataclass(frozen=True, slots=True)
class Window:
    """The caller's rate-limit window as this request left it."""

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


@dataclass(frozen=True, slots=True)
class Hold:
    hold_id: str
    amount: int
    ttl_s: int


class Admitter:
    def __init__(self, ledger: Ledger, counters: Store) -> None:
        self._ledger = ledger
        self._admit = ledger.admit_script
        self._guest_admit = counters.register_script(ledger.admit_script.script)
        # Admissions go out as they come on one connection per primary, pipelined.
        self._keyed = ScriptPipes(ledger.primaries)
        self._counters = ledger.primaries if counters is ledger.redis else Primaries(counters)
        self._guests = ScriptPipes(self._counters)
        self._fallback = MovingWindowRateLimiter(MemoryStorage())
        self._indexed: set[str] = set()  # accounts this process already put in the index
        self.failed_open = 0

    async def admit(self, principal: Principal, tier_name: str, tier: TierPolicy,
                    hold: Hold | None = None) -> Window:
        """Count this request and place its hold: 429, 402 or 503 when it may not run."""
        keys = AccountKeys.of(principal.account)
        limit = tier.requests_per_minute
        try:
            if principal.kind == "guest":
                status, remaining, reset_ms, available = await self._guests.call(
                    self._guest_admit, [keys.window(tier_name)], [limit, WINDOW_MS, "", 0, 0, ""])
            else:
                await self._index(principal.account)
                status, remaining, reset_ms, available = await self._keyed.call(
                    self._admit,
                    [keys.window(tier_name), keys.balance, keys.holds, keys.hold_expiry],
                    [limit, WINDOW_MS, hold.hold_id if hold else "", hold.amount if hold else 0,
                     hold.ttl_s if hold else 0, SERVER_RUN])
        except StoreBusy:
            raise GatewayError(ErrorKind.UNAVAILABLE, "the gateway is busy; try again shortly",
                               headers={"Retry-After": "1"}) from None
        except RedisError:
            if principal.kind != "guest":
                raise store_unavailable("credit ledger") from None
            return await self._store_down(tier_name, tier, principal.account)
        window = Window(limit, max(0, int(remaining)), max(0, math.ceil(int(reset_ms) / 1000)))
        if status == LIMITED:
            raise rate_limited(window, f"the {tier_name} tier allows {limit} requests per minute")
        if status == INSUFFICIENT and hold is not None:
            raise InsufficientCredits(int(available), hold.amount)
        # DUPLICATE_HOLD: the script ran twice (its first reply was lost and the client
        # retried): the hold is ours, placed by the first run.
        return window

    async def close(self) -> None:
        await self._keyed.close()
        await self._guests.close()
        if self._counters is not self._ledger.primaries:
            await self._counters.close()

    async def count(self, principal: Principal, tier_name: str, tier: TierPolicy) -> Window:
        """Count an attempt that holds nothing (refused early, or a route without credits)."""
        return await self.admit(principal, tier_name, tier)

    async def _index(self, account: str) -> None:
        """Put the account in the sweeper's index once per process (not a round trip per hold)."""
        if account not in self._indexed:
            await self._ledger.redis.sadd(ACCOUNTS, account)
            if len(self._indexed) > 100_000:
                self._indexed.clear()
            self._indexed.add(account)

    async def _store_down(self, tier_name: str, tier: TierPolicy, bucket: str) -> Window:
        if tier.store_down == "closed":
            raise store_unavailable("rate-limit store")
        item = RateLimitItemPerMinute(tier.fallback_requests_per_minute)
        allowed = await self._fallback.hit(item, tier_name, bucket)
        stats = await self._fallback.get_window_stats(item, tier_name, bucket)
        window = Window(item.amount, max(0, stats.remaining),
                        max(0, math.ceil(stats.reset_time - time.time())), degraded=True)
        if not allowed:
            raise rate_limited(window, "rate limit reached (reduced limit while degraded)")
        self.failed_open += 1
        if self.failed_open == 1 or self.failed_open % 1000 == 0:
            log.warning("rate-limit store unreachable: admitting on the fallback limit "
                        "(%d so far)", self.failed_open)
        return window


def rate_limited(window: Window, message: str) -> GatewayError:
    wait = max(1, window.reset_s)
    return GatewayError(ErrorKind.RATE_LIMITED, f"{message}; retry in {wait} s",
                        headers={**window.headers(), "Retry-After": str(wait)})
