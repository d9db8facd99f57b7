"""Alerts' webhooks: the endpoints operators register, the one sender of the fleet that
delivers every recorded alert to them (signed, retried with backoff, at least once), and what
the CLI lists of each alert's deliveries.

    igw:alerts:endpoints   hash  endpoint id -> its URL, secret, account ('*': every account)
    igw:alerts:accounts    set   accounts that may record alerts (a budget or a threshold set)
    igw:{A}:alerts         stream the alerts recorded (credits/lua/alerts.lua)
    igw:{A}:alerts_due     zset  alert (stream id) -> when its next attempt is due
    igw:{A}:alerts_sent    hash  alert -> each endpoint's delivery (credits.alerts.Attempts)

One process of the whole fleet sends at a time: the holder of the `alert-sender` lease. A
delivery's outcome is written once the receiver has answered, so a sender that dies between
the two sends that alert again (the same id): at least once, never lost. The targets are the
endpoints registered when an attempt is made; an alert recorded when none wanted it is kept
(listed as such) and not sent later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from redis.exceptions import RedisError

from proxy.config import AlertsSection
from proxy.credits.alerts import (
    SIGNATURE_HEADER,
    Attempts,
    Endpoint,
    attempts_from_json,
    attempts_to_json,
    event,
    new_endpoint,
    sign,
)
from proxy.credits.ledger import WATCHED, AccountKeys, as_fields, as_text
from proxy.store.client import Store
from proxy.store.lease import Lease

log = logging.getLogger("proxy.credits.webhooks")

ENDPOINTS = "igw:alerts:endpoints"
BATCH = 20  # alerts per account per round
SENDING = 8  # deliveries in flight at once
LOOKUPS = 1000  # accounts looked up in one pipeline


@dataclass(frozen=True, slots=True)
class Alert:
    """A recorded alert, as the CLI lists it: its body and each endpoint's delivery."""

    entry_id: str
    body: dict[str, Any]
    deliveries: dict[str, Attempts]
    due: bool  # still to be attempted (or attempted again)


class Webhooks:
    """The endpoints, and each account's alerts with their deliveries."""

    def __init__(self, redis: Store) -> None:
        self.redis = redis

    async def add(self, url: str, account: str | None) -> Endpoint:
        endpoint = new_endpoint(url, account)
        await self.redis.hset(ENDPOINTS, endpoint.id, endpoint.to_json())
        return endpoint

    async def remove(self, endpoint_id: str) -> Endpoint | None:
        """Stop sending to an endpoint; the one removed (None: there was none)."""
        raw = await self.redis.hget(ENDPOINTS, endpoint_id)
        if raw is None or not await self.redis.hdel(ENDPOINTS, endpoint_id):
            return None
        return Endpoint.from_json(endpoint_id, raw)

    async def endpoints(self) -> list[Endpoint]:
        raw = await self.redis.hgetall(ENDPOINTS)
        return sorted((Endpoint.from_json(as_text(k), v) for k, v in raw.items()),
                      key=lambda e: (e.created, e.id))

    async def alerts(self, account: str, count: int = 20) -> list[Alert]:
        """The account's newest alerts, newest first."""
        keys = AccountKeys.of(account)
        rows = await self.redis.xrevrange(keys.alerts[0], count=count)
        found = []
        for raw_id, raw_fields in rows or ():
            entry_id = as_text(raw_id)
            fields = as_fields(raw_fields)
            state = await self.redis.hget(keys.deliveries, entry_id)
            due = await self.redis.zscore(keys.alerts[1], entry_id) is not None
            found.append(Alert(entry_id, event(account, entry_id, fields),
                               attempts_from_json(state), due))
        return found


