"""The credit ledger in Redis: the only writer of balances. Every change is one atomic Lua script
(credits/lua/): admit (limit + hold), settle, credit, sweep.

Per account A (keys share the hash tag `{A}`, so each script stays in one Cluster slot):

    igw:{A}:bal       hash    available, held, spent, credited; trimmed_credited, trimmed_spent
    igw:{A}:holds     hash    hold id -> amount held
    igw:{A}:hold_exp  zset    hold id -> expiry (unix seconds on Redis' clock)
    igw:{A}:journal   stream  one entry per credit and one terminal entry per hold
    igw:{A}:usage     hash    running totals: m|<model>|…, d|<day number>|… (requests, cost,
                              and each unit used: prompt_tokens, completion_tokens, characters,
                              audio_ms, images, video_ms), kept by the settle script; the
                              all-time totals are the days' sum
    igw:{A}:ended     zset    hold and top-up ids done in the last two minutes (a retried settle
                              or top-up whose reply was lost changes nothing)
    igw:{A}:topup:<k> string  a top-up's Idempotency-Key: its fingerprint and balance, 24 h
    igw:{A}:rl:<tier> zset    the rate-limit window (policy.admission)
    igw:{A}:tk:<tier>:<scope>:<code>  hash: a token window (credits.token_windows)
    igw:{A}:caps, capspent, capheld   budgets (credits.budgets) and the balance threshold
    igw:{A}:alerts, alerts_due, alerted, alerts_sent   alerts (credits.alerts, .webhooks)

Value moves credited -> available -> held -> spent (or back to available), so at every moment
`credited == available + held + spent` and `held == sum(holds)`. Holds and windows are soft
state (never in the AOF, see lua/admit.lua): a Redis restart forgets them, and a request that was
running then is charged from what is available when it settles, never more than it held. The
journal keeps the newest `journal_max_entries` money entries; older ones are folded into the
`trimmed_*` checkpoint as they go, so checkpoint + journal still replay to `credited` and
`spent`. `reconcile()` checks exactly that. A hold ends exactly once: the settle script does
nothing when the hold is already ended, so a settle racing the sweeper (or a retry) can never
charge twice.

Outside the slot, an index `igw:ledger:accounts` (set) lets the sweeper and reconcile find
accounts; it is only an index — losing an entry never changes money.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import orjson
from redis.exceptions import RedisError

from proxy.credits.budgets import cap_name, key_cap_problem
from proxy.ids import hex_id
from proxy.store.client import Primaries, Store, failing_over, wait_for_replicas
from proxy.store.script_pipe import SERVER_RUN

log = logging.getLogger("proxy.credits.ledger")

ACCOUNTS = "igw:ledger:accounts"
CREDIT_TRIES = 5  # a top-up no replica confirmed is sent again (each try waits up to 1 s)
WATCHED = "igw:alerts:accounts"  # accounts that may record alerts (proxy.credits.webhooks)
HOLDS_TAG = "@run"  # in an account's holds hash: the run id of the Redis that placed them
Arg = bytes | str | int | float  # what a script's ARGV takes
# Journal fields that are numbers; every other field is text, and `details` is a JSON object.
_NUMBERS = frozenset({"held", "cost", "amount", "recovered"})


# Scripts that touch holds begin with soft_state.lua: holds another Redis process placed are
# forgotten before anything reads or changes them.
_SOFT_STATE = frozenset({"admit", "settle", "sweep", "forget"})


def lua_script(name: str) -> str:
    """A script from credits/lua/ (files, so they read as Lua and diff as Lua)."""
    folder = resources.files("proxy.credits") / "lua"
    source = (folder / f"{name}.lua").read_text()
    if name in _SOFT_STATE:
        source = (folder / "soft_state.lua").read_text() + "\n" + source
    if name == "admit":
        source = (folder / "periods.lua").read_text() + "\n" + source
    if name in ("admit", "settle"):
        source = (folder / "alerts.lua").read_text() + "\n" + source
    if name in ("admit", "settle", "tokens"):
        source = (folder / "token_settle.lua").read_text() + "\n" + source
    return source


@dataclass(frozen=True, slots=True)
class AccountKeys:
    balance: str
    holds: str
    hold_expiry: str
    journal: str
    usage: str
    ended: str

    @classmethod
    def of(cls, account: str) -> AccountKeys:
        tag = f"igw:{{{account}}}"
        return cls(f"{tag}:bal", f"{tag}:holds", f"{tag}:hold_exp", f"{tag}:journal",
                   f"{tag}:usage", f"{tag}:ended")

    def window(self, tier: str) -> str:
        return self.balance[:-3] + f"rl:{tier}"

    def token_window(self, tier: str, suffix: str) -> str:
        """A token window's buckets (a hash): `suffix` is `TokenWindow.suffix`
        (proxy.credits.token_windows)."""
        return self.balance[:-3] + f"tk:{tier}:{suffix}"

    def shadow_window(self, tier: str) -> str:
        """The shadow policy's request window (proxy.policy.shadow)."""
        return self.balance[:-3] + f"srl:{tier}"

    def shadow_tokens(self, tier: str, suffix: str) -> str:
        """A shadow token window's buckets."""
        return self.balance[:-3] + f"stk:{tier}:{suffix}"

    def reservation(self, request_id: str) -> str:
        """What a request reserved in the token windows, until its settlement."""
        return self.balance[:-3] + f"tkr:{request_id}"

    @property
    def budgets(self) -> list[str]:
        """The budgets (caps: persisted), what was charged in each period (persisted), and
        what holds count against them now (soft): proxy.credits.budgets."""
        base = self.balance[:-3]
        return [base + "caps", base + "capspent", base + "capheld"]

    @property
    def alerts(self) -> list[str]:
        """The alerts recorded (a stream, persisted), those due for delivery (zset: stream id
        -> when), and what was last alerted (hash): lua/alerts.lua, proxy.credits.alerts."""
        base = self.balance[:-3]
        return [base + "alerts", base + "alerts_due", base + "alerted"]

    @property
    def deliveries(self) -> str:
        """Each alert's delivery to each endpoint (hash: stream id -> JSON)."""
        return self.balance[:-3] + "alerts_sent"


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


