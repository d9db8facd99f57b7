"""The engines' slots and the queue's turns, shared by every worker of every gateway host (the
rate-limit Redis: soft state, no fsync). One hash tag, so one Cluster slot holds them all and
each step is one script:

    igw:{slots}:total       hash  backend -> requests in flight on it, fleet-wide
    igw:{slots}:held        hash  backend|process -> that process's share of them
    igw:{slots}:alive       hash  process -> when its heartbeat lapses (ms)
    igw:{slots}:now         hash  pool|priority -> the tag that last got a slot ("now");
                                  asks|process -> the takes and turns it ran (`beat`)
    igw:{slots}:next:Q      zset  account -> its next turn, for accounts ahead of "now"
    igw:{slots}:wait:Q      zset  waiting request -> its tag (Q = pool|priority)
    igw:{slots}:due:Q       zset  waiting request -> when its longest wait ends (ms)

`take` gives a new request a slot on the first of its candidate backends with one free (a
network-mode request: one on each of several, all at once), unless a request of a higher tier,
or one of its own tier with an earlier turn (queue.Turns: fair queuing over accounts), waits
for the same pool in any gateway: then it waits too, tagged with its account's next turn, or
is refused at once when more wait ahead of it than its longest wait allows. A waiting request
asks again with `turn` when a slot frees; `leave` takes it out. `give_back` frees slots. A
`take` may also give the process spare slots to keep while the pool is far from full
(proxy.upstream.spares): they count as in flight like any other.
Every process beats its heartbeat every `BEAT_S`; the first beat after another process's lapsed
gives back every slot that process held (it crashed), and each beat sets the process's own
share to what it holds by its own count (proxy.upstream.holdings): a give-back that failed
leaves its slot counted for a beat at most. A waiting request is forgotten when its longest
wait ends, whoever forgot to take it out (a crashed process, a lost connection). A Redis that
restarts forgets what was in flight: give-backs then find nothing to give (never below zero),
and the engines may see up to their slots again on top of what was already running, until
the processes' next beats count it again.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.store.client import Primaries, Store
from proxy.store.script_pipe import ScriptPipes

if TYPE_CHECKING:
    from proxy.upstream.pool import Backend

BEAT_S = 2.0
# A tier keeps the tiers below it out of the engines' own queues ([routing] engine_queue) this
# long after it last took a slot of the pool: while it sends, none of theirs waits in an engine
# ahead of its next request.
HIGHER_TIER_S = 30.0
LAPSE_S = 3 * BEAT_S
_PREFIX = "igw:{slots}:"
_KEYS = [_PREFIX + name for name in ("total", "held", "alive", "now")]

# KEYS: total, held, now, next:Q, wait:Q, due:Q, then (wait, due) of each higher priority.
# ARGV: mode ('new' or 'turn'), process, Q, account, request's member, its tag (turn), its
# longest wait in ms (new), most waiters it may find ahead (new), slots it leaves free for the
# tiers above (headroom), distinct backends it needs a slot on at once (network mode: several),
# spare slots the process would keep of the first backend (proxy.upstream.spares), how long
# (ms) a higher tier's last slot keeps this tier out of the engines' queues, then (backend,
# slots, of them queued in its engine) triples in preference order. Returns {backends taken
# (one per line) or '', waiters ahead of it in every gateway, its tag (-1: refused, nothing
# changed), spares given}.
_TAKE = """
local mode, proc, q, account, member = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
redis.call('HINCRBY', KEYS[3], 'asks|' .. proc, 1)  -- the beat's check (see _BEAT)
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- A backend's slots for this request: those queued in its engine only while no higher tier
-- took a slot of the pool lately (one that did would find this request ahead of it there).
local above, named = false, #KEYS[5] - #q  -- wait:Q's name is its prefix and Q
for i = 7, #KEYS, 2 do
  local seen = redis.call('HGET', KEYS[3], 'seen|' .. string.sub(KEYS[i], named + 1))
  if seen and tonumber(seen) > now_ms - tonumber(ARGV[12]) then above = true end
