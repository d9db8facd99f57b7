"""Budgets: spend caps that reset, per account and per key, per UTC day, week (from Monday) or
calendar month, on top of the prepaid balance (or instead of it: a postpaid account). No I/O.

    caps      igw:{A}:caps      'a:d' | 'a:w' | 'a:m' (the account's), 'k:<key id>:d' ... (a
                                key's), in micro-credits; 'postpaid' = '1' (no balance check);
                                'below': the balance alerts' threshold (credits.alerts)
    spent     igw:{A}:capspent  '<cap>:<period number>' -> charged in that period (persisted)
    held      igw:{A}:capheld   the same fields -> what holds count against it now (soft);
                                'h:<hold id>' -> the hold's marks: the budgets it counts
                                against and their caps, and the balance threshold, as
                                admission read them ('<field>=<cap>,...,below=<threshold>')

Admission (credits/lua/admit.lua) refuses a hold that would take a cap's spent + held past it;
settlement moves the hold's part to what was charged. A period's figures are kept under its
number (credits/lua/periods.lua computes the same ones), so a budget resets on the boundary
with nothing to sweep.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping
from dataclasses import dataclass

from proxy.credits.pricing import format_credits
from proxy.errors import ErrorKind, GatewayError

PERIODS = {"day": "d", "week": "w", "month": "m"}
PERIOD_NAMES = {code: name for name, code in PERIODS.items()}
_EVERY = {"d": "daily", "w": "weekly", "m": "monthly"}
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


class BudgetExceeded(Exception):
    def __init__(self, cap: str, left: int, needed: int) -> None:
        super().__init__(f"{cap}: {left} left < {needed}")
        self.cap = cap  # 'a:m', 'k:<key id>:d'
        self.left = left
        self.needed = needed


def cap_name(period: str, key_id: str | None = None) -> str:
    """The caps field of an account's (or a key's) budget over `period` (day, week, month)."""
    code = PERIODS[period]
    return f"k:{key_id}:{code}" if key_id else f"a:{code}"


def period_index(code: str, now_s: float) -> int:
    """The number of the period `now_s` is in ('d', 'w' from Monday, 'm'), as periods.lua."""
    day = int(now_s // 86400)
    if code == "d":
        return day
    if code == "w":
        return (day + 3) // 7
    date = _EPOCH + datetime.timedelta(days=day)
    return date.year * 12 + date.month - 1


def period_end(code: str, index: int) -> datetime.datetime:
    """When period `index` ends: the budget's reset."""
    if code == "d":
        return _EPOCH + datetime.timedelta(days=index + 1)
    if code == "w":
        return _EPOCH + datetime.timedelta(days=(index + 1) * 7 - 3)
    year, month = divmod(index + 1, 12)
    return datetime.datetime(year, month + 1, 1, tzinfo=datetime.UTC)


@dataclass(frozen=True, slots=True)
class Budget:
    scope: str  # "account" or "key"
    key_id: str | None
    period: str  # day, week, month
    limit: int
    spent: int  # charged this period
    held: int  # held by requests running now
    resets_at: datetime.datetime

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.spent - self.held)


def budgets(caps: Mapping[str, str], spent: Mapping[str, str], held: Mapping[str, str],
            now_s: float, key_id: str | None = None) -> list[Budget]:
    """The account's budgets and, with `key_id`, that key's (all keys' without it)."""
    found = []
    for name, value in sorted(caps.items()):
        scope, _, rest = name.partition(":")
        if scope == "a":
            owner, code = None, rest
        elif scope == "k" and ":" in rest:
            owner, code = rest.rsplit(":", 1)
            if key_id is not None and owner != key_id:
                continue
        else:
            continue  # 'postpaid', 'below'
        if code not in PERIOD_NAMES:
            continue
        index = period_index(code, now_s)
        field = f"{name}:{index}"
        found.append(Budget("key" if owner else "account", owner, PERIOD_NAMES[code],
                            int(value), int(spent.get(field, 0)), int(held.get(field, 0)),
                            period_end(code, index)))
    return found


def key_cap_problem(caps: Mapping[str, str], period: str, amount: int, key_id: str | None
                    ) -> str | None:
    """Why a cap cannot be set: a key's cap is at most its account's over the same period."""
    code = PERIODS[period]
    if key_id:
        account = caps.get(f"a:{code}")
        if account is not None and amount > int(account):
            return f"a key's {period} budget must be at most its account's ({account} micro)"
        return None
    over = [name for name, value in caps.items()
            if name.startswith("k:") and name.endswith(f":{code}") and int(value) > amount]
    if over:
        return (f"the account's {period} budget must be at least its keys' "
                f"({', '.join(sorted(n.split(':')[1] for n in over))} have more)")
    return None


def over_budget(exc: BudgetExceeded, now_s: float | None = None) -> GatewayError:
    """402 budget_exceeded: which budget, what it has left, and when it resets."""
    scope, _, rest = exc.cap.partition(":")
    owner, _, code = rest.rpartition(":")  # the script names only caps this module made
    now = time.time() if now_s is None else now_s
    resets = period_end(code, period_index(code, now))
    whose = f"key {owner}'s" if scope == "k" else "the account's"
    when = utc_text(resets)
    return GatewayError(
        ErrorKind.BUDGET_EXCEEDED,
        f"this request may cost up to {format_credits(exc.needed)} credits and {whose} "
        f"{_EVERY[code]} budget has {format_credits(max(0, exc.left))} left; it resets at "
        f"{when}", headers={"Retry-After": str(max(1, int(resets.timestamp() - now))),
                            "X-Budget-Reset": when})


def utc_text(at: datetime.datetime) -> str:
    """A UTC time as the API writes it (RFC 3339, whole seconds)."""
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")
