-- A top-up, or an adjustment when negative; never takes `available` below zero. Journaled.
-- Done once per operation id: a retried call (its reply lost) finds the id among the ended
-- writes and changes nothing. With an Idempotency-Key (KEYS[4], the caller's key's record):
-- done once per key for ARGV[5] seconds; a later call under it changes nothing.
-- KEYS: balance hash, journal stream, ended zset[, key record]. ARGV: amount, details (JSON),
-- operation id[, fingerprint, seconds kept].
-- Returns {1, available after}, {0, available} when the adjustment is refused, or, when the
-- key was used, {2, the balance its top-up left} (the same fingerprint) or {3, 0} (another).
if KEYS[4] then
  local made = redis.call('GET', KEYS[4])
  if made then
    local fingerprint, left = string.match(made, '^(%S+) (%S+)$')
    if fingerprint == ARGV[4] then return {2, tonumber(left)} end
    return {3, 0}
  end
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
