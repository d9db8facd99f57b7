"""What account holders see of their credits and usage.

    GET  /v2/account                    tier, balance (available / held / spent), rate limit left
    GET  /v2/account/usage              totals, per model, per day, and the journal (paginated)
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from typing import Any

import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.appkeys import LEDGER, LIMITER, LIVE, RESPONSE_HEADERS
from proxy.credits.ledger import Ledger
from proxy.credits.pricing import format_credits
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.identity.principal import Principal
from proxy.policy.tiers import tier_of

PAGE_MAX = 200
ENTRY_ID_PATTERN = r"([0-9]{1,20})-([0-9]{1,20})"  # a journal (Redis Stream) entry id
_ENTRY_ID = re.compile(ENTRY_ID_PATTERN)
_UJSON_INT_MAX = 2**64 - 1
_ADMIN_BODY_CAP = 16 * 1024


async def _principal(request: web.Request) -> Principal:
    principal = await request.app[LIVE].current.auth.principal(request.headers, request.remote)
    if principal.kind == "guest":
        raise GatewayError(ErrorKind.INVALID_API_KEY, "an API key or token is required")
    return principal


def _money(micro: int) -> dict[str, Any]:
    return {"credits": format_credits(micro), "micro_credits": micro}


async def account(request: web.Request) -> web.Response:
    principal = await _principal(request)
    snapshot = request.app[LIVE].current
    tier = tier_of(snapshot.policies.tiers, principal.tier)
    try:
        balance = await request.app[LEDGER].balance(principal.account)
        window = await request.app[LIMITER].peek(principal.tier, tier, principal.account)
    except RedisError:
        raise store_unavailable("account store") from None
    request[RESPONSE_HEADERS] = window.headers()
    return _json({
        "account": principal.account,
        "tier": principal.tier,
        "key_id": principal.key_id,
        "balance": {"available": _money(balance.available), "held": _money(balance.held),
                    "spent": _money(balance.spent), "credited": _money(balance.credited)},
        "rate_limit": {"limit": window.limit, "remaining": window.remaining,
                       "reset_s": window.reset_s, "per": "minute"},
        "price_version": snapshot.policies.prices.version,
    })


async def usage(request: web.Request) -> web.Response:
    """Totals and breakdowns over the journal's charges (newest page first)."""
    principal = await _principal(request)
    ledger: Ledger = request.app[LEDGER]
    limit = _page_size(request.query.get("limit", "50"))
    before = _entry_id(request.query.get("before") or None)
    try:
        everything = await ledger.all_entries(principal.account)
        # Nothing precedes the smallest id (and Redis refuses an exclusive range below it).
        page = [] if before == "0-0" else \
            await ledger.entries(principal.account, before=before, count=limit)
    except RedisError:
        raise store_unavailable("account store") from None
    return _json({
        "account": principal.account,
        **summarize(everything),
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


def summarize(entries: list[dict[str, str]]) -> dict[str, Any]:
    """Totals, per-model and per-day breakdowns of charges (pure)."""
    totals = _Tally()
    by_model: dict[str, _Tally] = defaultdict(_Tally)
    by_day: dict[str, _Tally] = defaultdict(_Tally)
    for entry in entries:
        if entry.get("type") != "charge" or "model" not in entry:
            continue
        day = time.strftime("%Y-%m-%d", time.gmtime(int(entry.get("ts", "0"))))
        for tally in (totals, by_model[entry["model"]], by_day[day]):
            tally.add(entry)
    return {
        "totals": totals.view(),
        "by_model": {model: t.view() for model, t in sorted(by_model.items())},
        "by_day": {day: t.view() for day, t in sorted(by_day.items())},
    }


class _Tally:
    __slots__ = ("completion", "cost", "prompt", "requests")

    def __init__(self) -> None:
        self.requests = self.prompt = self.completion = self.cost = 0

    def add(self, entry: dict[str, str]) -> None:
        self.requests += 1
        self.prompt += int(entry.get("prompt_tokens", "0"))
        self.completion += int(entry.get("completion_tokens", "0"))
        self.cost += int(entry.get("cost", "0"))

    def view(self) -> dict[str, Any]:
        return {"requests": self.requests, "prompt_tokens": self.prompt,
                "completion_tokens": self.completion, "cost": _money(self.cost)}


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
