"""Admission: the tier's rate limit and the credit hold, in one Redis round trip.

One Lua script (credits/lua/admit.lua), pipelined with the other admissions in flight on one
connection (runtime.script_pipe), counts the request in the caller's sliding window (at most
N requests in ANY 60 s, exact across every worker and gateway: no double burst at a window edge),
reserves its worst case in the tier's token windows (tokens a minute and a day; the settlement
puts the engine's count in its place: `settle_tokens`), reads the figures the rate-limit
headers need from that same step, and places the credit hold, within the account's and the
key's budgets (proxy.credits.budgets).
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

import asyncio
import contextlib
import datetime
import logging
import math
import time
from dataclasses import dataclass

from limits import RateLimitItemPerMinute
from limits.aio.storage import MemoryStorage
from limits.aio.strategies import MovingWindowRateLimiter
from redis.exceptions import RedisError

from proxy.config import TierPolicy
from proxy.credits.budgets import BudgetExceeded, utc_text
from proxy.credits.ledger import ACCOUNTS, AccountKeys, InsufficientCredits, Ledger
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.identity.principal import Principal
from proxy.store.client import Primaries, Store, StoreBusy
from proxy.store.script_pipe import SERVER_RUN, ScriptPipes

log = logging.getLogger("proxy.credits.admission")

WINDOW_MS = 60_000
# The token windows (minute, day): bucket seconds and buckets spanned, as admit.lua and
# token_settle.lua count them.
TOKEN_WINDOWS = ((1, 60), (300, 288))
ADMITTED, LIMITED, INSUFFICIENT, DUPLICATE_HOLD, TOKEN_LIMITED, OVER_BUDGET = 1, 0, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class Window:
    """The caller's rate-limit windows as this request left them."""

    limit: int
    remaining: int
    reset_s: int  # seconds until the window frees a slot
    degraded: bool = False  # decided by the per-process fallback (Redis unreachable)
    tokens_limit: int = 0  # tokens a minute (a day, when only that is set); 0: no token limit
    tokens_remaining: int = 0
    tokens_reset_ms: int = 0  # until the token window has room again (0: it has now)

    def headers(self, style: str = "") -> dict[str, str]:
        """Today's X-RateLimit-* and the ones the official clients read: OpenAI's
        x-ratelimit-* (durations), or Anthropic's anthropic-ratelimit-* (RFC 3339 times) for
        the Messages route."""
        headers = {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(self.remaining),
            "X-RateLimit-Reset": str(self.reset_s),
        }
        if style == "anthropic":
            now = time.time()
            headers |= {"anthropic-ratelimit-requests-limit": str(self.limit),
                        "anthropic-ratelimit-requests-remaining": str(self.remaining),
                        "anthropic-ratelimit-requests-reset": _rfc3339(now + self.reset_s)}
            if self.tokens_limit:
                headers |= {
                    "anthropic-ratelimit-tokens-limit": str(self.tokens_limit),
                    "anthropic-ratelimit-tokens-remaining": str(self.tokens_remaining),
                    "anthropic-ratelimit-tokens-reset": _rfc3339(now + self.tokens_reset_ms
                                                                 / 1000)}
            return headers
        headers |= {"x-ratelimit-limit-requests": str(self.limit),
                    "x-ratelimit-remaining-requests": str(self.remaining),
                    "x-ratelimit-reset-requests": _duration(self.reset_s * 1000)}
        if self.tokens_limit:
            headers |= {"x-ratelimit-limit-tokens": str(self.tokens_limit),
                        "x-ratelimit-remaining-tokens": str(self.tokens_remaining),
                        "x-ratelimit-reset-tokens": _duration(self.tokens_reset_ms)}
        return headers


