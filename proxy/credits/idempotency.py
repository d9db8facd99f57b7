"""`Idempotency-Key` on a POST: a retry replays the first result with one charge (as Stripe does).

The first request with a key claims it (atomically, SET NX) with a fingerprint of its route and
body. The claim is "pending" for about as long as a request may run (`pending_ttl_s`); its
successful result — status, content type and body, a stream's bytes included — then replaces it
for 24 hours. For the same caller and key:

- same body, first one finished: the stored result is replayed; nothing runs, nothing is charged;
- same body, first one still running: 409, retry later;
- a different body: 422, the key was already used for another request.

A first request that fails (no backend, upstream error, 4xx) gives its claim back, so a retry
runs for real: nothing was charged for it (see metering). One whose answer is too large to keep
(`MAX_STORED_BYTES`) keeps its claim without the answer: a retry is told so (409), never run and
charged again. Keys are scoped to the caller's account. The claim is known (`Claim.key`) before it
is made, so a request cancelled while claiming still gives it back.

The same request is the same route and the same parsed body: keys in another order, other
whitespace, are the same request (`canonical`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web

from proxy.errors import ErrorKind, GatewayError
from proxy.http.body import Form
from proxy.ids import hex_id
from proxy.store.client import Store

HEADER = "Idempotency-Key"
TTL_S = 24 * 3600
MAX_KEY_LENGTH = 255
MAX_STORED_BYTES = 4 * 1024 * 1024  # a larger result is not replayable: the claim is released

_PENDING = b"pending"
PENDING_POLLS = 20
PENDING_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Claim:
    key: str
    fingerprint: str
    owner: str  # this request's own mark: a SET NX retried after a lost reply finds it

    async def acquire(self, redis: Store, pending_ttl_s: int) -> web.Response | None:
        """Claim the key: None for a first request, the stored Response for a retry."""
        pending = orjson.dumps({"fingerprint": self.fingerprint, "owner": self.owner}) \
            + b"\n" + _PENDING
        if await redis.set(self.key, pending, nx=True, ex=pending_ttl_s):
            return None
        # The first may be finishing (a stream's last bytes go out before its result is stored):
        # wait a moment for it before calling this a concurrent duplicate.
        for _ in range(PENDING_POLLS):
            stored = await redis.get(self.key)
            if stored is None:  # expired or released in between: run it as a first request
                return await self.acquire(redis, pending_ttl_s)
            raw = stored if isinstance(stored, bytes) else stored.encode()
            head, _, body = raw.partition(b"\n")
            record = orjson.loads(head)
            if record.get("fingerprint") != self.fingerprint:
                raise _invalid("was already used with a different request")
            if record.get("owner") == self.owner:
                return None  # our own claim: the first SET NX ran, its reply was lost
            if record.get("too_large"):
                raise GatewayError(ErrorKind.CONFLICT, "a request with this Idempotency-Key "
                                   "already completed; its answer was too large to keep for "
                                   "a replay", headers={"Idempotent-Replayed": "true"})
            if "status" in record:
                return web.Response(status=record["status"], body=body, headers={
                    "Content-Type": record["content_type"], "Idempotent-Replayed": "true"})
            await asyncio.sleep(PENDING_POLL_S)
        raise GatewayError(ErrorKind.CONFLICT, "a request with this Idempotency-Key is still "
                           "running; retry when it has finished", headers={"Retry-After": "1"})

    def store(self, status: int, content_type: str, body: bytes) -> tuple[str | bytes | int, ...]:
        """The command that keeps the result for retries (queued after the settlement); too
        large to keep: that it completed, without the answer."""
        record: dict[str, object] = {"fingerprint": self.fingerprint, "status": status,
                                     "content_type": content_type}
        if len(body) > MAX_STORED_BYTES:
            record["too_large"] = True
            body = b""
        return ("SET", self.key, orjson.dumps(record) + b"\n" + body, "EX", TTL_S)

    def release(self) -> tuple[str, ...]:
        """The command that gives the key back (a retry then runs for real)."""
        return ("DEL", self.key)


def claim_for(account: str, route: str, headers: Mapping[str, str], body: object
              ) -> Claim | None:
    """The request's claim (not yet made), or None without the header. No I/O."""
    given = headers.get(HEADER)
    if given is None:
        return None
    if not 0 < len(given) <= MAX_KEY_LENGTH:
        raise _invalid(f"must be 1 to {MAX_KEY_LENGTH} characters")
    scope = hashlib.sha256(f"{account}\0{given}".encode()).hexdigest()
    fingerprint = hashlib.sha256(route.encode() + b"\0" + canonical(body)).hexdigest()
    return Claim(f"igw:{{{account}}}:idem:{scope}", fingerprint, hex_id())


def canonical(body: object) -> bytes:
    """A parsed body as bytes that do not depend on how it was written: JSON with sorted keys;
    a form's fields sorted, each uploaded file by its digest."""
    if isinstance(body, Form):
        files = {name: [upload.filename, upload.content_type,
                        hashlib.sha256(upload.data).hexdigest()]
                 for name, upload in body.files.items()}
        body = {"fields": body.fields, "files": files}
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def _invalid(problem: str) -> GatewayError:
    detail = [{"loc": ["header", HEADER], "msg": f"{HEADER} {problem}", "type": "value_error"}]
    return GatewayError(ErrorKind.VALIDATION_ERROR, f"{HEADER} {problem}", detail=detail)
