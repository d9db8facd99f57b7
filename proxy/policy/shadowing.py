"""The shadow policies at work (their decisions: proxy.policy.shadow). Once a request's answer
is out, the middleware hands it here with its access-log line. In the background, with the
others that ended within BATCH_S, the shadow's limits are counted (proxy.credits.shadow_windows:
one write per primary for the batch), and each verdict is counted in the metrics
(`igw_shadow_decisions_total`, `igw_shadow_credits_total`), written into its line
(`shadow: {"decision", "reason", "message", "credits"}`) and tallied for /admin/shadow: the
request waits for none of it, and its line goes out a few milliseconds after the others.

The tallies (requests judged; live and shadow decisions with the shadow's reason; credits live
and shadow; each per tier) are summed in this process and added to one Redis hash a second,
`igw:shadow:<fingerprint>`, shared by every worker and gateway: the fingerprint is of the live
and shadow tiers and prices, so a changed shadow (or a promoted one) starts afresh, and
`since` is when the first worker judged under it. The hash lasts 30 days after its last
update.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from proxy.config import ShadowPolicies
from proxy.credits.pricing import format_credits
from proxy.credits.shadow_windows import Ask, Counted, ShadowWindows
from proxy.credits.token_windows import WindowsByTier
from proxy.identity.principal import Principal
from proxy.observe.access_log import AccessLog
from proxy.observe.metrics import Metrics
from proxy.observe.trace import Trace
from proxy.policy.shadow import (
    ADMITTED,
    Seen,
    Verdict,
    after_limits,
    before_limits,
    live_decision,
    shadow_charge,
    tokens_used,
)
from proxy.store.client import Store

log = logging.getLogger("proxy.policy.shadowing")

BATCH_S = 0.01  # verdicts gather this long, then their limits are counted in one write
FLUSH_S = 1.0
SUMMARY_TTL_S = 30 * 86400


@dataclass(frozen=True, slots=True)
class Shadowed:
    """A request the shadow will judge: the set in force when it arrived, and its caller."""

    shadow: ShadowPolicies
    principal: Principal


SHADOWED = web.RequestKey("shadowed", Shadowed)


def summary_key(fingerprint: str) -> str:
    return f"igw:shadow:{fingerprint}"


@dataclass(frozen=True, slots=True)
class _Pending:
    shadowed: Shadowed
    seen: Seen
    live: int  # the live decision
    units: dict[str, int]
    live_credits: int
    line: dict[str, Any] | None


class Shadow:
    def __init__(self, windows: ShadowWindows, redis: Store, metrics: Metrics,
                 access_log: AccessLog) -> None:
        self._windows = windows
        self._redis = redis
        self._metrics = metrics
        self._access_log = access_log
        self._pending: list[_Pending] = []
        self._timer: asyncio.TimerHandle | None = None
        self._judging: set[asyncio.Task[None]] = set()
        self._tallies: dict[str, dict[str, int]] = {}  # fingerprint -> field -> amount
        self._token_windows: dict[str, WindowsByTier] = {}  # by fingerprint
        self.unreachable = 0  # verdicts given without the limits (Redis unreachable)

    def judge(self, shadowed: Shadowed, trace: Trace, status: int,
              line: dict[str, Any] | None) -> bool:
        """Judge the request in the background (with the others that ended within BATCH_S)
        and write its access-log `line` (None: the log is off) with the verdict; False when it
        is not one to judge (the line is the caller's to write)."""
        live = live_decision(trace.admitted, status, trace.error)
        if live is None or trace.tier is None or trace.model is None or trace.family is None:
            return False
        seen = Seen(trace.tier, trace.family, trace.model, trace.mode or "direct",
                    trace.asked_tokens, trace.waiting)
        self._pending.append(_Pending(shadowed, seen, live, trace.units,
                                      trace.charged, line))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(BATCH_S, self._start)
        return True

    def _start(self) -> None:
        self._timer = None
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._judge(batch))
        self._judging.add(task)
        task.add_done_callback(self._judging.discard)

    async def _judge(self, batch: list[_Pending]) -> None:
        befores = [before_limits(p.shadowed.shadow.policies, p.seen) for p in batch]
        asks: list[Ask] = []
        asked: dict[int, int] = {}  # the batch's index -> its ask's
        for i, (p, before) in enumerate(zip(batch, befores, strict=True)):
            policies = p.shadowed.shadow.policies
            tier = policies.tiers.tiers.get(p.seen.tier)
            if tier is None:
                continue
            windows = self._token_windows.setdefault(
                p.shadowed.shadow.fingerprint, WindowsByTier()).of(
                p.seen.tier, tier, policies.tiers.group_of(p.seen.model))
            prompt, completion = tokens_used(p.units)
            asked[i] = len(asks)
            asks.append(Ask(p.shadowed.principal, p.seen.tier, tier, windows, prompt,
                            completion, check_tokens=before is None))
        counted: list[Counted] = await self._windows.count(asks) if asks else []
        for i, (p, before) in enumerate(zip(batch, befores, strict=True)):
            verdict = before
            if i in asked:
                ask, answer = asks[asked[i]], counted[asked[i]]
                if answer is None:
                    answer = (True, None)  # judged without its limits
                    self._unreachable()
                verdict = after_limits(p.seen.tier, ask.tier, p.live, before, *answer)
            assert verdict is not None
            self._verdict(p, verdict)

    def _unreachable(self) -> None:
        self.unreachable += 1
        if self.unreachable == 1 or self.unreachable % 1000 == 0:
            log.warning("shadow limits: the store is unreachable; judging without them "
                        "(%d so far)", self.unreachable)

    def _verdict(self, p: _Pending, verdict: Verdict) -> None:
        shadow = p.shadowed.shadow
        charge = shadow_charge(shadow.policies, p.seen, verdict, p.units)
        self._count(shadow.fingerprint, p.seen.tier, p.live, verdict, p.live_credits, charge)
        if p.line is not None:
            field: dict[str, Any] = {"decision": verdict.decision}
            if verdict.reason:
                field |= {"reason": verdict.reason, "message": verdict.message}
            if charge:
                field["credits"] = format_credits(charge)
            p.line["shadow"] = field
            self._access_log.put(p.line)

    def _count(self, fingerprint: str, tier: str, live: int, verdict: Verdict,
               live_credits: int, charge: int) -> None:
        shown = "admitted" if live == ADMITTED else str(live)
        judged = "admitted" if verdict.decision == ADMITTED else str(verdict.decision)
        self._metrics.shadow_judged(tier, shown, judged, verdict.reason, live_credits, charge)
        tally = self._tallies.setdefault(fingerprint, {})
        for name, amount in ((f"n|{tier}", 1), (f"d|{tier}|{shown}|{judged}|{verdict.reason}", 1),
                             (f"lc|{tier}", live_credits), (f"sc|{tier}", charge)):
            if amount:
                tally[name] = tally.get(name, 0) + amount

    async def run(self) -> None:
        """Add the tallies to Redis every FLUSH_S (a task for the app's lifetime)."""
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()

    async def flush(self) -> None:
        tallies, self._tallies = self._tallies, {}
        for fingerprint, tally in tallies.items():
            key = summary_key(fingerprint)
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.hsetnx(key, "since", repr(time.time()))
                    for name, amount in tally.items():
                        pipe.hincrby(key, name, amount)
                    pipe.expire(key, SUMMARY_TTL_S)
                    await pipe.execute()
            except RedisError:  # kept for the next flush
                mine = self._tallies.setdefault(fingerprint, {})
                for name, amount in tally.items():
                    mine[name] = mine.get(name, 0) + amount

    async def close(self) -> None:
        """Finish the verdicts under way (their lines) and add the last tallies."""
        if self._timer is not None:
            self._timer.cancel()
            self._start()
        if self._judging:
            await asyncio.wait(self._judging, timeout=2)
        with contextlib.suppress(RedisError):
            await self.flush()
        await self._windows.close()


