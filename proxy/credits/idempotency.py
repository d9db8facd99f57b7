"""`Idempotency-Key` on a POST: a retry replays the first result with one charge (as Stripe does).

The first request with a key claims it (atomically, SET NX) with a fingerprint of its route and
body; its successful result — status, content type and body, a stream's bytes included — is
stored for 24 hours. Then, for the same caller and key:

- same body, first one finished: the stored result is replayed; nothing runs, nothing is charged;
- same body, first one still running: 409, retry later;
- a different body: 422, the key was already used for another request.

A first request that fails (no backend, upstream error, 4xx) gives its claim back, so a retry runs
for real: nothing was charged for it (see metering). Keys are scoped to the caller's account.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass

import orjson
from aiohttp import web
from redis.asyncio import Redis

from proxy.errors import ErrorKind, GatewayError

HEADER = "Idempotency-Key"
TTL_S = 24 * 3600
MAX_KEY_LENGTH = 255
MAX_STORED_BYTES = 4 * 1024 * 1024  # a larger result is not replayable: the claim is released

_PENDING = b"pending"
PENDING_POLLS = 20
PENDING_POLL_S = 0.05


@dataclass(slots=True)
class Claim:
    redis: Redis
    key: str
    fingerprint: str

    async def store(self, status: int, content_type: str, body: bytes) -> None:
        if len(body) > MAX_STORED_BYTES:
            await self.release()
            return
        record = {"fingerprint": self.fingerprint, "status": status,
                  "content_type": content_type}
        await self.redis.set(self.key, orjson.dumps(record) + b"\n" + body, ex=TTL_S)

    async def release(self) -> None:
        await self.redis.delete(self.key)


async def claim(redis: Redis, account: str, route: str, request: web.Request, raw: bytes
                ) -> Claim | web.Response | None:
    """None without the header; a Claim for a first request; the stored Response for a retry."""
    given = request.headers.get(HEADER)
    if given is None:
        return None
    if not 0 < len(given) <= MAX_KEY_LENGTH:
        raise _invalid(f"must be 1 to {MAX_KEY_LENGTH} characters")
    scope = hashlib.sha256(f"{account}\0{given}".encode()).hexdigest()
    key = f"igw:{{{account}}}:idem:{scope}"
    fingerprint = hashlib.sha256(route.encode() + b"\0" + raw).hexdigest()
    pending = orjson.dumps({"fingerprint": fingerprint}) + b"\n" + _PENDING
    if await redis.set(key, pending, nx=True, ex=TTL_S):
        return Claim(redis, key, fingerprint)
    # The first may be finishing (a stream's last bytes go out before its result is stored):
    # wait a moment for it before calling this a concurrent duplicate.
    for _ in range(PENDING_POLLS):
        stored = await redis.get(key)
        if stored is None:  # expired or released in between: run it as a first request
            return await claim(redis, account, route, request, raw)
        head, _, body = (stored if isinstance(stored, bytes) else stored.encode()).partition(b"\n")
        record = orjson.loads(head)
        if record.get("fingerprint") != fingerprint:
            raise _invalid("was already used with a different request")
        if "status" in record:
            return web.Response(status=record["status"], body=body, headers={
                "Content-Type": record["content_type"], "Idempotent-Replayed": "true"})
        await asyncio.sleep(PENDING_POLL_S)
    raise GatewayError(ErrorKind.CONFLICT, "a request with this Idempotency-Key is still "
                       "running; retry when it has finished", headers={"Retry-After": "1"})


def _invalid(problem: str) -> GatewayError:
    detail = [{"loc": ["header", HEADER], "msg": f"{HEADER} {problem}", "type": "value_error"}]
    return GatewayError(ErrorKind.VALIDATION_ERROR, f"{HEADER} {problem}", detail=detail)
