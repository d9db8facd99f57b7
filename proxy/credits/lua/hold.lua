-- KEYS: balance hash, holds hash, hold expiry zset. ARGV: hold id, amount, expiry (unix s).
-- Returns {1, available after}, {0, available} when short, {-1, 0} for a hold id already used.
local amount = tonumber(ARGV[2])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {-1, 0} end
local available = tonumber(redis.call('HGET', KEYS[1], 'available') or '0')
if available < amount then return {0, available} end
redis.call('HINCRBY', KEYS[1], 'available', 0 - amount)  -- never -0
redis.call('HINCRBY', KEYS[1], 'held', amount)
redis.call('HSET', KEYS[2], ARGV[1], amount)
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
return {1, available - amount}
