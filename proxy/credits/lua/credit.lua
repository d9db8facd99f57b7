-- A top-up, or an adjustment when negative; never takes `available` below zero. Journaled.
-- Done once per operation id: a retried call (its reply lost) finds the id among the ended
-- writes and changes nothing.
-- KEYS: balance hash, journal stream, ended zset. ARGV: amount, details (JSON), operation id.
-- Returns {1, available after}, or {0, available} when the adjustment is refused.
local amount = tonumber(ARGV[1])
local available = tonumber(redis.call('HGET', KEYS[1], 'available') or '0')
if redis.call('ZSCORE', KEYS[3], ARGV[3]) then return {1, available} end
if available + amount < 0 then return {0, available} end
redis.call('HINCRBY', KEYS[1], 'available', amount)
redis.call('HINCRBY', KEYS[1], 'credited', amount)
redis.call('XADD', KEYS[2], '*', 'type', 'credit', 'amount', amount, 'details', ARGV[2])
local now = redis.call('TIME')
redis.call('ZADD', KEYS[3], tonumber(now[1]), ARGV[3])
return {1, available + amount}
