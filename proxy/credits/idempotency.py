"""`Idempotency-Key` on a POST: a retry replays the first result with one charge (as Stripe does).

The first request with a key claims it (atomically, SET NX) with a fingerprint of its route and
body. The claim is "pending" for about as long as a request may run (`pending_ttl_s`); its
successful result — status, content type and body, a stream's bytes included — then replaces it for
24 hours: in the record itself up to `INLINE_BYTES`; a larger body in the media store (proxy.blobs,
counted under the account's media cap), the record naming its key (`Keeper`). For the same caller
and key:

- same body, first one finished: the stored result is replayed; nothing runs, nothing is charged;
- same body, first one still running: 409, retry later;
- a different body: 422, the key was already used for another request.

A first request that fails (no backend, upstream error, 4xx) gives its claim back, so a retry runs
for real: nothing was charged for it (see metering). One whose answer cannot be kept (over
`MAX_STORED_BYTES`, over the account's media cap, or the media store failing) keeps its claim
without the answer: a retry is told so (409), never run and charged again. Keys are scoped to the
caller's account. The claim is known (`Claim.key`) before it is made, so a request cancelled while
claiming still gives it back.

The same request is the same route and the same parsed body: keys in another order, other
whitespace, are the same request (`canonical`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from proxy.blobs.base import StoreFailed
from proxy.blobs.media import MediaStore
from proxy.credits.settler import Settler
from proxy.errors import ErrorKind, GatewayError
from proxy.http.body import Form
from proxy.ids import hex_id
from proxy.store.client import Store

log = logging.getLogger("proxy")

HEADER = "Idempotency-Key"
TTL_S = 24 * 3600
MAX_KEY_LENGTH = 255
INLINE_BYTES = 64 * 1024  # a larger result goes to the media store, never into the ledger
MAX_STORED_BYTES = 64 * 1024 * 1024  # a larger result is not replayable (409 on a retry)

_PENDING = b"pending"
PENDING_POLLS = 20
PENDING_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class Replay:
    """The first request's result, for a retry: its body in the record, or a media key."""

    status: int
    content_type: str
    body: bytes
    blob: str | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    key: str
    fingerprint: str
    owner: str  # this request's own mark: a SET NX retried after a lost reply finds it
    account: str

    async def acquire(self, redis: Store, pending_ttl_s: int) -> Replay | None:
        """Claim the key: None for a first request, the first one's result for a retry."""
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
                raise reused()
            if record.get("owner") == self.owner:
                return None  # our own claim: the first SET NX ran, its reply was lost
            if record.get("too_large"):
                raise GatewayError(ErrorKind.CONFLICT, "a request with this Idempotency-Key "
                                   "already completed; its answer was too large to keep for "
                                   "a replay", headers={"Idempotent-Replayed": "true"})
            if "status" in record:
                return Replay(record["status"], record["content_type"], body, record.get("blob"))
            await asyncio.sleep(PENDING_POLL_S)
        raise GatewayError(ErrorKind.CONFLICT, "a request with this Idempotency-Key is still "
                           "running; retry when it has finished", headers={"Retry-After": "1"})

    def store(self, status: int, content_type: str, body: bytes = b"", *,
              blob: str | None = None, kept: bool = True) -> tuple[str | bytes | int, ...]:
        """The command that keeps the result for retries (queued after the settlement): its
        body (small), the media key of its body (`blob`), or, not `kept`, only that it
        completed."""
        record: dict[str, object] = {"fingerprint": self.fingerprint, "status": status,
                                     "content_type": content_type}
        if blob is not None:
            record["blob"] = blob
        if not kept:
            record["too_large"] = True
        return ("SET", self.key, orjson.dumps(record) + b"\n" + body, "EX", TTL_S)

    def release(self) -> tuple[str, ...]:
        """The command that gives the key back (a retry then runs for real)."""
        return ("DEL", self.key)


class Keeper:
    """Keeps completed results for retries, each once its request has settled: a small body in
    its record (a settler write), a larger one in the media store first (a task of its own, so
    a request cancelled as it ends still keeps its answer; a retry meanwhile finds the claim
    pending)."""

    def __init__(self, settler: Settler, media: MediaStore) -> None:
        self.settler = settler
        self.media = media
        self._writing: set[asyncio.Task[None]] = set()

    def keep(self, claim: Claim, status: int, content_type: str, body: bytes, cap: int) -> None:
        if len(body) <= INLINE_BYTES:
            self.settler.add(claim.key, claim.store(status, content_type, body))
            return
        task = asyncio.get_running_loop().create_task(
            self._keep_large(claim, status, content_type, body, cap))
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    async def _keep_large(self, claim: Claim, status: int, content_type: str, body: bytes,
                          cap: int) -> None:
        blob = None
        if len(body) <= MAX_STORED_BYTES:
            try:
                blob = await self.media.keep(claim.account, content_type, body, ttl_s=TTL_S,
                                             cap=cap)
            except StoreFailed:
                log.warning("an idempotent result could not be kept in the media store",
                            exc_info=True)
        self.settler.add(claim.key, claim.store(status, content_type, blob=blob,
                                                kept=blob is not None))

    async def close(self, timeout_s: float) -> None:
        """Let the writes under way finish (before the settler drains)."""
        if self._writing:
            await asyncio.wait(set(self._writing), timeout=timeout_s)


def claim_for(account: str, route: str, headers: Mapping[str, str], body: object,
              kind: str = "idem") -> Claim | None:
    """The request's claim (not yet made), or None without the header; `kind` names its
    records apart (an operator's top-up keys, "topup", never meet the account's own). No I/O."""
    given = headers.get(HEADER)
    if given is None:
        return None
    if not 0 < len(given) <= MAX_KEY_LENGTH:
        raise _invalid(f"must be 1 to {MAX_KEY_LENGTH} characters")
    scope = hashlib.sha256(f"{account}\0{given}".encode()).hexdigest()
    fingerprint = hashlib.sha256(route.encode() + b"\0" + canonical(body)).hexdigest()
    return Claim(f"igw:{{{account}}}:{kind}:{scope}", fingerprint, hex_id(), account)


def top_up_once(account: str, key: str | None, micro: int, reason: str
                ) -> tuple[str, str, int] | None:
    """A top-up's Idempotency-Key (the admin route's header, the CLI's option) as
    `Ledger.credit` takes it: the key's record, the top-up's fingerprint, how long it is kept.
    The operator's keys, apart from the account's own request keys."""
    claim = claim_for(account, "topup", {} if key is None else {HEADER: key},
                      {"amount": micro, "reason": reason}, kind="topup")
    return None if claim is None else (claim.key, claim.fingerprint, TTL_S)


def canonical(body: object) -> bytes:
    """A parsed body as bytes that do not depend on how it was written: JSON with sorted keys;
    a form's fields sorted, each uploaded file by its digest."""
    if isinstance(body, Form):
        files = {name: [upload.filename, upload.content_type,
                        hashlib.sha256(upload.data).hexdigest()]
                 for name, upload in body.files.items()}
        body = {"fields": body.fields, "files": files}
    return orjson.dumps(body, option=orjson.OPT_SORT_KEYS)


def reused() -> GatewayError:
    """422: the key was used before, for another request."""
    return _invalid("was already used with a different request")


def _invalid(problem: str) -> GatewayError:
    detail = [{"loc": ["header", HEADER], "msg": f"{HEADER} {problem}", "type": "value_error"}]
    return GatewayError(ErrorKind.VALIDATION_ERROR, f"{HEADER} {problem}", detail=detail)
