"""Recorded traffic through a candidate policy set (`inference-gateway policy replay`): what it
would have refused, and what it would have charged. Pure: access-log lines in, a report out.

Each request the access log recorded with a tier, a model and a family (those that got past
authentication and the model's lookup) is replayed in arrival order (its `ts` less its
latency), under the candidate's policies, with the shadow's checks (proxy.policy.shadow), in
the gateway's order (DESIGN §6):

- the request rate (429): `requests_per_minute` over a sliding minute per account, every
  attempt past authentication counted as the gateway counts them (one refused for access
  too, not one refused for the rate);
- the tier (403: one the candidate lacks), its access (403: the families, the model's group,
  the mode), the completion cap (403: `max_tokens_per_request`, against the `max_tokens` the
  request asked for), the queue budget (503: against the requests the live check saw waiting
  per replica, the log's `waiting`);
- the token limits (429): the tier's and the model group's windows (a minute, a day; tokens,
  input or output), counted with what each admitted request used (the log's units). The live
  gateway reserves a request's worst case until it ends, so it may refuse sooner than a replay
  shows: a replay's token refusals are a lower bound;
- the price of what each request that runs under both used: its units at the candidate's
  prices (chat tokens, cached ones at their own price, characters, audio and video seconds,
  images, embedding tokens), rounded up once as the meter does; guests pay nothing.

Not replayed, each for want of it in the log: guests' rate and token limits (their bucket is
their address, which the log does not keep), balances and budgets (402: kept as they were). A
request the live gateway refused and the candidate admits ran nowhere: it is counted as
"admitted", with no units and no price. Deterministic: the same lines and policies give the
same report.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from proxy.config import Policies, Rates
from proxy.credits.pricing import Used, format_credits, parse_credits, used_cost
from proxy.credits.token_windows import BUCKETS, TokenWindow
from proxy.identity.principal import GUEST_TIER
from proxy.policy.shadow import Rule, before_limits, rule_for

RATE_WINDOW_S = 60.0
ADMITTED, FORBIDDEN, RATE_LIMITED, TOKEN_LIMITED, SATURATED, UNKNOWN_TIER = (
    "admitted", "forbidden", "rate_limited", "token_limited", "pool_saturated", "unknown_tier")
# A refusal of the shadow's checks before the limits, as a replay's decision.
_DECISIONS = {"tier": UNKNOWN_TIER, "access": FORBIDDEN, "max_tokens": FORBIDDEN,
              "queue_budget": SATURATED}
_REFUSED_LIVE = {"forbidden": FORBIDDEN, "rate_limited": RATE_LIMITED,
                 "pool_saturated": SATURATED}


class Request(msgspec.Struct, frozen=True, gc=False):
    """One access-log line, as a replay reads it (the log's own field names; others ignored).
    Untracked by the garbage collector (it holds no cycles): a day's million of them would
    otherwise make every collection walk them all."""

    ts: float  # when it ended
    status: int
    tier: str
    model: str
    family: str
    latency_ms: float = 0.0
    mode: str = "direct"
    account: str | None = None  # None: a guest
    error: str | None = None
    units: Used | None = None  # a struct, not a dict: a million lines decode in half the time
    credits: str | None = None  # what it was charged, as the account API writes it
    asked_tokens: int | None = msgspec.field(default=None, name="max_tokens")
    waiting: float | None = None  # per replica, as the queue-budget check read it

    @property
    def start(self) -> float:
        """When it arrived."""
        return self.ts - self.latency_ms / 1000

    @property
    def charged(self) -> int:
        """What it was charged, in micro-credits."""
        text = self.credits
        if not text:
            return 0
        whole, _, fraction = text.partition(".")
        if whole.isdigit() and fraction.isdigit() and len(fraction) <= 6:
            return int(whole) * 1_000_000 + int(fraction.ljust(6, "0"))
        try:
            return parse_credits(text)
        except ValueError:
            return 0

    @property
    def live(self) -> str:
        """What the live gateway decided at admission."""
        refused = _REFUSED_LIVE.get(self.error) if self.error else None
        return refused if refused is not None and not self.units else ADMITTED


_LINE = msgspec.json.Decoder(Request)
_ARRIVAL = operator.attrgetter("start")


def read_line(raw: bytes | str) -> Request | None:
    """A log line as a replayable request; None for one that is not (no tier, model or family:
    refused before the model was known, or not an inference route), or not a line at all."""
    try:
        return _LINE.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def price(rates: Rates, request: Request) -> int:
    """What `request`'s units cost at `rates` (micro-credits; guests nothing)."""
    units = request.units
    if request.tier == GUEST_TIER or units is None:
        return 0
    return used_cost(rates, request.family, units)


class _Window:
    """A sliding window of (time, amount): what fell in the last `span` seconds."""

    __slots__ = ("entries", "span", "total")

    def __init__(self, span: float) -> None:
        self.span = span
        self.entries: deque[tuple[float, int]] = deque()
        self.total = 0

    def at(self, now: float) -> int:
        entries, edge = self.entries, now - self.span
        while entries and entries[0][0] <= edge:
            self.total -= entries.popleft()[1]
        return self.total

    def add(self, now: float, amount: int) -> None:
        self.entries.append((now, amount))
        self.total += amount


@dataclass
class Tally:
    """One group's count (a tier and model, or an account)."""

    requests: int = 0
    decisions: dict[str, int] = field(default_factory=dict)  # candidate's, by outcome
    newly_refused: int = 0  # admitted live, refused by the candidate
    newly_admitted: int = 0  # refused live (access or rate), admitted by the candidate
    live_credits: int = 0  # micro-credits charged live
    candidate_credits: int = 0  # what the candidate charges for what it admits

    def add(self, decision: str, live: str, count: int, charged: int, candidate: int) -> None:
        """`count` requests the candidate decided `decision` on and the live gateway `live`."""
        self.requests += count
        self.decisions[decision] = self.decisions.get(decision, 0) + count
        if decision != ADMITTED and live == ADMITTED:
            self.newly_refused += count
        elif decision == ADMITTED and live != ADMITTED:
            self.newly_admitted += count
        self.live_credits += charged
        self.candidate_credits += candidate

    def as_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "decisions": dict(sorted(self.decisions.items())),
                "newly_refused": self.newly_refused, "newly_admitted": self.newly_admitted,
                "live_micro_credits": self.live_credits,
                "candidate_micro_credits": self.candidate_credits,
                "difference_micro_credits": self.candidate_credits - self.live_credits}


