-- A top-up, or an adjustment when negative; never takes `available` below zero. Journaled.
-- Done once per operation id: a retried call (its reply lost) finds the id among the ended
-- writes and changes nothing. With an Idempotency-Key (KEYS[4], the caller's key's record):
-- done once per key for ARGV[5] seconds; a later call under it changes nothing and gets the
-- record (the first call's fingerprint and the balance it left), for the caller to compare.
-- KEYS: balance hash, journal stream, ended zset[, key record]. ARGV: amount, details (JSON),
-- operation id[, fingerprint, seconds kept].
-- Returns {1, available after}, {0, available} when the adjustment is refused, or {2, record}.
if KEYS[4] then
  local made = redis.call('GET', KEYS[4])
  if made then return {2, made} end
end
local amount = tonumber(ARGV[1])
local available = tonumber(redis.call('HGET', KEYS[1], 'available') or '0')
if redis.call('ZSCORE', KEYS[3], ARGV[3]) then return {1, available} end
if available + amount < 0 then return {0, available} end
redis.call('HINCRBY', KEYS[1], 'available', amount)
redis.call('HINCRBY', KEYS[1], 'credited', amount)
redis.call('XADD', KEYS[2], '*', 'type', 'credit', 'amount', amount, 'details', ARGV[2])
local now = redis.call('TIME')
redis.call('ZADD', KEYS[3], tonumber(now[1]), ARGV[3])
if KEYS[4] then
  redis.call('SET', KEYS[4], ARGV[4] .. ' ' .. (available + amount), 'EX', tonumber(ARGV[5]))
end
return {1, available + amount}
