"""What account holders see of their credits and usage, and how operators add credits.

    GET  /v2/account                    tier, balance (available / held / spent), rate limit left
    GET  /v2/account/usage              totals, per model, per day, and the journal (paginated)
    POST /admin/accounts/{id}/credits   top-up or adjustment (admin), journaled like any charge
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import msgspec
import orjson
from aiohttp import web
from redis.exceptions import RedisError

from proxy.appkeys import LEDGER, LIMITER, LIVE, RESPONSE_HEADERS
from proxy.errors import ErrorKind, GatewayError, validation_failed
from proxy.identity import Principal
from proxy.ledger import InsufficientCredits, Ledger
from proxy.policy import tier_of
from proxy.pricing import format_credits, parse_credits
from proxy.request_body import parse_json_object, read_capped
from proxy.validate import RequestInvalid, validate

PAGE_MAX = 200
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
        raise GatewayError(ErrorKind.UNAVAILABLE, "the account store is unreachable",
                           headers={"Retry-After": "5"}) from None
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
    try:
        limit = min(PAGE_MAX, max(1, int(request.query.get("limit", "50"))))
    except ValueError:
        raise GatewayError(ErrorKind.INVALID_REQUEST, "limit must be a whole number") from None
    before = request.query.get("before") or None
    try:
        everything = await ledger.all_entries(principal.account)
        page = await ledger.entries(principal.account, before=before, count=limit)
    except RedisError:
        raise GatewayError(ErrorKind.UNAVAILABLE, "the account store is unreachable",
                           headers={"Retry-After": "5"}) from None
    return _json({
        "account": principal.account,
        **summarize(everything),
        "entries": [{"id": entry_id, **fields} for entry_id, fields in page],
        "next_before": page[-1][0] if len(page) == limit else None,
    })


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


class CreditBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    amount: str  # credits as a decimal string ("12.5"), never a float
    reason: str = "top-up"


async def add_credits(request: web.Request) -> web.Response:
    """POST /admin/accounts/{id}/credits {amount, reason}: a top-up, or a negative adjustment."""
    from proxy.admin_api import require_admin  # the admin routes' one authorization rule

    await require_admin(request)
    body = parse_json_object(await read_capped(request, _ADMIN_BODY_CAP))
    try:
        spec = validate(body, CreditBody)
        micro = parse_credits(spec.amount)
    except RequestInvalid as exc:
        raise validation_failed(exc.detail) from None
    except ValueError as exc:
        raise validation_failed([{"loc": ["body", "amount"], "msg": str(exc),
                                  "type": "value_error"}]) from None
    account_id = request.match_info["account"]
    try:
        available = await request.app[LEDGER].credit(
            account_id, micro, {"reason": spec.reason[:200], "actor": "admin-api",
                                "ts": int(time.time())})
    except InsufficientCredits:
        raise GatewayError(ErrorKind.INVALID_REQUEST,
                           "the adjustment would take the balance below zero") from None
    return _json({"account": account_id, "added": _money(micro),
                  "available": _money(available)}, status=201)


def add_account_routes(app: web.Application) -> None:
    app.router.add_get("/v2/account", account)
    app.router.add_get("/v2/account/usage", usage)
    app.router.add_post("/admin/accounts/{account}/credits", add_credits)


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