class Sender:
    """Delivers the alerts due, in whichever process holds the lease (each worker runs one)."""

    def __init__(self, redis: Store, settings: AlertsSection) -> None:
        self.redis = redis
        self.settings = settings
        self.lease = Lease(redis, "alert-sender")
        self._session: aiohttp.ClientSession | None = None
        self._sending = asyncio.Semaphore(SENDING)

    async def run(self) -> None:
        every = self.settings.every_s
        # A round ends well before the lease could pass to another process mid-round.
        ttl = 3 * (every + self.settings.timeout_s)
        while True:
            await asyncio.sleep(every)
            if not await self.lease.hold(ttl_s=ttl):
                continue
            try:
                async with asyncio.timeout(ttl / 2):
                    await self.round()
            except (RedisError, TimeoutError) as exc:
                log.warning("an alert delivery round stopped (%s); the next one resumes it",
                            type(exc).__name__)
            except Exception:  # our bug: logged, and the sender lives on
                log.exception("an alert delivery round failed; the next one resumes it")

    async def close(self) -> None:
        await self.lease.release()
        if self._session is not None:
            await self._session.close()

    async def round(self, now_s: float | None = None) -> int:
        """Attempt every alert due now; returns how many attempts were made."""
        now = time.time() if now_s is None else now_s
        endpoints = await Webhooks(self.redis).endpoints()
        accounts = sorted(as_text(raw) for raw in await self.redis.smembers(WATCHED))
        jobs = []
        for start in range(0, len(accounts), LOOKUPS):  # one pipeline per thousand accounts
            chunk = accounts[start:start + LOOKUPS]
            async with self.redis.pipeline(transaction=False) as pipe:
                for account in chunk:
                    pipe.zrangebyscore(AccountKeys.of(account).alerts[1], "-inf", now,
                                       start=0, num=BATCH)
                found = await pipe.execute()
            for account, entry_ids in zip(chunk, found, strict=True):
                targets = [e for e in endpoints if e.wants(account)]
                jobs += [self._deliver(account, as_text(i), targets, now) for i in entry_ids]
        return sum(await asyncio.gather(*jobs))

    async def _deliver(self, account: str, entry_id: str, targets: Sequence[Endpoint],
                       now: float) -> int:
        keys = AccountKeys.of(account)
        stream, due_key = keys.alerts[0], keys.alerts[1]
        rows = await self.redis.xrange(stream, min=entry_id, max=entry_id)
        if not rows:  # trimmed from the stream (a thousand newer ones): nothing left to send
            await self.redis.zrem(due_key, entry_id)
            return 0
        fields = as_fields(rows[0][1])
        body = orjson.dumps(event(account, entry_id, fields))
        deliveries = attempts_from_json(await self.redis.hget(keys.deliveries, entry_id))
        sends = [(e, deliveries.setdefault(e.id, Attempts())) for e in targets]
        sends = [(e, a) for e, a in sends if a.due(now)]
        outcomes = await asyncio.gather(*(self._post(e, body) for e, _ in sends))
        for (_, attempts), (ok, outcome) in zip(sends, outcomes, strict=True):
            attempts.record(ok, outcome, time.time(), self.settings.retry_s)
            if not ok:
                log.info("alert %s: attempt %d failed (%s)", entry_id, attempts.attempts,
                         outcome)
        pending = [deliveries[e.id].next_at for e in targets if deliveries[e.id].state ==
                   "pending"]
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.deliveries, entry_id, attempts_to_json(deliveries))
            if pending:
                pipe.zadd(due_key, {entry_id: min(pending)})
            else:
                pipe.zrem(due_key, entry_id)
            await pipe.execute()
        return len(sends)

    async def _post(self, endpoint: Endpoint, body: bytes) -> tuple[bool, str]:
        """One attempt: (accepted, what happened). Any 2xx is accepted; the URL is never
        logged (it may carry a token)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s))
        headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign(endpoint.secret,
                                                                             body),
                   "User-Agent": "inference-gateway-alerts"}
        async with self._sending:
            try:
                async with self._session.post(endpoint.url, data=body, headers=headers,
                                              allow_redirects=False) as response:
                    await response.read()
                    return 200 <= response.status < 300, f"HTTP {response.status}"
            except TimeoutError:
                return False, "timeout"
            except (aiohttp.ClientError, ValueError, OSError) as exc:  # ValueError: a bad URL
                return False, type(exc).__name__
