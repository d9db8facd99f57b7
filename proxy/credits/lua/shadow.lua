-- A shadow policy's limits (proxy.policy.shadow), for one request the live policies already
-- decided: its request rate and its token windows, in keys of their own, never enforced.
-- The request rate is the live one's sliding log (at most LIMIT requests in any WINDOW ms; a
-- request it refuses counts nothing). A token window is a hash of buckets (bucket -> tokens;
-- 1 s for a minute, 5 min for a day), keeping one bucket more than it spans, as the live
-- windows do; it counts what each request it admits used, once the request has ended.
-- Soft state, like the live windows: neither written to the AOF nor replicated.
--
-- KEYS: the request window (zset), then each token window (hash)
-- ARGV: limit (0: none), window ms, a member id unique to this request, '1' to check and count
--   its tokens ('0': a request the shadow refused before its limits: counted, no tokens), then
--   per token window: bucket seconds, buckets it spans, its limit, this request's tokens in it
-- Returns {1 counted | 0 over the request rate, the token window that refused (from 1) or 0}
redis.set_repl(redis.REPL_NONE)
local now = redis.call('TIME')
local now_s = tonumber(now[1])
local now_ms = now_s * 1000 + math.floor(tonumber(now[2]) / 1000)
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
if limit > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - window)
  if redis.call('ZCARD', KEYS[1]) >= limit then
    return {0, 0}
  end
end
redis.call('ZADD', KEYS[1], now_ms, ARGV[3])
redis.call('PEXPIRE', KEYS[1], window)
if ARGV[4] ~= '1' then
  return {1, 0}
end

local counted = {}
for i = 2, #KEYS do
  local a = 5 + (i - 2) * 4
  local size, span = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local cap, tokens = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local bucket = math.floor(now_s / size)
  local cutoff = bucket - span
  local flat = redis.call('HGETALL', KEYS[i])
  local total, old = 0, {}
  for j = 1, #flat, 2 do
    if tonumber(flat[j]) < cutoff then
      old[#old + 1] = flat[j]
    else
      total = total + tonumber(flat[j + 1])
    end
  end
  if #old > 0 then
    redis.call('HDEL', KEYS[i], unpack(old))
  end
  if total + tokens > cap then
    return {1, i - 1}
  end
  counted[#counted + 1] = {KEYS[i], bucket, tokens, size * (span + 1)}
end
for _, w in ipairs(counted) do
  if w[3] > 0 then
    redis.call('HINCRBY', w[1], w[2], w[3])
    redis.call('EXPIRE', w[1], w[4])
  end
end
return {1, 0}
