-- A top-up, or an adjustment when negative; never takes `available` below zero. Journaled.
-- KEYS: balance hash, journal stream. ARGV: amount, details (JSON).
-- Returns {1, available after}, or {0, available} when the adjustment is refused.
local amount = tonumber(ARGV[1])
local available = tonumber(redis.call('HGET', KEYS[1], 'available') or '0')
if available + amount < 0 then return {0, available} end
redis.call('HINCRBY', KEYS[1], 'available', amount)
redis.call('HINCRBY', KEYS[1], 'credited', amount)
redis.call('XADD', KEYS[2], '*', 'type', 'credit', 'amount', amount, 'details', ARGV[2])
return {1, available + amount}
