-- One admission, atomically: the rate limit and, when a hold id is given, the credit hold.
-- The limit is a sliding log: at most LIMIT requests in any WINDOW ms, one sorted-set member per
-- admitted request (scored by Redis' own clock, so every worker and host agrees on the time).
-- A request refused by the limit counts nothing; one refused for credits has been counted.
--
-- Windows and holds are soft state: neither written to the AOF nor replicated, so admission
-- never waits for an fsync. A Redis crash forgets them: the windows restart, and a request that
-- was running then finds no hold to settle and goes free (never an over-spend). What moved money
-- (settle.lua, credit.lua) is persisted.
--
-- Holds are tagged with this Redis process's run id, and those another process placed are
-- forgotten first (soft_state.lua, prepended).
--
-- KEYS: window zset, balance hash, holds hash, hold expiry zset (all under the account's tag)
-- ARGV: limit (0: no limit), window ms, hold id ('' for none), amount, hold ttl s, this Redis
--   process's run id (the connection's; '' to ask the server)
-- Returns {status, remaining, reset ms, available}: status 1 admitted, 0 rate limited,
--   2 insufficient credits, 3 hold id already used. remaining is -1 without a limit.
local run, holds
if ARGV[3] ~= '' then
  run = this_run(ARGV[6])
  holds = forget_stale_holds(KEYS[2], KEYS[3], KEYS[4], run)
end
redis.set_repl(redis.REPL_NONE)
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local limit = tonumber(ARGV[1])
local remaining, reset = -1, 0
if limit > 0 then
  local window = tonumber(ARGV[2])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - window)
  local count = redis.call('ZCARD', KEYS[1])
  if count >= limit then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {0, 0, tonumber(oldest[2]) + window - now_ms, 0}
  end
  local member = now[1] .. '.' .. now[2]
  while redis.call('ZADD', KEYS[1], 'NX', now_ms, member) == 0 do member = member .. '+' end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  remaining = limit - count - 1
  reset = tonumber(oldest[2]) + window - now_ms
end
if ARGV[3] == '' then return {1, remaining, reset, 0} end
-- Every redis.call costs about a microsecond warm and several on a busy core, so the common
-- path is written in as few as it takes: the hold is claimed and the amount taken first, and
-- both are given back in the rare refusal (no one sees the difference: the script is atomic).
-- Figures go as the strings they came in where they can (Lua formats a number with sprintf).
local amount = tonumber(ARGV[4])
if redis.call('HSETNX', KEYS[3], ARGV[3], ARGV[4]) == 0 then return {3, remaining, reset, 0} end
local left = redis.call('HINCRBY', KEYS[2], 'available', 0 - amount)  -- never -0
if left < 0 then
  redis.call('HINCRBY', KEYS[2], 'available', ARGV[4])
  redis.call('HDEL', KEYS[3], ARGV[3])
  return {2, remaining, reset, left + amount}
end
redis.call('HINCRBY', KEYS[2], 'held', ARGV[4])
redis.call('ZADD', KEYS[4], tonumber(now[1]) + tonumber(ARGV[5]), ARGV[3])
if holds ~= 'kept' then redis.call('HSET', KEYS[3], '@run', run) end  -- the first hold here
return {1, remaining, reset, left}
