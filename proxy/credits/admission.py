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
from proxy.credits.ledger import ACCOUNTS, AccountKeys, InsufficientCredits, Ledger, Reserved
from proxy.credits.token_windows import BUCKETS, TokenWindow, tightest
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.identity.principal import Principal
from proxy.store.client import Primaries, Store, StoreBusy
from proxy.store.script_pipe import SERVER_RUN, ScriptPipes

log = logging.getLogger("proxy.credits.admission")

WINDOW_MS = 60_000
ADMITTED, LIMITED, INSUFFICIENT, DUPLICATE_HOLD, TOKEN_LIMITED, OVER_BUDGET = 1, 0, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class Window:
    """The caller's rate-limit windows as this request left them."""

    limit: int
    remaining: int
    reset_s: int  # seconds until the window frees a slot
    degraded: bool = False  # decided by the per-process fallback (Redis unreachable)
    tokens: tuple[tuple[TokenWindow, int], ...] = ()  # each token window, tokens remaining
    tokens_reset_ms: int = 0  # until the token window has room again (0: it has now)

    def headers(self, style: str = "") -> dict[str, str]:
        """Today's X-RateLimit-* and the ones the official clients read: OpenAI's
        x-ratelimit-* (durations), or Anthropic's anthropic-ratelimit-* (RFC 3339 times) for
        the Messages route. Token figures are the tightest window's (of each kind, for
        Anthropic's input and output tokens)."""
        headers = {
            "X-RateLimit-Limit": str(self.limit),
            "X-RateLimit-Remaining": str(self.remaining),
            "X-RateLimit-Reset": str(self.reset_s),
        }
        tightest_any = tightest(self.tokens, ("tokens", "input_tokens", "output_tokens"))
        if style == "anthropic":
            now = time.time()
            headers |= {"anthropic-ratelimit-requests-limit": str(self.limit),
                        "anthropic-ratelimit-requests-remaining": str(self.remaining),
                        "anthropic-ratelimit-requests-reset": _rfc3339(now + self.reset_s)}
            reset = _rfc3339(now + self.tokens_reset_ms / 1000)
            for name, pair in (("tokens", tightest_any),
                               ("input-tokens", tightest(self.tokens, ("input_tokens",))),
                               ("output-tokens", tightest(self.tokens, ("output_tokens",)))):
                if pair is not None:
                    headers |= {f"anthropic-ratelimit-{name}-limit": str(pair[0].limit),
                                f"anthropic-ratelimit-{name}-remaining": str(pair[1]),
                                f"anthropic-ratelimit-{name}-reset": reset}
            return headers
        headers |= {"x-ratelimit-limit-requests": str(self.limit),
                    "x-ratelimit-remaining-requests": str(self.remaining),
                    "x-ratelimit-reset-requests": _duration(self.reset_s * 1000)}
        if tightest_any is not None:
            headers |= {"x-ratelimit-limit-tokens": str(tightest_any[0].limit),
                        "x-ratelimit-remaining-tokens": str(tightest_any[1]),
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
                    hold: Hold | None = None, *, windows: tuple[TokenWindow, ...] = (),
                    prompt: int = 0, completion: int = 0, request_id: str = "") -> Window:
        """Count this request, reserve its worst case (`prompt`, `completion`) in its token
        `windows` and place its hold: 429, 402 or 503 when it may not run."""
        keys = AccountKeys.of(principal.account)
        limit = tier.requests_per_minute
        window_keys = [keys.window(tier_name), keys.reservation(request_id)]
        args: list[object] = [limit, WINDOW_MS, hold.hold_id if hold else "",
                                 hold.amount if hold else 0, hold.ttl_s if hold else 0,
                                 SERVER_RUN, prompt if windows else 0,
                                 completion if windows else 0, principal.key_id or ""]
        token_keys: list[str] = []
        for w in windows:
            token_keys.append(keys.token_window(tier_name, w.suffix))
            args += (w.code, w.limit)
        try:
            if principal.kind == "guest":
                answer = await self._guests.call(self._guest_admit,
                                                 [*window_keys, *token_keys], args)
            else:
                await self._index(principal.account)
                answer = await self._keyed.call(
                    self._admit, [*window_keys, keys.balance, keys.holds, keys.hold_expiry,
                                  *keys.budgets, *keys.alerts, *token_keys], args)
        except StoreBusy:
            raise GatewayError(ErrorKind.UNAVAILABLE, "the gateway is busy; try again shortly",
                               headers={"Retry-After": "1"}) from None
        except RedisError:
            if principal.kind != "guest":
                raise store_unavailable("credit ledger") from None
            return await self._store_down(tier_name, tier, principal.account)
        status, remaining, reset_ms, available = (int(x) for x in answer[:4])
        tokens_reset, refusing = int(answer[5]), int(answer[7])
        window = Window(limit, max(0, remaining), max(0, math.ceil(reset_ms / 1000)),
                        tokens=tuple((w, max(0, int(left))) for w, left in zip(
                            windows, answer[4], strict=False)),
                        tokens_reset_ms=max(0, tokens_reset))
        if status == LIMITED:
            raise rate_limited(window, f"the {tier_name} tier allows {limit} requests per minute")
        if status == TOKEN_LIMITED:
            binding = windows[refusing - 1]
            tokens = binding.reserve(prompt, completion)
            if tokens_reset < 0:
                raise GatewayError(  # never fits: the clients' retries would be in vain
                    ErrorKind.RATE_LIMITED,
                    f"this request may use up to {tokens} {binding.kind.replace('_', ' ')} "
                    f"(its prompt and max_tokens), more than the {tier_name} tier's "
                    f"{binding.describe()}; ask for fewer",
                    headers={**window.headers(), "x-should-retry": "false"})
            raise rate_limited(window, f"the {tier_name} tier allows {binding.describe()}, and "
                               f"this request may use up to {tokens}", wait_ms=tokens_reset)
        if status == INSUFFICIENT and hold is not None:
            raise InsufficientCredits(int(available), hold.amount)
        if status == OVER_BUDGET and hold is not None:
            cap = answer[6].decode() if isinstance(answer[6], bytes) else str(answer[6])
            raise BudgetExceeded(cap, int(available), hold.amount)
        # DUPLICATE_HOLD: the script ran twice (its first reply was lost and the client
        # retried): the hold is ours, placed by the first run.
        return window

    async def tokens_used(self, principal: Principal, tier_name: str,
                          windows: tuple[TokenWindow, ...]) -> list[int]:
        """Tokens in each of the caller's windows now (reserved by requests in flight or
        used), read without changing them (for /v2/account)."""
        keys = AccountKeys.of(principal.account)
        store = (self._counters if principal.kind == "guest" else self._ledger.primaries).store
        now = time.time()
        used = []
        for w in windows:
            size, span = BUCKETS[w.period]
            cutoff = int(now // size) - span
            buckets = await store.hgetall(keys.token_window(tier_name, w.suffix))
            used.append(sum(int(count) for bucket, count in buckets.items()
                            if bucket.isdigit() and int(bucket) >= cutoff))
        return used

    def settle_tokens(self, principal: Principal, reserved: Reserved) -> None:
        """A guest's tokens: put the engine's counts in the place of what the request
        reserved, in the background (a keyed account's are settled with its charge,
        settle.lua). One that is lost leaves the reservation counted until it leaves the
        window: a limit reached early, never passed."""
        keys = reserved.keys(AccountKeys.of(principal.account))
        task = asyncio.get_running_loop().create_task(self._correct(
            keys, reserved.prompt, reserved.completion))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _correct(self, keys: list[str], prompt: int, completion: int) -> None:
        with contextlib.suppress(RedisError):
            await self._guests.call(self._guest_tokens, keys, [prompt, completion])

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
            if len(self._indexed) > 100_000:
                self._indexed.clear()
            self._indexed.add(account)  # first: a burst on a new account sends one SADD
            try:
                await self._ledger.redis.sadd(ACCOUNTS, account)
            except RedisError:
                self._indexed.discard(account)
                raise

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
