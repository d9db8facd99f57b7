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
from collections import Counter
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from proxy.config import ShadowPolicies
from proxy.credits.ledger import as_text
from proxy.credits.pricing import format_credits
from proxy.credits.shadow_windows import Ask, ShadowWindows
from proxy.identity.principal import Principal
from proxy.observe.access_log import AccessLog
from proxy.observe.metrics import Metrics
from proxy.observe.trace import Trace
from proxy.policy.shadow import (
    ADMITTED,
    Rule,
    Seen,
    Verdict,
    after_limits,
    before_limits,
    live_decision,
    rule_for,
    shadow_charge,
    tokens_used,
)
from proxy.store.client import Store

log = logging.getLogger("proxy.policy.shadowing")

BATCH_S = 0.05  # verdicts gather this long, then their limits are counted in one write
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
        # fingerprint -> ("d", tier, live, shadow, reason) | ("lc" | "sc", tier) -> amount
        self._tallies: dict[str, Counter[tuple[str, ...]]] = {}
        self._rules: dict[tuple[str, ...], Rule] = {}
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
        judged: list[tuple[_Pending, Rule, Verdict | None]] = []
        asks: list[Ask] = []
        for p in batch:
            rule = self._rule(p.shadowed.shadow, p.seen)
            before = before_limits(rule, p.seen)
            judged.append((p, rule, before))
            if rule.tier is not None:
                prompt, completion = tokens_used(p.units)
                asks.append(Ask(p.shadowed.principal, p.seen.tier, rule.tier, rule.windows,
                                prompt, completion, check_tokens=before is None))
        answers = iter(await self._windows.count(asks) if asks else [])
        for p, rule, before in judged:
            verdict = before
            if rule.tier is not None:
                answer = next(answers)
                if answer is None:
                    answer = (True, None)  # judged without its limits
                    self._unreachable()
                verdict = after_limits(p.seen.tier, rule.tier, p.live, before, *answer)
            assert verdict is not None
            self._verdict(p, rule, verdict)

    def _rule(self, shadow: ShadowPolicies, seen: Seen) -> Rule:
        key = (shadow.fingerprint, seen.tier, seen.family, seen.model, seen.mode)
        rule = self._rules.get(key)
        if rule is None:
            if len(self._rules) > 10_000:  # shadow sets come and go: keep the recent ones
                self._rules.clear()
            rule = self._rules[key] = rule_for(shadow.policies, seen)
        return rule

    def _unreachable(self) -> None:
        self.unreachable += 1
        if self.unreachable == 1 or self.unreachable % 1000 == 0:
            log.warning("shadow limits: the store is unreachable; judging without them "
                        "(%d so far)", self.unreachable)

    def _verdict(self, p: _Pending, rule: Rule, verdict: Verdict) -> None:
        charge = shadow_charge(rule, p.seen, verdict, p.units)
        live = "admitted" if p.live == ADMITTED else str(p.live)
        shadow = "admitted" if verdict.decision == ADMITTED else str(verdict.decision)
        tier = p.seen.tier
        self._metrics.shadow_judged(tier, live, shadow, verdict.reason, p.live_credits, charge)
        tally = self._tallies.get(p.shadowed.shadow.fingerprint)
        if tally is None:
            tally = self._tallies[p.shadowed.shadow.fingerprint] = Counter()
        tally["d", tier, live, shadow, verdict.reason] += 1
        if p.live_credits:
            tally["lc", tier] += p.live_credits
        if charge:
            tally["sc", tier] += charge
        if p.line is not None:
            field: dict[str, Any] = {"decision": verdict.decision}
            if verdict.reason:
                field |= {"reason": verdict.reason, "message": verdict.message}
            if charge:
                field["credits"] = format_credits(charge)
            p.line["shadow"] = field
            self._access_log.put(p.line)

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
                        pipe.hincrby(key, "|".join(name), amount)
                    pipe.expire(key, SUMMARY_TTL_S)
                    await pipe.execute()
            except RedisError:  # kept for the next flush
                self._tallies.setdefault(fingerprint, Counter()).update(tally)

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
    found = {as_text(k): as_text(v)
             for k, v in (await redis.hgetall(summary_key(fingerprint))).items()}
    by_tier: dict[str, dict[str, Any]] = {}

    def tier(name: str) -> dict[str, Any]:
        return by_tier.setdefault(name, {"requests": 0, "disagreements": 0, "decisions": [],
                                         "live_micro_credits": 0, "shadow_micro_credits": 0})

    for name, value in sorted(found.items()):
        kind, _, rest = name.partition("|")
        if kind in ("lc", "sc"):
            tier(rest)["live_micro_credits" if kind == "lc" else "shadow_micro_credits"] = \
                int(value)
        elif kind == "d":
            tier_name, live, judged, reason = rest.split("|")
            entry = tier(tier_name)
            entry["decisions"].append({"live": live, "shadow": judged, "reason": reason,
                                       "count": int(value)})
            entry["requests"] += int(value)
            if live != judged:
                entry["disagreements"] += int(value)
    since = found.get("since")
    return {"since": float(since) if since else None,
            "requests": sum(t["requests"] for t in by_tier.values()),
            "disagreements": sum(t["disagreements"] for t in by_tier.values()),
            "by_tier": by_tier}

