-- A settled request's tokens: what the engine counted takes the place of what admission
-- reserved (admit.lua), in the buckets it was reserved in, once (the reservation's own key is
-- taken with GETDEL). A bucket that already left its window took the reservation with it.
-- Soft state, like the windows. (Prepended to settle.lua and tokens.lua.)
-- Returns the tokens given back (reserved - used), or -1 when there was no reservation.
local function settle_tokens(minute_h, day_h, reservation, used)
  redis.set_repl(redis.REPL_NONE)
  local held = redis.call('GETDEL', reservation)
  if held then
    local reserved, minute, day = string.match(held, '^(%d+):(%d*):(%d*)$')
    reserved = tonumber(reserved)
    local now_s = tonumber(redis.call('TIME')[1])
    local first = true  -- the first window keeps what is reserved ('r', admit.lua)
    for _, w in ipairs({{minute_h, minute, 1, 60}, {day_h, day, 300, 288}}) do
      local h, b, size, span = w[1], w[2], w[3], w[4]
      if b ~= '' then
        if tonumber(b) >= math.floor(now_s / size) - span then  -- still in its window
          redis.call('HINCRBY', h, b, used - reserved)
          redis.call('HINCRBY', h, 't', used - reserved)
          if first then redis.call('HINCRBY', h, 'r', -reserved) end
        end
        first = false
      end
    end
    held = reserved - used
  end
  redis.set_repl(redis.REPL_ALL)
  return held or -1
end
