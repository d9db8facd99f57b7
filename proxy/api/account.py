"""What account holders see of their credits and usage. Both routes count against the caller's
rate limit like any request (they read the store, so they must not be free to hammer).

    GET  /v2/account        tier, balance (available / held / spent), rate limit left, the
                            token windows (the tier's and each model group's: kind, period,
                            limit, used, remaining),
                            the budgets (the account's and the key's: limit, spent, held,
                            remaining, when it resets)
    GET  /v2/account/usage  totals, per model, per day (running totals the settlement keeps), and
                            one page of the journal (`?limit=50&before=<id>`)
"""

from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from typing import Any

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.appkeys import ADMITTER, LEDGER, LIVE, RESPONSE_HEADERS
from proxy.credits.budgets import Budget, budgets, utc_text
from proxy.credits.pricing import format_credits
from proxy.credits.token_windows import ALL_MODELS, all_token_windows
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.identity.principal import Principal
from proxy.policy.tiers import tier_of

PAGE_MAX = 200
ENTRY_ID_PATTERN = r"([0-9]{1,20})-([0-9]{1,20})"  # a journal (Redis Stream) entry id
_ENTRY_ID = re.compile(ENTRY_ID_PATTERN)
_UJSON_INT_MAX = 2**64 - 1
_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "characters", "images", "cost")
_SECONDS = {"audio_ms": "audio_seconds", "video_ms": "video_seconds"}  # kept in ms


async def _caller(request: web.Request) -> Principal:
    """A keyed caller, counted against its tier's rate (429 past it)."""
    snapshot = request.app[LIVE].current
    principal = await snapshot.auth.principal(request.headers, request.remote)
    if principal.kind == "guest":
        raise GatewayError(ErrorKind.INVALID_API_KEY, "an API key or token is required")
    tier = tier_of(snapshot.policies.tiers, principal.tier)
    window = await request.app[ADMITTER].count(principal, principal.tier, tier)
    request[RESPONSE_HEADERS] = window.headers()
    return principal


def _money(micro: int) -> dict[str, Any]:
    return {"credits": format_credits(micro), "micro_credits": micro}


def budget_view(budget: Budget) -> dict[str, Any]:
    """One budget as /v2/account and the admin API show it."""
    return {"scope": budget.scope, "key_id": budget.key_id, "period": budget.period,
            "limit": _money(budget.limit), "spent": _money(budget.spent),
            "held": _money(budget.held), "remaining": _money(budget.remaining),
            "resets_at": utc_text(budget.resets_at)}


async def account(request: web.Request) -> web.Response:
    principal = await _caller(request)
    snapshot = request.app[LIVE].current
    try:
        balance = await request.app[LEDGER].balance(principal.account)
        caps, spent, held = await request.app[LEDGER].budgets(principal.account)
    except RedisError:
        raise store_unavailable("account store") from None
    limits = request[RESPONSE_HEADERS]
    tier = snapshot.policies.tiers.tiers.get(principal.tier)
    windows = all_token_windows(tier) if tier is not None else ()
    try:
        used = await request.app[ADMITTER].tokens_used(principal, principal.tier, windows)
    except RedisError:
        raise store_unavailable("account store") from None
    tokens = [{"group": None if w.scope == ALL_MODELS else w.scope, "kind": w.kind,
               "period": w.period, "limit": w.limit, "used": n,
               "remaining": max(0, w.limit - n)} for w, n in zip(windows, used, strict=True)]
    return _json({
        "account": principal.account,
        "tier": principal.tier,
        "key_id": principal.key_id,
        "balance": {"available": _money(balance.available), "held": _money(balance.held),
                    "spent": _money(balance.spent), "credited": _money(balance.credited)},
        "rate_limit": {"limit": int(limits["X-RateLimit-Limit"]),
                       "remaining": int(limits["X-RateLimit-Remaining"]),
                       "reset_s": int(limits["X-RateLimit-Reset"]), "per": "minute"},
        # chat tokens in each of the tier's windows (reserved by requests in flight, or used):
        # the tier's own (group null) and each model group's
        "token_limits": tokens,
        # spend caps that reset: the account's and this key's
        "budgets": [budget_view(b) for b in budgets(caps, spent, held, time.time(),
                                                    principal.key_id or "")],
        "postpaid": caps.get("postpaid") == "1",
        "price_version": snapshot.policies.prices.version,
    })


async def usage(request: web.Request) -> web.Response:
    """Totals and breakdowns, then the journal newest first, a page at a time."""
    principal = await _caller(request)
    limit = _page_size(request.query.get("limit", "50"))
    before = _entry_id(request.query.get("before") or None)
    ledger = request.app[LEDGER]
    try:
        totals = await ledger.usage_totals(principal.account)
        # Nothing precedes the smallest id (and Redis refuses an exclusive range below it).
        page = [] if before == "0-0" else \
            await ledger.entries(principal.account, before=before, count=limit)
    except RedisError:
        raise store_unavailable("account store") from None
    return _json({
        "account": principal.account,
        **summarize(totals),
        "entries": [{"id": entry_id, **fields} for entry_id, fields in page],
        "next_before": page[-1][0] if len(page) == limit else None,
    })


def _entry_id(text: str | None) -> str | None:
    """A journal (Redis Stream) entry id, checked here: Redis refuses a malformed one, and that
    is the caller's fault, not an outage of the store."""
    if text is None:
        return None
    match = _ENTRY_ID.fullmatch(text)
    if match is None:
        raise GatewayError(ErrorKind.INVALID_REQUEST,
                           "before must be the next_before of a previous page")
    ms, seq = int(match[1]), int(match[2])
    if ms > _UJSON_INT_MAX:  # later than any id Redis can hold: every entry precedes it
        return None
    return f"{ms}-{min(seq, _UJSON_INT_MAX)}"


def _page_size(text: str) -> int:
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= PAGE_MAX:
        raise GatewayError(ErrorKind.INVALID_REQUEST,
                           f"limit must be a whole number from 1 to {PAGE_MAX}")
    return limit


def summarize(totals: dict[str, int]) -> dict[str, Any]:
    """The settle script's running totals (`m|<model>|…`, `d|<day>|…`) as the API shows them;
    the all-time totals are the days' sum. Pure."""
    scopes: dict[str, dict[str, int]] = defaultdict(dict)
    everything: Counter[str] = Counter()
    for field, value in totals.items():
        scope, _, name = field.rpartition("|")
        scopes[scope][name] = value
        if scope.startswith("d|"):
            everything[name] += value
    by_model = {scope[2:]: _view(v) for scope, v in sorted(scopes.items())
                if scope.startswith("m|")}
    by_day = {time.strftime("%Y-%m-%d", time.gmtime(int(scope[2:]) * 86400)): _view(v)
              for scope, v in sorted(scopes.items(), key=lambda kv: kv[0])
              if scope.startswith("d|")}
    return {"totals": _view(everything), "by_model": by_model,
            "by_day": dict(sorted(by_day.items()))}


def _view(counts: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {name: counts.get(name, 0) for name in _FIELDS}
    for ms, seconds in _SECONDS.items():
        out[seconds] = counts.get(ms, 0) / 1000
    out["cost"] = _money(out["cost"])
    return out


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