def _duration(ms: int) -> str:
    """OpenAI's spelling of a wait: "0s", "850ms", "6s", "1m30s"."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    minutes, seconds = divmod(math.ceil(ms / 1000), 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def _rfc3339(at: float) -> str:
    return utc_text(datetime.datetime.fromtimestamp(math.ceil(at), datetime.UTC))


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
        self._guest_tokens = counters.register_script(ledger.tokens_script.script)
        self._settling: set[asyncio.Task[None]] = set()
        self.failed_open = 0

    async def admit(self, principal: Principal, tier_name: str, tier: TierPolicy,
                    hold: Hold | None = None, *, tokens: int = 0, request_id: str = ""
                    ) -> Window:
        """Count this request, reserve its `tokens` (its worst case: the tier's token limits)
        and place its hold: 429, 402 or 503 when it may not run."""
        keys = AccountKeys.of(principal.account)
        limit = tier.requests_per_minute
        tpm, tpd = tier.tokens_per_minute or 0, tier.tokens_per_day or 0
        if not (tpm or tpd):
            tokens = 0
        window_keys = [keys.window(tier_name), *keys.tokens(tier_name),
                       keys.reservation(request_id)]
        args = [limit, WINDOW_MS, hold.hold_id if hold else "", hold.amount if hold else 0,
                hold.ttl_s if hold else 0, SERVER_RUN, tokens, tpm, tpd]
        try:
            if principal.kind == "guest":
                answer = await self._guests.call(self._guest_admit, window_keys, args)
            else:
                await self._index(principal.account)
                answer = await self._keyed.call(
                    self._admit, [*window_keys, keys.balance, keys.holds, keys.hold_expiry,
                                  *keys.budgets, *keys.alerts], [*args, principal.key_id or ""])
        except StoreBusy:
            raise GatewayError(ErrorKind.UNAVAILABLE, "the gateway is busy; try again shortly",
                               headers={"Retry-After": "1"}) from None
        except RedisError:
            if principal.kind != "guest":
                raise store_unavailable("credit ledger") from None
            return await self._store_down(tier_name, tier, principal.account)
        status, remaining, reset_ms, available, tokens_left, tokens_reset = (
            int(x) for x in answer[:6])
        window = Window(limit, max(0, remaining), max(0, math.ceil(reset_ms / 1000)),
                        tokens_limit=tpm or tpd, tokens_remaining=max(0, tokens_left),
                        tokens_reset_ms=max(0, tokens_reset))
        if status == LIMITED:
            raise rate_limited(window, f"the {tier_name} tier allows {limit} requests per minute")
        if status == TOKEN_LIMITED:
            per = (f"{tpm} tokens a minute" if tpm else "") + (" and " if tpm and tpd else "") + (
                f"{tpd} tokens a day" if tpd else "")
            if tokens_reset < 0:
                raise GatewayError(  # never fits: the clients' retries would be in vain
                    ErrorKind.RATE_LIMITED,
                    f"this request may use up to {tokens} tokens (its prompt and max_tokens), "
                    f"more than the {tier_name} tier's {per}; ask for fewer",
                    headers={**window.headers(), "x-should-retry": "false"})
            raise rate_limited(window, f"the {tier_name} tier allows {per}, and this request "
                               f"may use up to {tokens}", wait_ms=tokens_reset)
        if status == INSUFFICIENT and hold is not None:
            raise InsufficientCredits(int(available), hold.amount)
        if status == OVER_BUDGET and hold is not None:
            cap = answer[6].decode() if isinstance(answer[6], bytes) else str(answer[6])
            raise BudgetExceeded(cap, int(available), hold.amount)
        # DUPLICATE_HOLD: the script ran twice (its first reply was lost and the client
        # retried): the hold is ours, placed by the first run.
        return window

    async def tokens_used(self, principal: Principal, tier_name: str) -> tuple[int, int]:
        """Tokens in the caller's minute and day windows now (reserved by requests in flight
        or used), read without changing them (for /v2/account)."""
        keys = AccountKeys.of(principal.account).tokens(tier_name)
        store = (self._counters if principal.kind == "guest" else self._ledger.primaries).store
        now = time.time()
        used = []
        for (hash_key, buckets), (size, span) in zip((keys[:2], keys[2:]), TOKEN_WINDOWS,
                                                     strict=True):
            live = [bucket for bucket in await store.zrangebyscore(
                buckets, int(now // size) - span, "+inf") if isinstance(bucket, bytes | str)]
            counts = await store.hmget(hash_key, live) if live else []
            used.append(sum(int(c) for c in counts if c is not None))
        return used[0], used[1]

    def settle_tokens(self, principal: Principal, tier_name: str, request_id: str,
                      used: int) -> None:
        """A guest's tokens: put the engine's count (`used`) in the place of what
        `request_id` reserved, in the background (a keyed account's are settled with its
        charge, settle.lua). One that is lost leaves the reservation counted until it leaves
        the window: a limit reached early, never passed."""
        keys = AccountKeys.of(principal.account)
        task = asyncio.get_running_loop().create_task(self._correct(
            [*keys.tokens(tier_name), keys.reservation(request_id)], used))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _correct(self, keys: list[str], used: int) -> None:
        with contextlib.suppress(RedisError):
            await self._guests.call(self._guest_tokens, keys, [used])

    async def close(self) -> None:
        if self._settling:
            await asyncio.wait(self._settling, timeout=2)
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


def rate_limited(window: Window, message: str, *, wait_ms: int | None = None) -> GatewayError:
    """429 with the wait the official clients honour: Retry-After (whole seconds) and
    retry-after-ms."""
    ms = max(1, wait_ms) if wait_ms is not None else max(1, window.reset_s) * 1000
    wait = max(1, math.ceil(ms / 1000))
    return GatewayError(ErrorKind.RATE_LIMITED, f"{message}; retry in {wait} s",
                        headers={**window.headers(), "Retry-After": str(wait),
                                 "retry-after-ms": str(ms)})
