-- ARGV: now. Releases every hold whose expiry has passed (a crashed worker's), journaled.
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[1])
for _, id in ipairs(due) do
  local held = redis.call('HGET', KEYS[2], id)
  if held then
    held = tonumber(held)
    redis.call('HINCRBY', KEYS[1], 'held', 0 - held)
    redis.call('HINCRBY', KEYS[1], 'available', held)
    redis.call('HDEL', KEYS[2], id)
    redis.call('XADD', KEYS[4], '*', 'type', 'charge', 'hold', id, 'held', held, 'cost', 0,
               'status', 'expired')
  end
  redis.call('ZREM', KEYS[3], id)
end
return #due
