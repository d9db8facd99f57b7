-- Release every hold whose expiry has passed on Redis' clock (a crashed worker's), journaled.
-- KEYS: balance hash, holds hash, hold expiry zset, journal stream. ARGV: none.
local now = redis.call('TIME')
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now[1])
for _, id in ipairs(due) do
  local held = redis.call('HGET', KEYS[2], id)
  if held then
    held = tonumber(held)
    redis.call('HINCRBY', KEYS[1], 'held', 0 - held)
    redis.call('HINCRBY', KEYS[1], 'available', held)
    redis.call('HDEL', KEYS[2], id)
    redis.call('XADD', KEYS[4], '*', 'type', 'charge', 'hold', id, 'held', held, 'cost', 0,
               'status', 'expired', 'details', '{}')
  end
  redis.call('ZREM', KEYS[3], id)
end
return #due
