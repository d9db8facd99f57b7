"""Shadow policies: what a candidate tiers.toml and prices.toml (policies/shadow/) would have
decided of each request the live policies just decided, never enforced. Pure: the facts the
request's path learned in, a `Verdict` out (the windows' counting is proxy.credits.shadow_windows,
the running of it all proxy.policy.shadowing).

The shadow judges in the gateway's order (DESIGN §6), each check it owns:

    its tier exists (403) -> access: family, model group, mode (403) -> the completion cap (403)
    -> the queue budget, against the engines' queues the live check read (503) -> the request
    rate (429) -> the token windows (429) -> admitted: priced at the shadow's prices

A request's rate and token windows are its own, in keys of their own. A shadow token window
counts what each request it admits used (the live one reserves the worst case until the
request ends): it may admit a little more than the live limit would, never refuse sooner.
Balances and budgets are the account's, not the policy's: a request the live gateway refused
for credits (402) is refused for them in the shadow too, once its own checks pass.

Judged: the requests the live gateway admitted or refused for a check the shadow has too
(402, 403, 429, 503 `pool_saturated`), once their model was known. One refused for what it
carried (400, 413, 422 ...) would be refused the same way by both: not judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec

from proxy.config import Policies, Rates, TierPolicy
from proxy.credits.pricing import Used, used_cost
from proxy.credits.token_windows import TokenWindow, token_windows
from proxy.identity.principal import GUEST_TIER
from proxy.policy.tiers import denial

ADMITTED = 200
# The live refusals the shadow has a check for: error type -> the status it came with.
_JUDGED = {"insufficient_credits": 402, "budget_exceeded": 402, "forbidden": 403,
           "rate_limited": 429, "pool_saturated": 503}


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: int  # ADMITTED, or the status the shadow would have answered
    reason: str = ""  # tier, access, max_tokens, queue_budget, rate, tokens, credits
    message: str = ""


class Facts(Protocol):
    """What a candidate's checks read of a request: the live path's `Seen`, or a replayed
    access-log line (proxy.policy.replay)."""

    @property
    def tier(self) -> str: ...
    @property
    def family(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def asked_tokens(self) -> int | None: ...
    @property
    def waiting(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Seen:
    """What the live path learned of one request, as the shadow needs it."""

    tier: str
    family: str
    model: str
    mode: str
    asked_tokens: int | None  # a chat request's own max_tokens
    waiting: float | None  # requests waiting per replica, as the queue-budget check read it


def live_decision(admitted: bool, status: int, error: str | None) -> int | None:
    """The live gateway's admission decision: ADMITTED, a refusal's status, or None when the
    request is not one to judge."""
    if admitted:
        return ADMITTED
    if error is not None and _JUDGED.get(error) == status:
        return status
    return None


@dataclass(frozen=True, slots=True)
class Rule:
    """What a shadow set says of one (tier, family, model, mode), worked out once."""

    tier: TierPolicy | None  # None: a tier the shadow lacks
    refused: Verdict | None  # the tier missing, or its access denied
    windows: tuple[TokenWindow, ...]  # the token windows such a request counts in
    rates: Rates


def rule_for(policies: Policies, seen: Facts, whose: str = "the shadow's") -> Rule:
    rates = policies.prices.for_model(seen.model, seen.mode)
    tier = policies.tiers.tiers.get(seen.tier)
    if tier is None:
        return Rule(None, Verdict(403, "tier", f"tier {seen.tier!r} is not in {whose} "
                                  "tiers.toml"), (), rates)
    refused = denial(policies.tiers, seen.tier, family=seen.family, model=seen.model,
                     mode=seen.mode)
    return Rule(tier, None if refused is None else Verdict(403, "access", refused),
                token_windows(tier, policies.tiers.group_of(seen.model)), rates)


def before_limits(rule: Rule, seen: Facts) -> Verdict | None:
    """The shadow's checks before its limits: a refusal, or None (the limits decide)."""
    tier = rule.tier
    if tier is None or rule.refused is not None:
        return rule.refused
    cap = tier.max_tokens_per_request
    if seen.family == "chat" and cap is not None and (seen.asked_tokens or 0) > cap:
        return Verdict(403, "max_tokens",
                       f"the {seen.tier} tier allows at most {cap} completion tokens a request")
    budget = tier.queue_budget
    if budget is not None and seen.waiting is not None and seen.waiting >= budget:
        return Verdict(503, "queue_budget",
                       f"{seen.waiting:g} requests wait per replica of {seen.model}, and the "
                       f"{seen.tier} tier queues only while fewer than {budget} do")
    return None


def after_limits(tier_name: str, tier: TierPolicy, live: int, before: Verdict | None,
                 counted: bool, refusing: TokenWindow | None) -> Verdict:
    """The verdict once the shadow's windows answered: `counted` False when its request rate
    was reached (a 429 beats the refusals before it, as live), `refusing` the token window the
    request did not fit in."""
    if not counted:
        return Verdict(429, "rate", f"the {tier_name} tier allows "
                       f"{tier.requests_per_minute} requests per minute")
    if before is not None:
        return before
    if refusing is not None:
        return Verdict(429, "tokens", f"the {tier_name} tier allows {refusing.describe()}")
    if live == 402:
        return Verdict(402, "credits", "refused live for the account's credits or budget")
    return Verdict(ADMITTED)


def tokens_used(units: Mapping[str, int]) -> tuple[int, int]:
    """(prompt, completion) tokens a settled request used, from its units."""
    return units.get("prompt_tokens", 0), units.get("completion_tokens", 0)


def shadow_charge(rule: Rule, seen: Seen, verdict: Verdict, units: Mapping[str, int]) -> int:
    """What the shadow charges (micro-credits): the request's units at its prices, when it
    admits it."""
    if verdict.decision != ADMITTED or seen.tier == GUEST_TIER or not units:
        return 0
    return used_cost(rule.rates, seen.family, msgspec.convert(units, Used))


def tier_fields(tier: TierPolicy | None) -> dict[str, object] | None:
    """A tier's settings as JSON (for /admin/shadow and the console)."""
    if tier is None:
        return None
    return dict(msgspec.to_builtins(tier))


def differences(live: TierPolicy | None, shadow: TierPolicy | None) -> list[str]:
    """The settings two versions of a tier set differently."""
    a, b = tier_fields(live) or {}, tier_fields(shadow) or {}
    return sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))