end
local names, caps = {}, {}
for i = 13, #ARGV, 3 do
  names[#names + 1] = ARGV[i]
  caps[#caps + 1] = tonumber(ARGV[i + 1]) - (above and tonumber(ARGV[i + 2]) or 0)
end
local function used(j) return tonumber(redis.call('HGET', KEYS[1], names[j]) or '0') end
-- A waiter past its longest wait is gone, whether or not its gateway could say so.
local function prune(wait, due)
  local gone = redis.call('ZRANGEBYSCORE', due, '-inf', now_ms, 'LIMIT', 0, 64)
  if #gone > 0 then
    redis.call('ZREM', wait, unpack(gone))
    redis.call('ZREM', due, unpack(gone))
  end
end
local ahead = 0
for i = 7, #KEYS, 2 do
  prune(KEYS[i], KEYS[i + 1])
  ahead = ahead + redis.call('ZCARD', KEYS[i])
end
prune(KEYS[5], KEYS[6])
local now = tonumber(redis.call('HGET', KEYS[3], q) or '0')
local tag = tonumber(ARGV[6])
if mode == 'new' then
  tag = math.max(now, tonumber(redis.call('ZSCORE', KEYS[4], account) or '0'))
end
ahead = ahead + redis.call('ZCOUNT', KEYS[5], '-inf', '(' .. tag)
local need, room = tonumber(ARGV[10]), true
if ahead == 0 and tonumber(ARGV[9]) > 0 then  -- only when more than its headroom is free
  local free = 0
  for j = 1, #names do free = free + math.max(0, caps[j] - used(j)) end
  room = free > tonumber(ARGV[9])
end
if ahead == 0 and room then
  local found = {}
  for j = 1, #names do
    if #found == need then break end
    if used(j) < caps[j] then found[#found + 1] = names[j] end
  end
  if #found == need then
    for _, backend in ipairs(found) do
      redis.call('HINCRBY', KEYS[1], backend, 1)
      redis.call('HINCRBY', KEYS[2], backend .. '|' .. proc, 1)
    end
    if mode == 'turn' then
      redis.call('ZREM', KEYS[5], member)
      redis.call('ZREM', KEYS[6], member)
    end
    if tag > now then
      now = tag
      redis.call('HSET', KEYS[3], q, now)
    end
    redis.call('HSET', KEYS[3], 'seen|' .. q, now_ms)
    if tonumber(redis.call('ZSCORE', KEYS[4], account) or '0') < tag + 1 then
      redis.call('ZADD', KEYS[4], tag + 1, account)
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)  -- turns now or past: like new
    redis.call('PEXPIRE', KEYS[4], 600000)  -- an idle pool's turns are forgotten (10 min)
    -- Spares on the first backend, while at least half of the pool's slots stay free.
    local spare = 0
    if tonumber(ARGV[11]) > 0 and found[1] == names[1] then
      local slots, busy = 0, 0
      for j = 1, #names do
        slots = slots + caps[j]
        busy = busy + math.min(caps[j], used(j))
      end
      spare = math.max(0, math.min(tonumber(ARGV[11]), caps[1] - used(1),
                                   slots - busy - math.ceil(slots / 2)))
      if spare > 0 then
        redis.call('HINCRBY', KEYS[1], names[1], spare)
        redis.call('HINCRBY', KEYS[2], names[1] .. '|' .. proc, spare)
      end
    end
    return {table.concat(found, '\\n'), 0, tag, spare}
  end
end
if mode == 'turn' then return {'', ahead, tag, 0} end
if ahead > tonumber(ARGV[8]) then return {'', ahead, -1, 0} end
redis.call('ZADD', KEYS[5], tag, member)
redis.call('ZADD', KEYS[6], now_ms + tonumber(ARGV[7]), member)
redis.call('ZADD', KEYS[4], tag + 1, account)
for i = 4, 6 do redis.call('PEXPIRE', KEYS[i], 600000) end
return {'', ahead, tag, 0}
"""
# KEYS: next:Q, wait:Q, due:Q. ARGV: member, account, tag. A waiter leaves; its turn is its
# account's again if it was the account's last.
_LEAVE = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('ZREM', KEYS[3], ARGV[1])
  if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[2]) or '-1') == tonumber(ARGV[3]) + 1 then
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
  end
end
return 1
"""
# ARGV: process, backend, how many slots. Never more than the process holds.
_GIVE_BACK = """
local field = ARGV[2] .. '|' .. ARGV[1]
local mine = tonumber(redis.call('HGET', KEYS[2], field) or '0')
local count = math.min(mine, tonumber(ARGV[3]))
if count <= 0 then return 0 end
if mine == count then
  redis.call('HDEL', KEYS[2], field)
else
  redis.call('HINCRBY', KEYS[2], field, -count)
end
local total = redis.call('HINCRBY', KEYS[1], ARGV[2], -count)
if total <= 0 then redis.call('HDEL', KEYS[1], ARGV[2]) end
return count
"""
# KEYS: total, held, alive, now. ARGV: process, now ms, lapse ms, then either 'unknown' or how
# many takes the process had sent when it counted and (backend, slots) pairs of what it holds
# by its own count. Beats, gives back what lapsed processes held, then sets the process's
# share to its count, unless a take it sent after counting was run first (its grant would be
# missing: the connection's order is not always the order the calls were made in, e.g. while
# it connects); returns how many slots that changed (-1: not checked).
_BEAT = """
local now = tonumber(ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], now + tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[3], 10 * tonumber(ARGV[3]))  -- a fleet that stopped leaves nothing
local alive = redis.call('HGETALL', KEYS[3])
local living = {}
for i = 1, #alive, 2 do
  if tonumber(alive[i + 1]) < now then
    redis.call('HDEL', KEYS[3], alive[i])
  else
    living[alive[i]] = true
  end
end
-- Whatever a process that is not alive holds goes back: one whose beat lapsed, and one
-- forgotten with the whole alive hash (every gateway stopped at once, then a restart).
local fields = redis.call('HGETALL', KEYS[2])
for i = 1, #fields, 2 do
  local backend, owner = string.match(fields[i], '^(.*)|([^|]*)$')
  if owner and not living[owner] then
    redis.call('HDEL', KEYS[2], fields[i])
    redis.call('HDEL', KEYS[4], 'asks|' .. owner)
    if redis.call('HINCRBY', KEYS[1], backend, -tonumber(fields[i + 1])) <= 0 then
      redis.call('HDEL', KEYS[1], backend)
    end
  end
end
if ARGV[4] == 'unknown' then return -1 end
local asks = 'asks|' .. ARGV[1]
if tonumber(redis.call('HGET', KEYS[4], asks) or '0') > tonumber(ARGV[4]) then return -1 end
redis.call('HSET', KEYS[4], asks, ARGV[4])
local changed = 0
local function set(backend, have, want)
  if want == have then return end
  local field = backend .. '|' .. ARGV[1]
  if want > 0 then
    redis.call('HSET', KEYS[2], field, want)
  else
    redis.call('HDEL', KEYS[2], field)
  end
  if redis.call('HINCRBY', KEYS[1], backend, want - have) <= 0 then
    redis.call('HDEL', KEYS[1], backend)
  end
  changed = changed + math.abs(want - have)
end
local wanted = {}
for i = 5, #ARGV - 1, 2 do wanted[ARGV[i]] = tonumber(ARGV[i + 1]) end
for i = 1, #fields, 2 do
  local backend, owner = string.match(fields[i], '^(.*)|([^|]*)$')
  if owner == ARGV[1] then
    set(backend, tonumber(fields[i + 1]), wanted[backend] or 0)
    wanted[backend] = nil
  end
end
for i = 5, #ARGV - 1, 2 do
  if wanted[ARGV[i]] then set(ARGV[i], 0, wanted[ARGV[i]]) end
end
return changed
"""


@dataclass(frozen=True, slots=True)
class Taken:
    """What `take` and `turn` found: the backends taken (none, or as many as it needs), the
    requests waiting ahead in every gateway, the request's tag (None: refused, it waited for
    nothing), and the spare slots taken besides on the first backend."""

    backends: tuple[str, ...]
    ahead: int
    tag: int | None
    spare: int = 0


def _queue_keys(pool: str, priority: int) -> list[str]:
    q = f"{pool}|{priority}"
    return [f"{_PREFIX}next:{q}", f"{_PREFIX}wait:{q}", f"{_PREFIX}due:{q}"]


def process_id() -> str:
    """Unique per ledger (a process has one; tests run several gateways in one process)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class SlotLedger:
    def __init__(self, redis: Store) -> None:
        self.process = process_id()
        self.higher_tier_s = HIGHER_TIER_S
        self._members = itertools.count()
        self._primaries = Primaries(redis)
        self._pipes = ScriptPipes(self._primaries)
        self._take = redis.register_script(_TAKE)
        self._leave = redis.register_script(_LEAVE)
        self._give_back = redis.register_script(_GIVE_BACK)
        self._beat = redis.register_script(_BEAT)

    def member(self) -> str:
        """A name for a waiting request, unique in the fleet."""
        return f"{self.process}|{next(self._members)}"

    async def take(self, pool: str, priority: int, higher: Sequence[int], account: str,
                   candidates: Sequence[tuple[str, int, int]], *, member: str = "",
                   wait_s: float = 0.0, most_ahead: int = -1, keep_free: int = 0,
                   need: int = 1, spare: int = 0) -> Taken:
        """A new request of `account`: a slot on the first candidate (backend, slots, of
        them those queued in its engine: not while a higher tier sends, `HIGHER_TIER_S`) with
        one free (on each of the first `need` with one) when nobody waits ahead of it and more
        than `keep_free` slots are free; otherwise it waits as `member` for up to `wait_s`,
        unless more than `most_ahead` wait ahead of it (refused: `tag` None). With its slot on
        the first candidate, up to `spare` more there for the process to keep
        (proxy.upstream.spares), as many as leave half of the candidates' slots free."""
        return await self._call("new", pool, priority, higher, account, candidates,
                                member, 0, wait_s, most_ahead, keep_free, need, spare)

    async def turn(self, pool: str, priority: int, higher: Sequence[int], account: str,
                   candidates: Sequence[tuple[str, int, int]], member: str, tag: int,
                   keep_free: int = 0, need: int = 1) -> Taken:
        """A waiting request asks again: its slots when nobody waits ahead of it and more
        than `keep_free` are free (it stops waiting then)."""
        return await self._call("turn", pool, priority, higher, account, candidates,
                                member, tag, 0.0, 0, keep_free, need, 0)

    async def leave(self, pool: str, priority: int, account: str, member: str,
                    tag: int) -> None:
        """A waiting request gives up."""
        await self._pipes.call(self._leave, _queue_keys(pool, priority), [member, account, tag])

    async def _call(self, mode: str, pool: str, priority: int, higher: Sequence[int],
                    account: str, candidates: Sequence[tuple[str, int, int]], member: str,
                    tag: int, wait_s: float, most_ahead: int, keep_free: int, need: int,
                    spare: int) -> Taken:
        keys = [_KEYS[0], _KEYS[1], _KEYS[3], *_queue_keys(pool, priority)]
        for above in higher:
            keys += _queue_keys(pool, above)[1:]
        args: list[str | int] = [mode, self.process, f"{pool}|{priority}", account, member,
                                 tag, int(wait_s * 1000) + 1000, most_ahead, keep_free, need,
                                 spare, int(self.higher_tier_s * 1000)]
        for name, slots, queued in candidates:
            args += [name, slots, queued]
        taken, ahead, tagged, spared = await self._pipes.call(self._take, keys, args)
        names = taken.decode() if isinstance(taken, bytes) else str(taken)
        return Taken(tuple(names.split("\n")) if names else (), int(ahead),
                     None if int(tagged) < 0 else int(tagged), int(spared))

    async def give_back(self, backend: str, count: int = 1) -> None:
        """`count` slots of `backend` this process held are free (never more than it holds)."""
        await self._pipes.call(self._give_back, _KEYS, [self.process, backend, count])

    async def beat(self, now: float | None = None,
                   held: tuple[int, Mapping[str, int]] | None = None) -> int:
        """This process is alive; processes whose beat lapsed before `now` are not. With
        `held` (proxy.upstream.holdings: the takes and turns it had sent, and every backend
        it holds slots of with how many, counted when none was on its way), its share
        becomes that; how many slots that changed (-1: not checked)."""
        at = time.time() if now is None else now
        count: list[str | int] = ["unknown"]
        if held is not None:
            count = [held[0], *(x for name, n in sorted(held[1].items()) for x in (name, n))]
        changed = await self._pipes.call(self._beat, _KEYS, [
            self.process, int(at * 1000), int(LAPSE_S * 1000), *count])
        return int(changed)

    async def in_flight(self) -> dict[str, int]:
        """Requests in flight per backend, fleet-wide (for /admin/backends)."""
        raw = await self._primaries.store.hgetall(_KEYS[0])
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    async def close(self) -> None:
        await self._pipes.close()
        await self._primaries.close()


def offer(backends: Sequence[Backend]) -> list[tuple[str, int, int]]:
    """Backends as the slot ledger is offered them: (name, slots, queued), in order."""
    return [(b.name, b.slots, b.queued) for b in backends]


def free_here(preferred: list[Backend], keep_free: int, need: int) -> list[Backend] | None:
    """The first `need` of `preferred` with a slot free by this worker's own counts, when
    more than `keep_free` are."""
    free = sum(max(0, b.slots - b.outstanding) for b in preferred)
    if free <= keep_free:
        return None
    found = [b for b in preferred if b.outstanding < b.slots][:need]
    return found if len(found) == need else None
