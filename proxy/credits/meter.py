"""One request's money, in one object with one lifecycle:

    Metering.chat / .units   open: the worst case priced (guests hold nothing)
    Meter.admit              the rate limit counted, the token limits' reservation (chat) and
                             the hold placed, one Redis step (credits.admission): 429, 402 or
                             503 when it may not run
    Meter.handed_off         an async task took the hold over: its runner settles it
    Meter.settle(result)     the charge for what was used, queued exactly once

`settle` runs on every exit path (success, upstream failure: nothing; a cut stream: what was
delivered; a client gone once the answer was made: the answer; timeout; cancellation) and is
safe whatever happened before: `Stage` says how far admission got, so a hold that may exist is
ended and one that cannot is not. It queues the write (credits.settler) and returns at once, so
it cannot be interrupted half-way and never delays the answer. Guests pay nothing, but their
usage is journaled. `Result` is the one record of what the request path learned, whatever the
family; this module is the only writer of `Meter.stage`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from redis.commands.core import AsyncScript

from proxy.config import PricesPolicy, Rates, TierPolicy
from proxy.credits.admission import Admitter, Hold, Window
from proxy.credits.budgets import BudgetExceeded, over_budget
from proxy.credits.ledger import InsufficientCredits, Reserved, settle_call
from proxy.credits.pricing import (
    ChatUsage,
    Units,
    chat_cost,
    chat_worst,
    format_credits,
    prompt_upper_bound,
    units_cost,
    usage_from,
    worst_cost,
)
from proxy.credits.settler import Settler
from proxy.credits.token_windows import TokenWindow
from proxy.errors import ErrorKind, GatewayError
from proxy.identity.principal import Principal
from proxy.ids import hex_id
from proxy.observe.metrics import Metrics
from proxy.observe.trace import Trace
from proxy.outcome import Outcome

# The answer reached the client, or was made for it and the client left while it went out.
DELIVERED = frozenset({Outcome.COMPLETED, Outcome.CLIENT_GONE})


class Tally(Protocol):
    """A streamed chat answer's count as it is relayed (styles.wire.ChunkFilter)."""

    @property
    def usage(self) -> dict[str, Any] | None: ...  # the engine's usage chunk, once seen

    @property
    def chunks(self) -> int: ...  # content chunks that reached the client


@dataclass(slots=True)
class Result:
    """What the request path learned of its answer, filled in as it goes; read once, at
    settlement. Chat fills `usage` (a whole answer) or `tally` (a stream); the other families
    fill `used`."""

    status: Outcome = Outcome.FAILED
    usage: dict[str, Any] | None = None  # the engine's own usage of a whole chat answer
    tally: Tally | None = None  # a chat stream: its usage chunk, content delivered
    used: Units = field(default_factory=Units)  # speech, transcription, image, video
    captured: list[bytes] | None = None  # the bytes sent (an idempotent request's replay)

    def answered(self, *, usage: dict[str, Any] | None = None, used: Units | None = None) -> None:
        """The whole answer is made and about to go out: from here on it is charged, even if
        the client leaves while it is sent (`Outcome.CLIENT_GONE` until `delivered`)."""
        self.status = Outcome.CLIENT_GONE
        self.usage = usage
        if used is not None:
            self.used = used

    def delivered(self) -> None:
        self.status = Outcome.COMPLETED

    def failed(self, error: GatewayError) -> None:
        """The request failed once running: the client's own fault (a 4xx), or the gateway's
        own store (the media store), is not put down to the upstream."""
        if self.status is Outcome.UPSTREAM_ERROR and 400 <= error.status < 500:
            self.status = Outcome.CLIENT_ERROR
        elif self.status is Outcome.UPSTREAM_ERROR and error.store is not None:
            self.status = Outcome.FAILED


class Stage(enum.Enum):
    """How far admission got: whether a hold may exist that the settlement must end."""

    BEFORE = enum.auto()  # not tried: nothing to end
    ADMITTING = enum.auto()  # asked, answer unknown (cancelled, store unreachable): may exist
    ADMITTED = enum.auto()  # held (a guest: counted)
    REFUSED = enum.auto()  # 429 / 402: nothing held
    HANDED_OFF = enum.auto()  # an async task took the hold over: its runner settles it


