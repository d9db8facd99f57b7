"""The credit ledger in Redis: the only writer of balances. Every change is one atomic Lua script.

Per account A (keys share the hash tag `{A}`, so each script stays in one Cluster slot):

    igw:{A}:bal       hash    available, held, spent, credited     (integer micro-credits)
    igw:{A}:holds     hash    hold id -> amount held
    igw:{A}:hold_exp  zset    hold id -> expiry (unix seconds)
    igw:{A}:journal   stream  one entry per credit and one terminal entry per hold

Value moves credited -> available -> held -> spent (or back to available), so at every moment
`credited == available + held + spent`, `held == sum(holds)`, and replaying the journal gives
`credited` (its credit entries) and `spent` (its charges). `reconcile()` checks exactly that.
A hold ends exactly once: the settle script does nothing when the hold is already gone, so a
settle racing the sweeper (or a retry) can never charge twice.

Outside the slot, an index `igw:ledger:accounts` (set) lets the sweeper and reconcile find
accounts; it is only an index — losing an entry never changes money.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources

from redis.asyncio import Redis

ACCOUNTS = "igw:ledger:accounts"


def lua_script(name: str) -> str:
    """A script from credits/lua/ (files, so they read as Lua and diff as Lua)."""
    return (resources.files("proxy.credits") / "lua" / f"{name}.lua").read_text()


@dataclass(frozen=True, slots=True)
class Balance:
    available: int
    held: int
    spent: int
    credited: int


class InsufficientCredits(Exception):
    def __init__(self, available: int, needed: int) -> None:
        super().__init__(f"available {available} < needed {needed}")
        self.available = available
        self.needed = needed


def _keys(account: str) -> tuple[str, str, str, str]:
    tag = f"igw:{{{account}}}"
    return f"{tag}:bal", f"{tag}:holds", f"{tag}:hold_exp", f"{tag}:journal"


def _text(value: object) -> str:
    """redis-py answers bytes (or str); this module speaks str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(raw: object) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def _pairs(entry: Mapping[str, object]) -> list[str]:
    return [str(item) for pair in entry.items() for item in pair]


class Ledger:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._indexed: set[str] = set()  # accounts this process already put in the index
        # register_script: EVALSHA, reloading the script on NOSCRIPT (e.g. after a restart).
        self._hold = redis.register_script(lua_script("hold"))
        self._settle = redis.register_script(lua_script("settle"))
        self._credit = redis.register_script(lua_script("credit"))
        self._sweep = redis.register_script(lua_script("sweep"))

    async def credit(self, account: str, amount: int, entry: Mapping[str, object]) -> int:
        """Top up (or adjust, when negative); journaled. Returns the new available balance."""
        bal, _, _, journal = _keys(account)
        await self._index(account)
        ok, available = await self._credit(keys=[bal, journal], args=[amount, *_pairs(entry)])
        if not ok:
            raise InsufficientCredits(int(available), -amount)
        return int(available)

    async def hold(self, account: str, amount: int, ttl_s: int) -> str:
        """Reserve `amount`; raises InsufficientCredits. Returns the hold id."""
        hold_id = uuid.uuid4().hex
        await self._index(account)  # first: a crash after it is harmless
        bal, holds, expiry, _ = _keys(account)
        ok, available = await self._hold(
            keys=[bal, holds, expiry], args=[hold_id, amount, int(time.time()) + ttl_s]
        )
        if ok != 1:
            raise InsufficientCredits(int(available), amount)
        return hold_id

    async def settle(self, account: str, hold_id: str, cost: int,
                     entry: Mapping[str, object]) -> int | None:
        """End the hold: charge min(cost, held), release the rest, journal it. Exactly once:
        None when the hold had already ended (settled, released or swept)."""
        charged = await self._settle(keys=list(_keys(account)),
                                     args=[hold_id, cost, *_pairs(entry)])
        return None if int(charged) < 0 else int(charged)

    async def _index(self, account: str) -> None:
        """Put the account in the sweeper's index once per process (not a round trip per hold)."""
        if account not in self._indexed:
            await self.redis.sadd(ACCOUNTS, account)
            if len(self._indexed) > 100_000:
                self._indexed.clear()
            self._indexed.add(account)

    async def journal(self, account: str, entry: Mapping[str, object]) -> None:
        """A usage entry with no money moved (guests)."""
        await self.redis.xadd(_keys(account)[3], {k: str(v) for k, v in entry.items()})

    async def balance(self, account: str) -> Balance:
        get = {k: int(v) for k, v in _fields(await self.redis.hgetall(_keys(account)[0])).items()}
        return Balance(get.get("available", 0), get.get("held", 0), get.get("spent", 0),
                       get.get("credited", 0))

    async def sweep(self, now: float | None = None) -> int:
        """Release expired holds in every account; returns how many were released."""
        released = 0
        async for raw in self.redis.sscan_iter(ACCOUNTS):
            account = _text(raw)
            released += int(await self._sweep(keys=list(_keys(account)),
                                              args=[int(now if now is not None else time.time())]))
        return released

    async def entries(self, account: str, *, before: str | None = None, count: int = 50
                      ) -> list[tuple[str, dict[str, str]]]:
        """Journal entries, newest first; page with `before` = the last id of the previous page."""
        end = f"({before}" if before else "+"
        rows = await self.redis.xrevrange(_keys(account)[3], max=end, min="-", count=count)
        return [(_text(i), _fields(f)) for i, f in rows or ()]

    async def all_entries(self, account: str) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        start = "-"
        while True:
            rows = list(await self.redis.xrange(_keys(account)[3], min=start, max="+",
                                                count=1000) or ())
            out.extend(_fields(f) for _, f in rows)
            if len(rows) < 1000:
                return out
            start = "(" + _text(rows[-1][0])

    async def accounts(self) -> list[str]:
        return sorted(_text(m) for m in await self.redis.smembers(ACCOUNTS))

    async def reconcile(self, accounts: Iterable[str] | None = None) -> list[str]:
        """Every way the ledger could disagree with itself; empty when it adds up."""
        problems: list[str] = []
        for account in accounts if accounts is not None else await self.accounts():
            problems.extend(await self._reconcile_one(account))
        return problems

    async def _reconcile_one(self, account: str) -> list[str]:
        bal = await self.balance(account)
        holds = _fields(await self.redis.hgetall(_keys(account)[1]))
        entries = await self.all_entries(account)
        credited = sum(int(e["amount"]) for e in entries if e.get("type") == "credit")
        spent = sum(int(e["cost"]) for e in entries if e.get("type") == "charge")
        ended = [e["hold"] for e in entries if e.get("type") == "charge"]
        problems = []
        if bal.credited != bal.available + bal.held + bal.spent:
            problems.append(f"{account}: credited {bal.credited} != available {bal.available} "
                            f"+ held {bal.held} + spent {bal.spent}")
        if bal.held != sum(int(v) for v in holds.values()):
            problems.append(f"{account}: held {bal.held} != sum of open holds")
        if credited != bal.credited:
            problems.append(f"{account}: journal credits {credited} != credited {bal.credited}")
        if spent != bal.spent:
            problems.append(f"{account}: journal charges {spent} != spent {bal.spent}")
        if bal.available < 0 or bal.held < 0:
            problems.append(f"{account}: negative balance {bal}")
        if len(ended) != len(set(ended)):
            problems.append(f"{account}: a hold has more than one terminal entry")
        open_ended = set(holds) & set(ended)
        if open_ended:
            problems.append(f"{account}: holds both open and ended: {sorted(open_ended)}")
        return problems
