"""One request's credits: the worst case it holds, and its settlement, queued exactly once.

`open_meter` takes the request's worst case (priced by credits.pricing; the hold itself is placed
by admission, in the same Redis step as the rate limit); `Meter.charge` charges what the request
actually used (`ChatMeter` prices tokens, the other families their own units) on every exit path:
success, upstream failure (nothing), cut stream or client gone (what was delivered), timeout,
cancellation, and journals it. It queues the write (credits.settler) and returns at once, so it
cannot be interrupted half-way and never delays the answer. Guests hold nothing and pay nothing,
but their usage is journaled.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from redis.commands.core import AsyncScript

from proxy.config import PricesPolicy, Rates
from proxy.credits.admission import Hold
from proxy.credits.ledger import new_hold_id, settle_call
from proxy.credits.pricing import ChatUsage, chat_cost, chat_hold, prompt_estimate, usage_from
from proxy.credits.settler import Settler
from proxy.identity.principal import Principal
from proxy.outcome import Outcome
from proxy.styles.wire import ChunkFilter


@dataclass(slots=True)
class Result:
    """What the request path learned, filled in as it goes; read once at settlement."""

    status: Outcome = Outcome.FAILED
    usage: dict[str, Any] | None = None  # the upstream's usage (non-streamed answers)
    chunks: ChunkFilter | None = None  # streamed answers: usage chunk and delivered count
    captured: list[bytes] | None = None  # a stream's bytes as sent (for idempotent replay)


class Stage(enum.Enum):
    """How far admission got: whether a hold may exist that the settlement must end."""

    BEFORE = enum.auto()  # not tried: nothing to end
    ADMITTING = enum.auto()  # asked, answer unknown (cancelled, store unreachable): may exist
    ADMITTED = enum.auto()  # held (a guest: counted)
    REFUSED = enum.auto()  # 429 / 402: nothing held
    HANDED_OFF = enum.auto()  # an async task took the hold over: its runner settles it


@dataclass(slots=True)
class Meter:
    """One request's hold and its single settlement, whatever the task family."""

    principal: Principal
    prices: PricesPolicy
    model: str
    details: dict[str, object]  # the journal fields known at admission
    hold: Hold | None  # None for guests
    stage: Stage = Stage.BEFORE
    started: float = field(default_factory=time.monotonic)
    charged: tuple[int, dict[str, int]] | None = None  # (cost, units) of the settlement queued
    _settled: bool = False

    def charge(self, settler: Settler, script: AsyncScript, status: Outcome, cost: int,
               units: dict[str, int], details: dict[str, object]) -> None:
        """Queue the charge of `cost` for what was used (or the release, or a guest's journal
        entry). Safe to call whatever happened before: a hold that may exist is ended (the
        settle script does nothing for one that was never placed). Exactly once."""
        if self._settled:
            return
        self._settled = True
        if self.stage in (Stage.BEFORE, Stage.REFUSED, Stage.HANDED_OFF):
            return  # nothing held, nothing used (or not ours to end)
        if self.hold is None and self.stage is not Stage.ADMITTED:
            return  # a guest that was not admitted used nothing
        entry = {**self.details, **units, **details, "price": cost,
                 "latency_ms": int((time.monotonic() - self.started) * 1000),
                 "ts": int(time.time())}
        prices = self.prices
        if self.hold is None:
            keep, ttl = prices.guest_journal_max_entries, prices.guest_journal_ttl_s
        else:
            keep, ttl = prices.journal_max_entries, 0
        keys, args = settle_call(
            self.principal.account, self.hold.hold_id if self.hold else "", cost,
            self.hold.amount if self.hold else 0, status, self.model, units, entry, keep, ttl)
        settler.settle(script, keys, args)
        self.charged = (cost if self.hold is not None else 0, units)  # guests pay nothing


def open_meter(prices: PricesPolicy, principal: Principal, model: str, mode: str, route: str,
               request_id: str, worst: int) -> Meter:
    """A meter whose hold is `worst` micro-credits (guests hold nothing)."""
    details: dict[str, object] = {
        "key_id": principal.key_id or "", "model": model, "mode": mode, "route": route,
        "request_id": request_id, "price_version": prices.version,
    }
    hold = None
    if principal.kind != "guest":
        hold = Hold(new_hold_id(), worst, prices.hold_ttl_s)
        details["held_max"] = worst
    return Meter(principal, prices, model, details, hold)


@dataclass(slots=True)
class ChatMeter:
    """A chat request's meter: its charge is priced from the tokens it used."""

    meter: Meter
    rates: Rates
    body: dict[str, Any]

    @property
    def principal(self) -> Principal:
        return self.meter.principal

    def settle(self, settler: Settler, script: AsyncScript, result: Result) -> None:
        usage = self._usage(result) or ChatUsage(0, 0)
        units = {"prompt_tokens": usage.prompt_tokens,
                 "completion_tokens": usage.completion_tokens}
        self.meter.charge(settler, script, result.status, chat_cost(self.rates, usage), units,
                          {"cached_tokens": usage.cached_tokens, "estimated": usage.estimated})

    def _usage(self, result: Result) -> ChatUsage | None:
        chunks = result.chunks
        reported = usage_from(result.usage if chunks is None else chunks.usage)
        if reported is not None:
            return reported
        delivered = chunks.chunks if chunks is not None else 0
        if delivered:  # cut before the usage chunk: charge what reached the client
            return ChatUsage(prompt_estimate(self.body), delivered, estimated=True)
        return None


def open_chat_meter(prices: PricesPolicy, principal: Principal, model: str, body: dict[str, Any],
                    cap: int, mode: str, route: str, request_id: str) -> ChatMeter:
    """Price the request's worst case (the completion cap times `n` plus a bound on the prompt)."""
    rates = prices.for_model(model, mode)
    worst = chat_hold(rates, body, cap) if principal.kind != "guest" else 0
    meter = open_meter(prices, principal, model, mode, route, request_id, worst)
    return ChatMeter(meter, rates, body)
