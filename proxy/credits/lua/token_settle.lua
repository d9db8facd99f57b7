-- Token windows (proxy.credits.token_windows), as admit.lua reserves in them and settlement
-- corrects them. (Prepended to admit.lua, settle.lua and tokens.lua.)

-- A window's shape from its code (kind t, i or o, then period m or d): its bucket seconds, the
-- buckets it spans, and its share of a request's `prompt` and `completion` tokens.
local function window_shape(code, prompt, completion)
  local kind, size, span = string.sub(code, 1, 1), 1, 60
  if string.sub(code, 2, 2) == 'd' then size, span = 300, 288 end
  if kind == 'i' then return size, span, prompt end
  if kind == 'o' then return size, span, completion end
  return size, span, prompt + completion
end

-- A settled request's tokens: what the engine counted takes the place of what admission
-- reserved (admit.lua), in the buckets it was reserved in, once (the reservation's own key is
-- taken with GETDEL). A bucket that already left its window took the reservation with it.
-- Soft state, like the windows.
-- `hashes`: the index in KEYS of the first window's buckets hash; the others follow, in the
-- order the request reserved in them (the reservation names each by its code). `now_s`:
-- Redis' clock (the caller read it).
local function settle_tokens(reservation, hashes, prompt, completion, now_s)
  redis.set_repl(redis.REPL_NONE)
  local held = redis.call('GETDEL', reservation)
  if held then
    local i = hashes
    for code, reserved, b in string.gmatch(held, '(%a%a):(%d+):(%d+)') do
      local h = KEYS[i]
      i = i + 1
      local size, span, used = window_shape(code, prompt, completion)
      reserved = tonumber(reserved)
      if h and reserved > 0 and tonumber(b) >= math.floor(now_s / size) - span then
        local got = redis.call('HMGET', h, b, 't', 'r')  -- read in one call, written in one
        local fields = {b, tonumber(got[1] or '0') + used - reserved,
                        't', tonumber(got[2] or '0') + used - reserved}
        if size == 1 then fields[5], fields[6] = 'r', tonumber(got[3] or '0') - reserved end
        redis.call('HSET', h, unpack(fields))
      end
    end
  end
  redis.set_repl(redis.REPL_ALL)
end
