-- A settled request's tokens: what the engine counted takes the place of what admission
-- reserved (admit.lua), in the buckets it was reserved in, once (the reservation's own key is
-- deleted here). A bucket that already left its window took the reservation with it. Soft
-- state, like the windows. (Prepended to settle.lua and tokens.lua.)
-- Returns the tokens given back (reserved - used), or -1 when there was no reservation.
local function settle_tokens(minute_h, minute_z, day_h, day_z, reservation, used)
  local mode = redis.REPL_ALL
  redis.set_repl(redis.REPL_NONE)
  local held = redis.call('GET', reservation)
  if not held then
    redis.set_repl(mode)
    return -1
  end
  redis.call('DEL', reservation)
  local reserved, minute, day = string.match(held, '^(%d+):(%d*):(%d*)$')
  reserved = tonumber(reserved)
  local function settle(h, z, b)
    if b == '' or not redis.call('ZSCORE', z, b) then return end
    redis.call('HINCRBY', h, b, used - reserved)
    redis.call('HINCRBY', h, 't', used - reserved)
    redis.call('HINCRBY', h, 'r', -reserved)
  end
  settle(minute_h, minute_z, minute)
  settle(day_h, day_z, day)
  redis.set_repl(mode)
  return reserved - used
end