class Replay:
    """Feed requests in arrival order (`run` sorts them); `report` after."""

    def __init__(self, policies: Policies) -> None:
        self.policies = policies
        self.reasons: dict[str, int] = {}  # the candidate's refusals, by their message
        self.skipped = 0  # lines that are not replayable requests
        # What each request added, summed by (tier, model, account, decision, live): one dict
        # update a request (a day's million of them), the tallies made from it by `report`.
        self._sums: dict[tuple[str, str, str | None, str, str], list[int]] = {}
        self._rates: dict[str, deque[float]] = {}  # per account: when its requests arrived
        self._tokens: dict[tuple[str, str], _Window] = {}
        self._rules: dict[tuple[str, str, str, str], Rule] = {}
        self._charged: dict[str | None, int] = {}  # the log's credits, parsed once each

    def run(self, lines: Iterable[bytes | str], since: float | None = None,
            until: float | None = None) -> Replay:
        """Every replayable line that arrived in [since, until), in arrival order."""
        requests = []
        for raw in lines:
            request = read_line(raw)
            if request is None:
                self.skipped += 1
            elif (since is None or request.start >= since) and (
                    until is None or request.start < until):
                requests.append(request)
        requests.sort(key=_ARRIVAL)
        replay = self.replay
        for request in requests:
            replay(request)
        return self

    def replay(self, request: Request) -> str:
        """The candidate's decision on `request`, counted."""
        key = (request.tier, request.family, request.model, request.mode)
        rule = self._rules.get(key)
        if rule is None:
            rule = self._rules[key] = rule_for(self.policies, request, "the candidate's")
        decision, reason = self._decide(request, rule)
        if reason:
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        charged = self._charged.get(request.credits)
        if charged is None:
            charged = self._charged[request.credits] = request.charged
        candidate = price(rule.rates, request) if decision == ADMITTED else 0
        group = (request.tier, request.model, request.account, decision, request.live)
        sums = self._sums.get(group)
        if sums is None:
            self._sums[group] = [1, charged, candidate]
        else:
            sums[0] += 1
            sums[1] += charged
            sums[2] += candidate
        return decision

    def _decide(self, request: Request, rule: Rule) -> tuple[str, str]:
        before = before_limits(rule, request)
        tier = rule.tier
        account = request.account
        if tier is None or account is None:  # a tier it lacks; a guest: no bucket in the log
            return (_DECISIONS[before.reason], before.message) if before else (ADMITTED, "")
        arrivals = self._rates.get(account)
        if arrivals is None:
            arrivals = self._rates[account] = deque()
        start = request.start
        edge = start - RATE_WINDOW_S
        while arrivals and arrivals[0] <= edge:
            arrivals.popleft()
        limit = tier.requests_per_minute
        if limit and len(arrivals) >= limit:
            return RATE_LIMITED, f"{request.tier}: more than {limit} requests a minute"
        arrivals.append(start)  # counted, whatever comes next
        if before is not None:
            return _DECISIONS[before.reason], before.message
        over = self._over_tokens(request, start, rule.windows) if rule.windows else ""
        if over:
            return TOKEN_LIMITED, f"{request.tier}: {over}"
        return ADMITTED, ""

    def _over_tokens(self, request: Request, start: float,
                     windows: tuple[TokenWindow, ...]) -> str:
        """The token window `request` would not fit in ("" when it fits; then counted)."""
        units = request.units
        prompt = 0 if units is None else units.prompt_tokens
        completion = 0 if units is None else units.completion_tokens
        found = []
        for window in windows:
            slot = (str(request.account), f"{request.tier}:{window.suffix}")
            counted = self._tokens.get(slot)
            if counted is None:
                seconds, buckets = BUCKETS[window.period]
                counted = self._tokens[slot] = _Window(seconds * buckets)
            wanted = window.reserve(prompt, completion)
            if counted.at(start) + wanted > window.limit:
                return window.describe()
            found.append((counted, wanted))
        for counted, wanted in found:
            counted.add(start, wanted)
        return ""

    def tallies(self) -> tuple[dict[tuple[str, str], Tally], dict[str, Tally]]:
        """What was replayed, by (tier, model) and by account (keyed callers)."""
        by_tier_model: dict[tuple[str, str], Tally] = {}
        by_account: dict[str, Tally] = {}
        for (tier, model, account, decision, live), (n, charged, candidate) in (
                self._sums.items()):
            by_tier_model.setdefault((tier, model), Tally()).add(
                decision, live, n, charged, candidate)
            if account is not None:
                by_account.setdefault(account, Tally()).add(
                    decision, live, n, charged, candidate)
        return by_tier_model, by_account

    def report(self, top: int = 10) -> dict[str, Any]:
        """The whole of it, as `--json` prints it (sorted: the same input, the same output)."""
        by_tier_model, by_account = self.tallies()
        total = Tally()
        for tally in by_tier_model.values():
            total.requests += tally.requests
            for name, n in tally.decisions.items():
                total.decisions[name] = total.decisions.get(name, 0) + n
            total.newly_refused += tally.newly_refused
            total.newly_admitted += tally.newly_admitted
            total.live_credits += tally.live_credits
            total.candidate_credits += tally.candidate_credits
        accounts = sorted(by_account.items(), key=lambda item: (
            -abs(item[1].candidate_credits - item[1].live_credits), -item[1].newly_refused,
            item[0]))
        refused = sorted(by_account.items(),
                         key=lambda item: (-item[1].newly_refused, item[0]))
        return {
            "total": total.as_json(),
            "skipped_lines": self.skipped,
            "by_tier_model": [{"tier": tier, "model": model, **tally.as_json()}
                              for (tier, model), tally in sorted(by_tier_model.items())],
            "refusal_reasons": dict(sorted(self.reasons.items(), key=lambda r: (-r[1], r[0]))),
            "accounts_by_revenue_change": [{"account": name, **tally.as_json()}
                                           for name, tally in accounts[:top]],
            "accounts_by_new_refusals": [{"account": name, **tally.as_json()}
                                         for name, tally in refused[:top]
                                         if tally.newly_refused],
        }