class Metering:
    """A worker's admission and settlement writer, shared by every request: opens meters."""

    def __init__(self, admitter: Admitter, settler: Settler, settle_script: AsyncScript,
                 metrics: Metrics) -> None:
        self.admitter = admitter
        self.settler = settler
        self.script = settle_script
        self.metrics = metrics

    def chat(self, prices: PricesPolicy, principal: Principal, model: str, mode: str,
             route: str, request_id: str, body: dict[str, Any], cap: int,
             windows: tuple[TokenWindow, ...] = ()) -> Meter:
        """A chat request's meter: its worst case is the completion cap times `n` plus a bound
        on the prompt, reserved in its token `windows`; it is charged the tokens used."""
        rates = prices.for_model(model, mode)
        worst = chat_worst(body, cap)
        hold = worst_cost(rates, worst) if principal.kind != "guest" else 0
        meter = self._open(prices, rates, principal, model, mode, route, request_id, hold, body)
        meter.windows, meter.worst = windows, worst
        return meter

    def units(self, prices: PricesPolicy, principal: Principal, model: str, mode: str,
              route: str, request_id: str, worst: Units,
              windows: tuple[TokenWindow, ...] = ()) -> Meter:
        """A speech, transcription, image, video or embeddings request's meter: charged per
        unit used; input tokens (embeddings) are reserved in the token `windows` as well."""
        rates = prices.for_model(model, mode)
        meter = self._open(prices, rates, principal, model, mode, route, request_id,
                           units_cost(rates, worst), None)
        if worst.prompt_tokens:
            meter.windows, meter.worst = windows, ChatUsage(worst.prompt_tokens, 0)
        return meter

    def resume(self, prices: PricesPolicy, principal: Principal, model: str, mode: str,
               details: dict[str, Any], hold: Hold | None, body: dict[str, Any] | None
               ) -> Meter:
        """A queued task's meter again, in the runner: its hold was placed at submission."""
        return Meter(self, principal, prices, prices.for_model(model, mode), model,
                     {**details, "async": True}, hold, body, Stage.ADMITTED)

    async def count(self, principal: Principal, tier: TierPolicy) -> Window:
        """Count an attempt refused before admission (it holds nothing)."""
        return await self.admitter.count(principal, principal.tier, tier)

    def _open(self, prices: PricesPolicy, rates: Rates, principal: Principal, model: str,
              mode: str, route: str, request_id: str, worst: int, body: dict[str, Any] | None
              ) -> Meter:
        details: dict[str, object] = {
            "key_id": principal.key_id or "", "model": model, "mode": mode, "route": route,
            "request_id": request_id, "price_version": prices.version,
        }
        hold = None
        if principal.kind != "guest":
            hold = Hold(hex_id(), worst, prices.hold_ttl_s)
            details["held_max"] = worst
        return Meter(self, principal, prices, rates, model, details, hold, body)