async def summary(redis: Store, fingerprint: str) -> dict[str, Any]:
    """What every worker judged under the shadow set `fingerprint`, since it was loaded."""
    found = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes)
                                                           else v)
             for k, v in (await redis.hgetall(summary_key(fingerprint))).items()}
    by_tier: dict[str, dict[str, Any]] = {}

    def tier(name: str) -> dict[str, Any]:
        return by_tier.setdefault(name, {"requests": 0, "disagreements": 0, "decisions": [],
                                         "live_micro_credits": 0, "shadow_micro_credits": 0})

    for name, value in sorted(found.items()):
        kind, _, rest = name.partition("|")
        if kind == "n":
            tier(rest)["requests"] = int(value)
        elif kind in ("lc", "sc"):
            tier(rest)["live_micro_credits" if kind == "lc" else "shadow_micro_credits"] = \
                int(value)
        elif kind == "d":
            name_, live, judged, reason = rest.split("|")
            entry = tier(name_)
            entry["decisions"].append({"live": live, "shadow": judged, "reason": reason,
                                       "count": int(value)})
            if live != judged:
                entry["disagreements"] += int(value)
    since = found.get("since")
    return {"since": float(since) if since else None,
            "requests": sum(t["requests"] for t in by_tier.values()),
            "disagreements": sum(t["disagreements"] for t in by_tier.values()),
            "by_tier": by_tier}