class MadeBefore(Exception):
    """A top-up's Idempotency-Key was used: args[0] the balance it left (None: another top-up)."""


def as_text(value: object) -> str:
    """redis-py answers bytes (or str); this module speaks str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def as_fields(raw: object) -> dict[str, str]:
    return {as_text(k): as_text(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def journal_entry(raw: object) -> dict[str, Any]:
    """A journal entry as JSON-ready data: numbers as numbers, `details` merged in."""
    fields = as_fields(raw)
    details = fields.pop("details", "{}")
    entry: dict[str, Any] = {k: int(v) if k in _NUMBERS else v for k, v in fields.items()}
    parsed = orjson.loads(details)
    if isinstance(parsed, dict):
        entry.update({k: v for k, v in parsed.items() if k not in entry})
    return entry


class Ledger:
    """`ack_replicas`: each top-up and settlement waits (WAIT) until this many replicas have it,
    so a failover to a replica keeps it (`[gateway] ledger_ack_replicas`)."""

    def __init__(self, redis: Store, *, ack_replicas: int = 0) -> None:
        self.redis = redis
        self.primaries = Primaries(redis)  # who holds each account (admission, settlements)
        self.ack_replicas = ack_replicas
        # register_script: EVALSHA, reloading the script on NOSCRIPT (e.g. after a restart).
        self.admit_script = redis.register_script(lua_script("admit"))
        self.settle_script = redis.register_script(lua_script("settle"))
        self.tokens_script = redis.register_script(lua_script("tokens"))
        self._credit = redis.register_script(lua_script("credit"))
        self._sweep = redis.register_script(lua_script("sweep"))
        self._forget = redis.register_script(lua_script("forget"))

    async def credit(self, account: str, amount: int, details: Mapping[str, object],
                     once: tuple[str, str, int] | None = None) -> int:
        """Top up (or adjust, when negative); journaled. Returns the new available balance.
        `once`: (its Idempotency-Key's record, its fingerprint, seconds kept): see credit.lua."""
        keys = AccountKeys.of(account)
        record: list[str] = [once[0]] if once else []
        extra: list[str | int] = [once[1], once[2]] if once else []
        await self.redis.sadd(ACCOUNTS, account)
        credit_id = hex_id()
        # The script and its WAIT share one connection of the account's primary. One no
        # replica confirmed is sent again (its id makes that a no-op where it landed), so a
        # replica promoted without it still gets it, as the settler does with charges.
        for attempt in range(CREDIT_TRIES):
            client = self.primaries.client_for(keys.balance)
            try:
                async with client.pipeline(transaction=False) as pipe:
                    await self._credit(keys=[keys.balance, keys.journal, keys.ended, *record],
                                       args=[amount, orjson.dumps(details), credit_id, *extra],
                                       client=pipe)
                    wait_for_replicas(pipe, keys.balance, self.ack_replicas)
                    (ok, available), *acks = await pipe.execute()
            except RedisError as exc:
                # The primary failing over under it (its WAIT is "UNBLOCKED" as it becomes a
                # replica, READONLY, a lost connection): whether it ran or not, again.
                if attempt == CREDIT_TRIES - 1 or not failing_over(exc):
                    raise
                await asyncio.sleep(0.1)
                await self.primaries.refresh()
                continue
            if not acks or int(acks[-1]) >= self.ack_replicas:
                break
            if attempt == CREDIT_TRIES - 1:
                log.error("a top-up of %s reached %s of %d replica(s) after %d tries; a "
                          "failover now could lose it", account, acks[-1], self.ack_replicas,
                          CREDIT_TRIES)
        if ok >= 2:
            raise MadeBefore(int(available) if ok == 2 else None)
        if not ok:
            raise InsufficientCredits(int(available), -amount)
        return int(available)

    async def hold(self, account: str, amount: int, ttl_s: int) -> str:
        """Reserve `amount` outside any rate limit (admission does both in one step); raises
        InsufficientCredits. Returns the hold id."""
        hold_id = hex_id()
        keys = AccountKeys.of(account)
        await self.redis.sadd(ACCOUNTS, account)
        status, _, _, available, *_ = await self.admit_script(
            keys=[keys.window("none"), keys.reservation(hold_id), keys.balance, keys.holds,
                  keys.hold_expiry, *keys.budgets, *keys.alerts],
            args=[0, 0, hold_id, amount, ttl_s, "", 0, 0, ""])
        if status != 1:
            raise InsufficientCredits(int(available), amount)
        return hold_id

    async def settle(self, account: str, hold_id: str, cost: int,
                     details: Mapping[str, object], *, status: str = "completed",
                     keep: int = 100_000) -> int | None:
        """End the hold: charge min(cost, held), release the rest, journal it. Exactly once:
        None when the hold had already ended (settled, released or swept). (Requests settle
        through `credits.settler`, batched; this is the same script, one call.)"""
        keys, args = settle_call(account, hold_id, cost, 0, status, "", {}, details, keep, 0,
                                 run="")
        charged = await self.settle_script(keys=keys, args=args)
        return None if int(charged) < 0 else int(charged)

    async def close(self) -> None:
        await self.primaries.close()

    async def forget_stale_holds(self, account: str) -> bool:
        """Forget the account's holds if another Redis process placed them (a restart from a
        snapshot that held them: lua/soft_state.lua); True if it did. Reads call it first."""
        keys = AccountKeys.of(account)
        return bool(await self._forget(keys=[keys.balance, keys.holds, keys.hold_expiry,
                                             keys.budgets[2]]))

    async def balance(self, account: str) -> Balance:
        await self.forget_stale_holds(account)
        raw = as_fields(await self.redis.hgetall(AccountKeys.of(account).balance))
        get = {k: int(v) for k, v in raw.items()}
        return Balance(*(get.get(name, 0) for name in ("available", "held", "spent", "credited")))

    async def budgets(self, account: str) -> tuple[dict[str, str], dict[str, str],
                                                   dict[str, str]]:
        """The account's caps, what was charged per period, and what holds count now
        (proxy.credits.budgets reads them)."""
        await self.forget_stale_holds(account)
        caps, spent, held = AccountKeys.of(account).budgets
        async with self.primaries.client_for(caps).pipeline(transaction=False) as pipe:
            for key in (caps, spent, held):
                pipe.hgetall(key)
            raw = await pipe.execute()
        return as_fields(raw[0]), as_fields(raw[1]), as_fields(raw[2])

    async def set_budget(self, account: str, period: str, amount: int | None,
                         key_id: str | None = None) -> None:
        """Set (or, with None, remove) a budget; ValueError when a key's would pass its
        account's (or the account's would fall under a key's)."""
        caps_key = AccountKeys.of(account).budgets[0]
        name = cap_name(period, key_id)
        if amount is None:
            await self.redis.hdel(caps_key, name)
            return
        problem = key_cap_problem(as_fields(await self.redis.hgetall(caps_key)), period, amount,
                                  key_id)
        if problem:
            raise ValueError(problem)
        await self.redis.hset(caps_key, name, amount)
        await self.redis.sadd(WATCHED, account)

    async def set_alert_below(self, account: str, amount: int | None) -> None:
        """Alert when the account's balance falls under `amount` (None: never)."""
        caps_key = AccountKeys.of(account).budgets[0]
        if amount is None:
            await self.redis.hdel(caps_key, "below")
            return
        await self.redis.hset(caps_key, "below", amount)
        await self.redis.sadd(WATCHED, account)

    async def set_postpaid(self, account: str, postpaid: bool) -> None:
        """A postpaid account runs on its budgets alone: no balance check, what it is charged
        is what it owes (its available balance goes below zero)."""
        caps_key = AccountKeys.of(account).budgets[0]
        if postpaid:
            await self.redis.hset(caps_key, "postpaid", "1")
        else:
            await self.redis.hdel(caps_key, "postpaid")

    async def sweep(self) -> int:
        """Release expired holds in every account; returns how many were released."""
        released = 0
        async for raw in self.redis.sscan_iter(ACCOUNTS):
            keys = AccountKeys.of(as_text(raw))
            released += int(await self._sweep(
                keys=[keys.balance, keys.holds, keys.hold_expiry, keys.journal, keys.ended,
                      keys.budgets[2]]))
        return released

    async def entries(self, account: str, *, before: str | None = None, count: int = 50
                      ) -> list[tuple[str, dict[str, Any]]]:
        """Journal entries, newest first; page with `before` = the last id of the previous page."""
        end = f"({before}" if before else "+"
        rows = await self.redis.xrevrange(AccountKeys.of(account).journal, max=end, min="-",
                                          count=count)
        return [(as_text(i), journal_entry(f)) for i, f in rows or ()]

    async def all_entries(self, account: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        start = "-"
        while True:
            rows = list(await self.redis.xrange(AccountKeys.of(account).journal, min=start,
                                                max="+", count=1000) or ())
            out.extend(journal_entry(f) for _, f in rows)
            if len(rows) < 1000:
                return out
            start = "(" + as_text(rows[-1][0])

    async def usage_totals(self, account: str) -> dict[str, int]:
        """The running totals the settle script keeps (field -> integer)."""
        raw = as_fields(await self.redis.hgetall(AccountKeys.of(account).usage))
        return {k: int(v) for k, v in raw.items()}

    async def accounts(self) -> list[str]:
        return sorted(as_text(m) for m in await self.redis.smembers(ACCOUNTS))

    async def open_holds(self, account: str) -> dict[str, int]:
        """Open holds: hold id -> expiry (unix seconds)."""
        await self.forget_stale_holds(account)
        rows = await self.redis.zrange(AccountKeys.of(account).hold_expiry, 0, -1,
                                       withscores=True)
        return {as_text(row[0]): int(row[1]) for row in rows}

    async def reconcile(self, accounts: Iterable[str] | None = None) -> list[str]:
        """Every way the ledger could disagree with itself; empty when it adds up. Holds past
        their expiry that no sweep has released yet count as a disagreement."""
        problems: list[str] = []
        now = int((await self.redis.time())[0])
        for account in accounts if accounts is not None else await self.accounts():
            problems.extend(await self._reconcile_one(account, now))
        return problems

    async def _reconcile_one(self, account: str, now: int) -> list[str]:
        keys = AccountKeys.of(account)
        await self.forget_stale_holds(account)
        raw = {k: int(v) for k, v in as_fields(await self.redis.hgetall(keys.balance)).items()}
        bal = Balance(raw.get("available", 0), raw.get("held", 0), raw.get("spent", 0),
                      raw.get("credited", 0))
        holds = as_fields(await self.redis.hgetall(keys.holds))
        holds.pop(HOLDS_TAG, None)  # the run id the holds were placed under, not a hold
        rows = await self.redis.zrange(keys.hold_expiry, 0, -1, withscores=True)
        expiries = {as_text(row[0]): int(row[1]) for row in rows}  # stale ones forgotten above
        entries = await self.all_entries(account)
        credited = raw.get("trimmed_credited", 0) + sum(
            e["amount"] for e in entries if e.get("type") == "credit")
        spent = raw.get("trimmed_spent", 0) + sum(
            e["cost"] for e in entries if e.get("type") == "charge")
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
        postpaid = await self.redis.hget(keys.budgets[0], "postpaid") in (b"1", "1")
        if (bal.available < 0 and not postpaid) or bal.held < 0:  # postpaid: what it owes
            problems.append(f"{account}: negative balance {bal}")
        if len(ended) != len(set(ended)):
            problems.append(f"{account}: a hold has more than one terminal entry")
        open_ended = set(holds) & set(ended)
        if open_ended:
            problems.append(f"{account}: holds both open and ended: {sorted(open_ended)}")
        overdue = sorted(h for h, expiry in expiries.items() if expiry < now)
        if overdue:
            problems.append(f"{account}: {len(overdue)} hold(s) past their expiry and not yet "
                            "released (run `credits sweep`)")
        return problems


def settle_call(account: str, hold_id: str, cost: int, held: int, status: str, model: str,
                units: Mapping[str, int], details: Mapping[str, object], keep: int,
                ttl_s: int, *, run: object = SERVER_RUN, tokens: Reserved | None = None
                ) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of one settle script call (see lua/settle.lua); `units` are what the
    running totals add up (prompt_tokens, completion_tokens, characters, audio_ms, ...);
    `run`: the run id of the Redis it goes to (the pipe's, by default; "" to ask the server);
    `tokens`: what a request reserved in its token windows, and the engine's counts."""
    keys = AccountKeys.of(account)
    args: list[Any] = [hold_id, cost, held, status, model, orjson.dumps(details), keep, ttl_s,
                       run, tokens.prompt if tokens else "", tokens.completion if tokens else ""]
    for unit, count in units.items():
        args += (unit, count)
    names = [keys.balance, keys.holds, keys.hold_expiry, keys.journal, keys.usage, keys.ended,
             *keys.budgets[1:], *keys.alerts]
    if tokens:
        names += tokens.keys(keys)
    return names, args


@dataclass(frozen=True, slots=True)
class Reserved:
    """A request's reservation in its token windows (`suffixes`, in the order it reserved in
    them) and what the engine counted, for its settlement."""

    tier: str
    request_id: str
    suffixes: tuple[str, ...]
    prompt: int
    completion: int

    def keys(self, account: AccountKeys) -> list[str]:
        """The reservation, then each window's buckets hash (lua/token_settle.lua)."""
        return [account.reservation(self.request_id),
                *(account.token_window(self.tier, s) for s in self.suffixes)]
