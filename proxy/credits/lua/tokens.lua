-- A settled request's tokens: what the engine counted takes the place of what admission
-- reserved (admit.lua), in the buckets it was reserved in, once (the reservation's own key is
-- deleted here). A bucket that already left its window took the reservation with it. Soft
-- state, like the windows.
--
-- KEYS: minute tokens hash, its buckets zset, day tokens hash, its buckets zset, the request's
--   reservation. ARGV: tokens used.
-- Returns the tokens given back (reserved - used), or -1 when there was no reservation.
redis.set_repl(redis.REPL_NONE)
local held = redis.call('GET', KEYS[5])
if not held then return -1 end
redis.call('DEL', KEYS[5])
local reserved, minute, day = string.match(held, '^(%d+):(%d*):(%d*)$')
reserved = tonumber(reserved)
local used = tonumber(ARGV[1])
local function settle(h, z, b)
  if b == '' or not redis.call('ZSCORE', z, b) then return end
  redis.call('HINCRBY', h, b, used - reserved)
  redis.call('HINCRBY', h, 't', used - reserved)
  redis.call('HINCRBY', h, b .. 'r', -reserved)
  redis.call('HINCRBY', h, 'r', -reserved)
end
settle(KEYS[1], KEYS[2], minute)
settle(KEYS[3], KEYS[4], day)
return reserved - used