@dataclass(slots=True)
class Meter:
    """One request's hold and its single settlement, whatever the family."""

    metering: Metering
    principal: Principal
    prices: PricesPolicy
    rates: Rates
    model: str
    details: dict[str, object]  # the journal fields known at admission
    hold: Hold | None  # None for guests
    chat_body: dict[str, Any] | None  # chat: priced by tokens (the body bounds a cut prompt)
    stage: Stage = Stage.BEFORE
    windows: tuple[TokenWindow, ...] = ()  # chat, embeddings: the token windows it counts in
    worst: ChatUsage | None = None  # chat, embeddings: what it reserves in them
    started: float = field(default_factory=time.monotonic)
    charged: tuple[int, dict[str, int]] | None = None  # (cost, units) of the settlement queued
    cached_tokens: int = 0  # chat: of the prompt tokens charged, those the engine had cached
    _settled: bool = False

    async def admit(self, tier: TierPolicy) -> Window:
        """Count the request in its tier's window and place its hold, in one step."""
        principal = self.principal
        self.stage = Stage.ADMITTING
        try:
            worst = self.worst or ChatUsage(0, 0)
            window = await self.metering.admitter.admit(
                principal, principal.tier, tier, self.hold, windows=self.windows,
                prompt=worst.prompt_tokens, completion=worst.completion_tokens,
                request_id=str(self.details["request_id"]))
        except InsufficientCredits as exc:
            self.stage = Stage.REFUSED
            raise GatewayError(
                ErrorKind.INSUFFICIENT_CREDITS,
                f"this request may cost up to {format_credits(exc.needed)} credits and "
                f"{format_credits(exc.available)} are available",
            ) from None
        except BudgetExceeded as exc:
            self.stage = Stage.REFUSED
            raise over_budget(exc) from None
        except GatewayError as exc:
            if exc.kind is not ErrorKind.UNAVAILABLE:  # 429: refused for sure; 503: unknown
                self.stage = Stage.REFUSED
            raise
        self.stage = Stage.ADMITTED
        if window.tokens:  # reserved: settled in those windows (by a runner, for a task)
            self.details["token_windows"] = [w.suffix for w in self.windows]
        return window

    def handed_off(self) -> None:
        """An async task holds the hold now; its runner settles it (tasks.run)."""
        self.stage = Stage.HANDED_OFF

    def settle(self, result: Result) -> tuple[int, dict[str, int]] | None:
        """Queue the charge for what `result` says was used (or the release, or a guest's
        journal entry); the (cost, units) queued, or None when there was nothing to end.
        Exactly once: a second call does nothing."""
        if self._settled:
            return None
        self._settled = True
        if self.stage in (Stage.BEFORE, Stage.REFUSED, Stage.HANDED_OFF):
            return None  # nothing held, nothing used (or not ours to end)
        if self.hold is None and self.stage is not Stage.ADMITTED:
            return None  # a guest that was not admitted used nothing
        cost, units, extra = self._priced(result)
        entry = {**self.details, **units, **extra, "price": cost,
                 "latency_ms": int((time.monotonic() - self.started) * 1000),
                 "ts": int(time.time())}
        prices = self.prices
        if self.hold is None:
            keep, ttl = prices.guest_journal_max_entries, prices.guest_journal_ttl_s
        else:
            keep, ttl = prices.journal_max_entries, 0
        tokens = None
        suffixes = self.details.get("token_windows")
        if isinstance(suffixes, list) and suffixes:  # the engine's counts for the reservation
            tokens = Reserved(self.principal.tier, str(self.details["request_id"]),
                              tuple(str(s) for s in suffixes), units.get("prompt_tokens", 0),
                              units.get("completion_tokens", 0))
        metering = self.metering
        keys, args = settle_call(
            self.principal.account, self.hold.hold_id if self.hold else "", cost,
            self.hold.amount if self.hold else 0, result.status, self.model, units, entry,
            keep, ttl, tokens=tokens if self.hold is not None else None)
        # A guest's usage entry is not idempotent (no hold id): never sent twice.
        metering.settler.settle(metering.script, keys, args, repeatable=self.hold is not None)
        if tokens and self.hold is None:  # a guest's windows live on the rate-limit Redis
            metering.admitter.settle_tokens(self.principal, tokens)
        self.charged = (cost if self.hold is not None else 0, units)  # guests pay nothing
        metering.metrics.settled(self.model, self.principal.tier, *self.charged)
        return self.charged

    def settle_on(self, trace: Trace | None, result: Result) -> None:
        """`settle`, with what it charges (and the step) on the request's or run's trace."""
        began = time.monotonic()
        charged = self.settle(result)
        if trace is not None and charged is not None:
            cost, trace.units = charged
            if self.cached_tokens:  # the log's copy: what a replay reprices them at
                trace.units = {**trace.units, "cached_tokens": self.cached_tokens}
            if cost:
                trace.credits, trace.charged = format_credits(cost), cost
            trace.stage("settlement", began, {"igw.outcome": str(result.status)})

    def _priced(self, result: Result) -> tuple[int, dict[str, int], dict[str, object]]:
        """(cost, units for the running totals, journal details) of what was used."""
        if self.chat_body is None:
            used = result.used if result.status in DELIVERED else Units()
            return units_cost(self.rates, used), used.counts(), {}
        usage = self._chat_usage(result) or ChatUsage(0, 0)
        self.cached_tokens = usage.cached_tokens
        return (chat_cost(self.rates, usage),
                {"prompt_tokens": usage.prompt_tokens,
                 "completion_tokens": usage.completion_tokens},
                {"cached_tokens": usage.cached_tokens, "estimated": usage.estimated})

    def _chat_usage(self, result: Result) -> ChatUsage | None:
        tally = result.tally
        if tally is None:
            return usage_from(result.usage) if result.status in DELIVERED else None
        reported = usage_from(tally.usage)
        if reported is not None:
            return reported
        if tally.chunks:
            # Cut before the usage chunk: the prompt reached the engine whole, so it is charged
            # at its upper bound (never a guess below the engine's own count), and a token for
            # each content chunk that reached the client.
            return ChatUsage(prompt_upper_bound(self.chat_body or {}), tally.chunks,
                             estimated=True)
        return None
