"""API key records in Redis, a per-process cache in front of them, and revocation fan-out.

Redis layout (the raw key is never stored, only its SHA-256 digest):

    igw:key:{digest}          hash   id, account, tier, status (active|revoked), label, created
    igw:keyid:{id}            string digest of the key whose public id this is
    igw:account:{account}:keys  set  ids of the account's keys (revoked ones included)
    igw:accounts              set    every account that has ever had a key
    igw:revocations           pub/sub channel: the digest of each revoked key
    igw:keys:seal             string the secret new keys are sealed with (hex), made once by
                                     the first store that needs it (proxy.identity.apikeys)

Each worker caches records by digest for `KeysPolicy.cache_ttl_s` (bounded, least recently used
dropped first), unknown digests included (a key is random: none is created after being
guessed). Revocation is pushed: `revoke` publishes the digest and every process's
`listen_for_revocations` task evicts it, so a revoked key stops working everywhere at once, not
after the TTL. A revocation published while a listener was disconnected is lost, so the listener
clears the whole cache each time its subscription is (re)established.

Redis errors from `lookup` and the admin calls propagate: the caller decides (503 on a request).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from proxy.config import KeysPolicy
from proxy.identity import apikeys
from proxy.identity.principal import ACCOUNT_PATTERN
from proxy.store.client import Store, listener_client

__all__ = ["ACCOUNT_PATTERN", "REVOCATIONS", "AccountView", "KeyRecord", "KeyStore"]

log = logging.getLogger("proxy.identity.keystore")

REVOCATIONS: Final = "igw:revocations"
ACCOUNTS: Final = "igw:accounts"
SEAL_SECRET: Final = "igw:keys:seal"
SEAL_RETRY_S: Final = 10.0  # a store that could not read the secret tries again this often
LABEL_MAX: Final = 200
_ACCOUNT_RE: Final = re.compile(ACCOUNT_PATTERN)
_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")  # labels are printed in terminals

KeyStatus = Literal["active", "revoked"]


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    account: str
    tier: str
    status: KeyStatus
    label: str
    created: int  # unix seconds
    digest: str

    @property
    def active(self) -> bool:
        return self.status == "active"

    def public(self) -> dict[str, Any]:
        """The record as shown to operators: everything but the digest."""
        return {"id": self.id, "account": self.account, "tier": self.tier,
                "status": self.status, "label": self.label, "created": self.created}


class AccountView(msgspec.Struct, frozen=True, kw_only=True):
    account: str
    keys: list[KeyRecord]

    def public(self) -> dict[str, Any]:
        return {"account": self.account, "keys": [k.public() for k in self.keys]}


def _key(digest: str) -> str:
    return f"igw:key:{digest}"


def _keyid(kid: str) -> str:
    return f"igw:keyid:{kid}"


def _account_keys(account: str) -> str:
    return f"igw:account:{account}:keys"


def _text(value: bytes | str) -> str:
    # The store works with clients made with or without decode_responses.
    return value.decode() if isinstance(value, bytes) else value


class KeyStore:
    """Key records for one Redis; one instance per worker process, shared by its requests."""

    def __init__(self, redis: Store, policy: KeysPolicy, *, max_cache_entries: int = 100_000,
                 ping_interval_s: float = 10.0) -> None:
        self._redis = redis
        self._policy = policy
        self._max_cache = max_cache_entries
        self._ping_interval = ping_interval_s
        self._cache: OrderedDict[str, tuple[float, KeyRecord | None]] = OrderedDict()
        self._reading: dict[str, asyncio.Future[KeyRecord | None]] = {}  # reads in flight
        # Bumped by every eviction: a lookup that raced one must not cache what it read.
        self._generation = 0
        self._listening = False
        self.listener_connects = 0  # how often the listener has (re)subscribed
        self._seal: bytes | None = None
        self._seal_retry = 0.0

    @property
    def redis(self) -> Store:
        """The client this store uses (the CLI shares it with the ledger)."""
        return self._redis

    @property
    def listening(self) -> bool:
        """True while the revocation listener holds a confirmed subscription."""
        return self._listening

    @property
    def cache_size(self) -> int:
        return len(self._cache)

    # ---- keys ----------------------------------------------------------------------------

    async def create(self, account: str, tier: str, label: str = "") -> tuple[str, KeyRecord]:
        """A new active key for `account`. The raw key is returned here once and kept nowhere."""
        if not _ACCOUNT_RE.fullmatch(account):
            raise ValueError("account must match " + ACCOUNT_PATTERN)
        if len(label) > LABEL_MAX or _CONTROL_RE.search(label):
            raise ValueError(f"label must be at most {LABEL_MAX} printable characters")
        secret = await self.seal_secret()
        for _ in range(8):
            raw = apikeys.generate(self._policy.prefix, secret)
            digest = apikeys.digest(raw)
            kid = apikeys.key_id(digest)
            # Ids are 48 bits: claim one atomically so two keys never share it.
            if await self._redis.set(_keyid(kid), digest, nx=True):
                break
        else:  # pragma: no cover - eight 48-bit collisions in a row
            raise RuntimeError("could not allocate a key id")
        record = KeyRecord(id=kid, account=account, tier=tier, status="active", label=label,
                           created=int(time.time()), digest=digest)
        # Not one transaction: the three keys lie in different Cluster slots. The record goes
        # first; a crash before the indexes leaves a key nobody was ever given.
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(_key(digest), mapping={
                "id": kid, "account": account, "tier": tier, "status": "active",
                "label": label, "created": str(record.created),
            })
            pipe.sadd(_account_keys(account), kid)
            pipe.sadd(ACCOUNTS, account)
            await pipe.execute()
        return raw, record

    async def seal_secret(self) -> bytes:
        """The secret new keys are sealed with: made by the first store that creates a key."""
        if self._seal is None:
            await self._redis.set(SEAL_SECRET, secrets.token_hex(32), nx=True)
            if await self.read_seal() is None:  # gone between the two calls (a flushed store)
                raise RedisError("the key seal's secret vanished")
        assert self._seal is not None
        return self._seal

    async def read_seal(self) -> bytes | None:
        """The seal's secret if a key was ever sealed here (read once; nothing is written)."""
        if self._seal is None:
            value = await self._redis.get(SEAL_SECRET)
            self._seal = bytes.fromhex(_text(value)) if value is not None else None
        return self._seal

    async def vouches_for(self, raw_key: str) -> bool:
        """A well-formed key sealed by a store of this Redis: one this gateway made, so looking
        it up is never a stranger's guess. False while the secret cannot be read (the key is
        then looked up as any other)."""
        if self._seal is None:
            if time.monotonic() < self._seal_retry:
                return False
            self._seal_retry = time.monotonic() + SEAL_RETRY_S
            try:
                await self.read_seal()
            except RedisError:
                return False
        return self._seal is not None and apikeys.sealed(raw_key, self._seal)

    def cached(self, raw_key: str) -> tuple[bool, KeyRecord | None]:
        """(found, record) from this worker's cache alone; no I/O."""
        if not apikeys.well_formed(raw_key, self._policy.prefix):
            return True, None  # a typo or a stranger's token: known unknown
        digest = apikeys.digest(raw_key)
        hit = self._cache.get(digest)
        if hit is None:
            return False, None
        if hit[0] <= time.monotonic():
            del self._cache[digest]
            return False, None
        self._cache.move_to_end(digest)
        return True, hit[1]

    async def lookup(self, raw_key: str) -> KeyRecord | None:
        """The record of a key (revoked ones too, so the caller can say so), None if unknown.

        Unknown keys are cached too, so a minted well-formed key costs one Redis read per TTL,
        not one per request; concurrent lookups of one key share a single read."""
        found, record = self.cached(raw_key)
        if found:
            return record
        digest = apikeys.digest(raw_key)
        reading = self._reading.get(digest)
        if reading is not None:
            return await asyncio.shield(reading)
        reading = asyncio.ensure_future(self._read_and_cache(digest, self._generation))
        self._reading[digest] = reading
        reading.add_done_callback(lambda done: self._read_done(digest, done))
        return await asyncio.shield(reading)

    def _read_done(self, digest: str, done: asyncio.Future[KeyRecord | None]) -> None:
        self._reading.pop(digest, None)
        if not done.cancelled():
            done.exception()  # retrieved here, in case every waiter went away

    async def _read_and_cache(self, digest: str, generation: int) -> KeyRecord | None:
        """Read; cache the answer unless an eviction happened since the lookup began."""
        record = await self._read(digest)
        if generation == self._generation and self._policy.cache_ttl_s:
            self._cache[digest] = (time.monotonic() + self._policy.cache_ttl_s, record)
            while len(self._cache) > self._max_cache:
                self._cache.popitem(last=False)
        return record

    async def revoke(self, key_or_id: str) -> KeyRecord | None:
        """Revoke by raw key or key id; None when it names no key. Revoking twice is harmless."""
        if apikeys.is_key_id(key_or_id):
            found = await self._redis.get(_keyid(key_or_id))
            if found is None:
                return None
            digest = _text(found)
        elif apikeys.well_formed(key_or_id, self._policy.prefix):
            digest = apikeys.digest(key_or_id)
        else:
            return None
        # Only flip a record that exists: HSET alone would create a stub for an unknown digest.
        if not await self._redis.exists(_key(digest)):
            return None
        await self._redis.hset(_key(digest), "status", "revoked")
        # Written before it is announced, so a listener that evicts and re-reads sees "revoked".
        await self._redis.publish(REVOCATIONS, digest)
        self._evict(digest)
        return await self._read(digest)

    async def list(self, account: str | None = None) -> builtins.list[KeyRecord]:
        """Every key (or an account's), sorted by account, creation time and id."""
        if account is not None:
            accounts = [account]
        else:
            accounts = sorted(_text(a) for a in await self._redis.smembers(ACCOUNTS))
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in accounts:
                pipe.smembers(_account_keys(name))
            id_sets = await pipe.execute()
        ids = [_text(kid) for members in id_sets for kid in members]
        if not ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:  # no MGET across slots
            for kid in ids:
                pipe.get(_keyid(kid))
            digests = [_text(d) for d in await pipe.execute() if d]
        async with self._redis.pipeline(transaction=False) as pipe:
            for digest in digests:
                pipe.hgetall(_key(digest))
            fields = await pipe.execute()
        records = [_record(d, f) for d, f in zip(digests, fields, strict=True) if f]
        return sorted(records, key=lambda r: (r.account, r.created, r.id))

    async def account(self, account: str) -> AccountView | None:
        if not await self._redis.sismember(ACCOUNTS, account):
            return None
        return AccountView(account=account, keys=await self.list(account))

    async def _read(self, digest: str) -> KeyRecord | None:
        try:
            fields = await self._redis.hgetall(_key(digest))
        except RedisConnectionError:
            # A pooled connection gone stale (Redis restarted) fails once; a read is safe to
            # repeat, and a client made with from_url() has no retries of its own.
            fields = await self._redis.hgetall(_key(digest))
        return _record(digest, fields) if fields else None

    # ---- cache and revocation fan-out ----------------------------------------------------

    def _evict(self, digest: str) -> None:
        self._generation += 1
        self._cache.pop(digest, None)

    def clear_cache(self) -> None:
        self._generation += 1
        self._cache.clear()

    async def listen_for_revocations(
            self, notices: Mapping[str, Callable[[str], object]] | None = None) -> None:
        """Run for the life of the process: evict revoked digests from this process's cache.

        `notices` are other channels the process follows on the same connection (e.g. policy
        reloads): channel -> handler of each message's text. Retries with backoff (0.1 s
        doubling to 5 s) while Redis is away. Cancel the task to stop it: it ends cancelled,
        with its connection closed.
        """
        backoff = 0.1
        turn = 0
        while True:
            connects = self.listener_connects
            client: Redis | None = None
            turn += 1
            try:
                client = await listener_client(self._redis, turn)
                await self._listen_once(client, notices or {})
            except Exception as exc:  # redis-py raises more than RedisError while failing over
                # The exception text may carry the server address; its class is enough here.
                log.warning("revocation listener lost Redis (%s); retrying in %.1f s",
                            type(exc).__name__, backoff)
            finally:
                self._listening = False
                if client is not None and client is not self._redis:
                    await client.aclose()
            if self.listener_connects != connects:
                backoff = 0.1  # it was subscribed for a while: this is a fresh outage
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _listen_once(self, client: Redis,
                           notices: Mapping[str, Callable[[str], object]]) -> None:
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(REVOCATIONS, *notices)
            awaiting_pong = False
            while True:
                message = await pubsub.get_message(timeout=self._ping_interval)
                if message is None:
                    # A silent channel may be a dead connection: a PING must come back.
                    if awaiting_pong:
                        raise ConnectionError("no answer to PING on the revocation channel")
                    await pubsub.ping()
                    awaiting_pong = True
                    continue
                awaiting_pong = False
                kind = message["type"]
                channel = _text(message["channel"])
                if kind == "subscribe" and channel != REVOCATIONS:
                    continue
                if kind == "subscribe":
                    # Also seen when redis-py re-subscribes after a reconnect of its own.
                    self.clear_cache()
                    self.listener_connects += 1
                    self._listening = True
                    log.info("revocation listener subscribed; key cache cleared")
                elif kind == "message" and channel == REVOCATIONS:
                    self._evict(_text(message["data"]))
                elif kind == "message":
                    notices[channel](_text(message["data"]))
        finally:
            with contextlib.suppress(Exception):  # the connection may already be gone
                await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it bare


def _record(digest: str, fields: dict[Any, Any]) -> KeyRecord:
    values = {_text(k): _text(v) for k, v in fields.items()}
    return KeyRecord(
        id=values["id"], account=values["account"], tier=values["tier"],
        status="revoked" if values["status"] == "revoked" else "active",
        label=values.get("label", ""), created=int(values["created"]), digest=digest,
    )
