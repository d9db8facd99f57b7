"""One request's credits: the hold before it runs, and its settlement after, exactly once.

`open_chat_meter` holds the worst case (402 when the balance cannot cover it); `ChatMeter.settle`
charges what the request actually used on every exit path — success, upstream failure (nothing),
cut stream or client gone (what was delivered), timeout, cancellation — and journals it. The
pipeline runs it under `asyncio.shield`, so a cancelled request still settles; if Redis is
unreachable then, the hold expires and the sweeper releases it (never an over-charge).
Guests hold nothing and pay nothing, but their usage is journaled.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from proxy.config import PricesPolicy, Rates
from proxy.credits.ledger import InsufficientCredits, Ledger
from proxy.credits.pricing import (
    ChatUsage,
    chat_cost,
    chat_hold,
    format_credits,
    prompt_estimate,
    usage_from,
)
from proxy.errors import ErrorKind, GatewayError, store_unavailable
from proxy.identity.principal import Principal
from proxy.outcome import Outcome
from proxy.styles.base import ChatCall
from proxy.upstream.wire import ChunkFilter

log = logging.getLogger("proxy.credits.meter")


@dataclass(slots=True)
class Result:
    """What the request path learned, filled in as it goes; read once at settlement."""

    status: Outcome = Outcome.FAILED
    usage: dict[str, Any] | None = None  # the upstream's usage (non-streamed answers)
    chunks: ChunkFilter | None = None  # streamed answers: usage chunk and delivered count
    captured: list[bytes] | None = None  # a stream's bytes as sent (for idempotent replay)


@dataclass(slots=True)
class ChatMeter:
    ledger: Ledger
    principal: Principal
    rates: Rates
    body: dict[str, Any]
    entry: dict[str, object]  # the journal fields known at admission
    hold_id: str | None = None
    started: float = field(default_factory=time.monotonic)
    _settled: bool = False

    async def settle(self, result: Result) -> None:
        """Charge what was used (or journal it, for guests); exactly once."""
        if self._settled:
            return
        self._settled = True
        usage = self._usage(result)
        cost = chat_cost(self.rates, usage) if usage else 0
        entry = {
            **self.entry,
            "status": result.status,
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "completion_tokens": usage.completion_tokens if usage else 0,
            "estimated": int(usage.estimated) if usage else 0,
            "price": cost,
            "latency_ms": int((time.monotonic() - self.started) * 1000),
            "ts": int(time.time()),
        }
        try:
            if self.hold_id is None:
                await self.ledger.journal(self.principal.account, {"type": "usage", "cost": 0,
                                                                   **entry})
            else:
                await self.ledger.settle(self.principal.account, self.hold_id, cost, entry)
        except RedisError:
            # The hold (if any) expires and the sweeper releases it: the caller is not charged.
            log.warning("settlement failed, left to the sweeper (request %s)",
                        self.entry.get("request_id"))

    def _usage(self, result: Result) -> ChatUsage | None:
        chunks = result.chunks
        reported = usage_from(result.usage if chunks is None else chunks.usage)
        if reported is not None:
            return reported
        delivered = chunks.chunks if chunks is not None else 0
        if delivered:  # cut before the usage chunk: charge what reached the client
            return ChatUsage(prompt_estimate(self.body), delivered, estimated=True)
        return None


async def open_chat_meter(
    ledger: Ledger, prices: PricesPolicy, principal: Principal, call: ChatCall,
    max_tokens: int | None, mode: str, route: str, request_id: str,
) -> ChatMeter:
    """Hold the request's worst case: 402 when the balance is short, 503 when the ledger is
    unreachable (metered routes fail closed)."""
    rates = prices.for_model(call.model, mode)
    entry: dict[str, object] = {
        "account": principal.account, "key_id": principal.key_id or "", "model": call.model,
        "mode": mode, "route": route, "request_id": request_id,
        "price_version": prices.version,
    }
    meter = ChatMeter(ledger, principal, rates, call.openai_body, entry)
    if principal.kind == "guest":
        return meter
    worst = chat_hold(rates, call.openai_body, max_tokens or prices.default_max_tokens)
    try:
        meter.hold_id = await ledger.hold(principal.account, worst, prices.hold_ttl_s)
    except InsufficientCredits as exc:
        raise GatewayError(
            ErrorKind.INSUFFICIENT_CREDITS,
            f"this request may cost up to {format_credits(worst)} credits and "
            f"{format_credits(exc.available)} are available",
        ) from None
    except RedisError:
        raise store_unavailable("credit ledger") from None
    meter.entry["held_max"] = worst
    return meter
