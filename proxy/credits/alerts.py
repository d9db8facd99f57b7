"""Alerts: what a webhook receiver gets when a budget crosses 50, 80 or 100 % of its cap or a
balance falls under its threshold, how it is signed, and when a failed delivery is tried
again. No I/O (proxy.credits.webhooks sends them; credits/lua/alerts.lua records them).

An alert is recorded once, in the account's alerts stream, in the same step as the charge (or
the refusal) that caused it. Its id (`evt_...`) is derived from the account and that stream
entry, so every attempt to deliver it carries the same id: a receiver drops duplicates by it.

The signature is Stripe's scheme: `Igw-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of
"<t>.<body>" with the endpoint's secret>`; the timestamp inside what is signed lets a receiver
refuse a replayed delivery (`verify`'s tolerance).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.credits.budgets import PERIOD_NAMES, period_end, utc_text
from proxy.credits.pricing import format_credits

SIGNATURE_HEADER = "Igw-Signature"
TOLERANCE_S = 300  # a receiver refuses a signature older (or newer) than this


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A webhook receiver: every account's alerts (`account` '*') or one account's."""

    id: str
    url: str
    secret: str
    account: str
    created: int

    def wants(self, account: str) -> bool:
        return self.account in ("*", account)

    def to_json(self) -> bytes:
        return orjson.dumps({"url": self.url, "secret": self.secret, "account": self.account,
                             "created": self.created})

    @classmethod
    def from_json(cls, endpoint_id: str, raw: bytes | str) -> Endpoint:
        data = orjson.loads(raw)
        return cls(endpoint_id, data["url"], data["secret"], data["account"], data["created"])


def new_endpoint(url: str, account: str | None, now_s: float | None = None) -> Endpoint:
    return Endpoint(f"we_{secrets.token_hex(8)}", url, f"whsec_{secrets.token_urlsafe(32)}",
                    account or "*", int(time.time() if now_s is None else now_s))


def event_id(account: str, entry_id: str) -> str:
    """The alert's id: the same for every delivery of it, unique across accounts."""
    return "evt_" + hashlib.blake2b(f"{account}\0{entry_id}".encode(), digest_size=12).hexdigest()


def _money(micro: int) -> dict[str, Any]:
    return {"credits": format_credits(micro), "micro_credits": micro}


def event(account: str, entry_id: str, fields: Mapping[str, str]) -> dict[str, Any]:
    """The body a receiver gets for one recorded alert (the stream entry's fields)."""
    created = int(entry_id.split("-")[0]) // 1000
    base = {"id": event_id(account, entry_id), "created": created, "account": account}
    if fields.get("type") == "balance":
        return {**base, "type": "balance.low",
                "data": {"threshold": _money(int(fields["threshold"])),
                         "balance": _money(int(fields["balance"]))}}
    cap = fields["cap"]  # 'a:m', 'k:<key id>:d' (credits.budgets)
    scope, _, rest = cap.partition(":")
    owner, _, code = rest.rpartition(":")
    limit, spent, held = int(fields["limit"]), int(fields["spent"]), int(fields["held"])
    return {**base, "type": "budget.threshold",
            "data": {"percent": int(fields["percent"]),
                     "refused": fields.get("refused") == "1",
                     "budget": {"scope": "key" if scope == "k" else "account",
                                "key_id": owner or None, "period": PERIOD_NAMES[code],
                                "limit": _money(limit), "spent": _money(spent),
                                "held": _money(held),
                                "remaining": _money(max(0, limit - spent - held)),
                                "resets_at": utc_text(period_end(code,
                                                                 int(fields["period"])))}}}


def sign(secret: str, body: bytes, now_s: float | None = None) -> str:
    """The signature header's value for `body` sent now."""
    stamp = str(int(time.time() if now_s is None else now_s))
    mac = hmac.new(secret.encode(), stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={stamp},v1={mac}"


def verify(secret: str, header: str, body: bytes, now_s: float | None = None,
           tolerance_s: float = TOLERANCE_S) -> bool:
    """What a receiver checks: a v1 signature of this body by this secret, signed within
    `tolerance_s` of now. (Receivers in other languages do the same few steps.)"""
    parts = [part.partition("=") for part in header.split(",")]
    stamps = [value for name, _, value in parts if name == "t"]
    if len(stamps) != 1 or not stamps[0].isdigit():
        return False
    now = time.time() if now_s is None else now_s
    if abs(now - int(stamps[0])) > tolerance_s:
        return False
    expected = hmac.new(secret.encode(), stamps[0].encode() + b"." + body,
                        hashlib.sha256).hexdigest()
    return any(name == "v1" and hmac.compare_digest(value, expected) for name, _, value in parts)


@dataclass(slots=True)
class Attempts:
    """One alert's delivery to one endpoint."""

    state: str = "pending"  # pending, delivered, failed (given up)
    attempts: int = 0
    next_at: float = 0.0  # when the next attempt is due (pending)
    last: str = ""  # the last attempt's outcome: "HTTP 503", "timeout", ...
    at: float = 0.0  # the last attempt's time

    def due(self, now_s: float) -> bool:
        return self.state == "pending" and self.next_at <= now_s

    def record(self, ok: bool, outcome: str, now_s: float, retry_s: Sequence[float]) -> None:
        """An attempt ended: delivered, due again after the next wait, or given up."""
        self.attempts += 1
        self.last, self.at = outcome, now_s
        if ok:
            self.state = "delivered"
        elif self.attempts > len(retry_s):
            self.state = "failed"
        else:
            self.next_at = now_s + retry_s[self.attempts - 1]


def attempts_from_json(raw: bytes | str | None) -> dict[str, Attempts]:
    """Endpoint id -> its delivery, as kept in the deliveries hash."""
    if not raw:
        return {}
    return {endpoint: Attempts(**fields) for endpoint, fields in orjson.loads(raw).items()}


def attempts_to_json(deliveries: Mapping[str, Attempts]) -> bytes:
    return orjson.dumps({endpoint: {"state": a.state, "attempts": a.attempts,
                                    "next_at": a.next_at, "last": a.last, "at": a.at}
                         for endpoint, a in deliveries.items()})