# ---- the report as a table (`policy replay` without --json) ------------------------------


def _credits(micro: int) -> str:
    return format_credits(micro).rstrip("0").rstrip(".") or "0"


def _row(name: str, tally: dict[str, Any]) -> str:
    refused = tally["requests"] - tally["decisions"].get(ADMITTED, 0)
    return (f"{name:<42} {tally['requests']:>8} {refused:>8} {tally['newly_refused']:>8} "
            f"{tally['newly_admitted']:>8} {_credits(tally['live_micro_credits']):>12} "
            f"{_credits(tally['candidate_micro_credits']):>12} "
            f"{_credits(tally['difference_micro_credits']):>12}")


def text(report: dict[str, Any]) -> str:
    """`report` as tables: per tier and model, the reasons, the accounts most affected."""
    head = (f"{'tier / model':<42} {'requests':>8} {'refused':>8} {'newly':>8} {'now run':>8} "
            f"{'live':>12} {'candidate':>12} {'change':>12}")
    out = ["refused: by the candidate; newly: of them, run live; now run: refused live, run by "
           "the candidate; credits: live, the candidate's, the change", "", head,
           "-" * len(head)]
    out += [_row(f"{r['tier']} / {r['model']}", r) for r in report["by_tier_model"]]
    out += ["-" * len(head), _row("all", report["total"]), ""]
    out.append(f"lines not replayed (no tier, model or family): {report['skipped_lines']}")
    if report["refusal_reasons"]:
        out += ["", "why the candidate refuses:"]
        out += [f"  {n:>8}  {reason}" for reason, n in report["refusal_reasons"].items()]
    if report["accounts_by_revenue_change"]:
        out += ["", "accounts by revenue change:"]
        out += ["  " + _row(a["account"], a) for a in report["accounts_by_revenue_change"]]
    if report["accounts_by_new_refusals"]:
        out += ["", "accounts by requests newly refused:"]
        out += ["  " + _row(a["account"], a) for a in report["accounts_by_new_refusals"]]
    return "\n".join(out)
