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
-- KEYS: window zset, balance hash, holds hash, hold expiry zset (all under the account's tag)
-- ARGV: limit (0: no limit), window ms, hold id ('' for none), amount, hold ttl s
-- Returns {status, remaining, reset ms, available}: status 1 admitted, 0 rate limited,
--   2 insufficient credits, 3 hold id already used. remaining is -1 without a limit.
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
  redis.call('PEXPIRE', KEYS[1], window)
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  remaining = limit - count - 1
  reset = tonumber(oldest[2]) + window - now_ms
end
if ARGV[3] == '' then return {1, remaining, reset, 0} end
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 1 then return {3, remaining, reset, 0} end
local amount = tonumber(ARGV[4])
local available = tonumber(redis.call('HGET', KEYS[2], 'available') or '0')
if available < amount then return {2, remaining, reset, available} end
redis.call('HINCRBY', KEYS[2], 'available', 0 - amount)  -- never -0
redis.call('HINCRBY', KEYS[2], 'held', amount)
redis.call('HSET', KEYS[3], ARGV[3], amount)
redis.call('ZADD', KEYS[4], tonumber(now[1]) + tonumber(ARGV[5]), ARGV[3])
return {1, remaining, reset, available - amount}
