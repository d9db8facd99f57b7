"""The engines' slots, shared by every worker of every gateway host (the rate-limit Redis: soft
state, no fsync). One hash tag, so one Cluster slot holds them all and each step is one script:

    igw:{slots}:total      hash  backend -> requests in flight on it, fleet-wide
    igw:{slots}:held       hash  backend|process -> that process's share of them
    igw:{slots}:alive      hash  process -> when its heartbeat lapses (ms)
    igw:{slots}:queued     hash  pool|priority -> requests waiting in some gateway's queue
    igw:{slots}:queued_by  hash  pool|priority|process -> that process's share of them

`take` gives a request a slot on the first of its candidate backends with one free, unless a
request of a higher tier waits for the same pool in any gateway (then it queues behind it: the
tier order holds across processes). `give_back` frees it. Every process beats its heartbeat
every `BEAT_S`; the first beat after another process's lapsed gives back everything that process
held or queued (it crashed). A Redis that restarts forgets what was in flight: gives back then
find nothing to give (never below zero), and the engines may see up to their slots again on top
of what was already running, until that drains.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Sequence

from proxy.store.client import Primaries, Store
from proxy.store.script_pipe import ScriptPipes

BEAT_S = 2.0
LAPSE_S = 3 * BEAT_S
_KEYS = [f"igw:{{slots}}:{name}" for name in ("total", "held", "alive", "queued", "queued_by")]

# ARGV: process, pool, own priority, queue (1: count it as waiting if it gets no slot), n, n
# higher priorities, then (backend, slots) pairs in preference order. Returns {backend taken or
# '', requests of its priority or higher already waiting for the pool in every gateway}.
_TAKE = """
local proc, pool, n = ARGV[1], ARGV[2], tonumber(ARGV[5])
local higher = 0
for i = 1, n do
  higher = higher + tonumber(redis.call('HGET', KEYS[4], pool .. '|' .. ARGV[5 + i]) or '0')
end
if higher == 0 then
  for i = 6 + n, #ARGV, 2 do
    local backend = ARGV[i]
    if tonumber(redis.call('HGET', KEYS[1], backend) or '0') < tonumber(ARGV[i + 1]) then
      redis.call('HINCRBY', KEYS[1], backend, 1)
      redis.call('HINCRBY', KEYS[2], backend .. '|' .. proc, 1)
      return {backend, 0}
    end
  end
end
local field = pool .. '|' .. ARGV[3]
local same = tonumber(redis.call('HGET', KEYS[4], field) or '0')
if ARGV[4] == '1' then
  redis.call('HINCRBY', KEYS[4], field, 1)
  redis.call('HINCRBY', KEYS[5], field .. '|' .. proc, 1)
end
return {'', higher + same}
"""
# ARGV: process, backend.
_GIVE_BACK = """
local field = ARGV[2] .. '|' .. ARGV[1]
local mine = tonumber(redis.call('HGET', KEYS[2], field) or '0')
if mine <= 0 then return 0 end
if mine == 1 then
  redis.call('HDEL', KEYS[2], field)
else
  redis.call('HINCRBY', KEYS[2], field, -1)
end
local total = redis.call('HINCRBY', KEYS[1], ARGV[2], -1)
if total <= 0 then redis.call('HDEL', KEYS[1], ARGV[2]) end
return 1
"""
# ARGV: process, pool, priority, +1 or -1.
_QUEUE = """
local field = ARGV[2] .. '|' .. ARGV[3]
local mine = redis.call('HINCRBY', KEYS[5], field .. '|' .. ARGV[1], ARGV[4])
if mine < 0 then redis.call('HDEL', KEYS[5], field .. '|' .. ARGV[1]) return 0 end
if mine == 0 then redis.call('HDEL', KEYS[5], field .. '|' .. ARGV[1]) end
if redis.call('HINCRBY', KEYS[4], field, ARGV[4]) <= 0 then redis.call('HDEL', KEYS[4], field) end
return 1
"""
# ARGV: process, now ms, lapse ms. Beats, then gives back what lapsed processes held.
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
-- Whatever a process that is not alive holds or queues goes back: one whose beat lapsed, and
-- one forgotten with the whole alive hash (every gateway stopped at once, then a restart).
local function reap(owned, totals)
  local fields = redis.call('HGETALL', owned)
  for i = 1, #fields, 2 do
    local head, owner = string.match(fields[i], '^(.*)|([^|]*)$')
    if owner and not living[owner] then
      redis.call('HDEL', owned, fields[i])
      if redis.call('HINCRBY', totals, head, -tonumber(fields[i + 1])) <= 0 then
        redis.call('HDEL', totals, head)
      end
    end
  end
end
reap(KEYS[2], KEYS[1])
reap(KEYS[5], KEYS[4])
return 1
"""


def process_id() -> str:
    """Unique per ledger (a process has one; tests run several gateways in one process)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


class SlotLedger:
    def __init__(self, redis: Store) -> None:
        self.process = process_id()
        self._primaries = Primaries(redis)
        self._pipes = ScriptPipes(self._primaries)
        self._take = redis.register_script(_TAKE)
        self._give_back = redis.register_script(_GIVE_BACK)
        self._queue = redis.register_script(_QUEUE)
        self._beat = redis.register_script(_BEAT)

    async def take(self, pool: str, priority: int, higher: Sequence[int],
                   candidates: Sequence[tuple[str, int]], *, queue: bool = False
                   ) -> tuple[str | None, int]:
        """A slot on the first candidate (backend, slots) with one free: its name; None when
        none has one, or a higher priority waits for `pool`. With it, how many requests of
        `priority` or higher wait for `pool` in every gateway (0 when taken). `queue`: one
        that gets no slot is counted as waiting in the same step (`queued(..., -1)` when it
        stops)."""
        args: list[str | int] = [self.process, pool, priority, int(queue), len(higher),
                                 *higher]
        for name, slots in candidates:
            args += [name, slots]
        taken, ahead = await self._pipes.call(self._take, _KEYS, args)
        name = taken.decode() if isinstance(taken, bytes) else str(taken)
        return name or None, int(ahead)

    async def give_back(self, backend: str) -> None:
        await self._pipes.call(self._give_back, _KEYS, [self.process, backend])

    async def queued(self, pool: str, priority: int, delta: int) -> None:
        await self._pipes.call(self._queue, _KEYS, [self.process, pool, priority, delta])

    async def beat(self, now: float | None = None) -> None:
        """This process is alive; processes whose beat lapsed before `now` are not."""
        at = time.time() if now is None else now
        await self._pipes.call(self._beat, _KEYS, [self.process, int(at * 1000),
                                                   int(LAPSE_S * 1000)])

    async def in_flight(self) -> dict[str, int]:
        """Requests in flight per backend, fleet-wide (for /admin/backends)."""
        raw = await self._primaries.store.hgetall(_KEYS[0])
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    async def close(self) -> None:
        await self._pipes.close()
        await self._primaries.close()
