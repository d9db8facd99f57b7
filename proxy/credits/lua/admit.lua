-- One admission, atomically: the rate limit, the token limits and, when a hold id is given, the
-- credit hold. The request limit is a sliding log: at most LIMIT requests in any WINDOW ms, one
-- sorted-set member per admitted request (scored by Redis' own clock, so every worker and host
-- agrees on the time). A request refused by a limit counts nothing; one refused for credits has
-- been counted (requests, not tokens).
--
-- The token limits (tokens a minute, tokens a day) count what requests may use: a request
-- reserves its worst case (an upper bound of its prompt plus its completion cap) at admission,
-- and its settlement (token_settle.lua) puts the engine's count in its place. Each window is a
-- hash of buckets (1 s for the minute, 5 min for the day: bucket -> tokens, 't' their total,
-- 'o' the oldest, and in the first window 'r', what requests in flight still reserve: a hint
-- for Retry-After) and a zset of its buckets, read only when buckets leave the window. A
-- window keeps one bucket more than it spans, so it never holds less than the exact sliding
-- window would (it may refuse a little early, never admit over the limit). What this request
-- reserved, and where, is kept under its own key until its settlement, so a settlement is
-- applied once.
--
-- Windows and holds are soft state: neither written to the AOF nor replicated, so admission
-- never waits for an fsync. A Redis crash forgets them: the windows restart, and a request that
-- was running then finds no hold to settle and goes free (never an over-spend). What moved money
-- (settle.lua, credit.lua) is persisted.
--
-- Holds are tagged with this Redis process's run id, and those another process placed are
-- forgotten first (soft_state.lua, prepended).
--
-- Budgets (caps that reset, per account and per key, per UTC day, week or calendar month) count
-- what is charged in the period ('budgets spent', persisted by settle.lua) and what is held now
-- ('budget holds', soft like the holds): a hold that would take either past a cap is refused.
-- A postpaid account (caps field 'postpaid') has no balance to check, only its caps.
--
-- KEYS: request window zset, minute tokens hash, its buckets zset, day tokens hash, its buckets
--   zset, this request's reservation (all under the account's tag), then, with a hold: balance
--   hash, holds hash, hold expiry zset, budgets hash (caps), budgets spent hash, budget holds
--   hash, alerts stream, alerts due zset, alerted hash (a cap's first refusal in a period is
--   an alert: alerts.lua, prepended)
-- ARGV: limit (0: no limit), window ms, hold id ('' for none), amount, hold ttl s, this Redis
--   process's run id (the connection's; '' to ask the server), tokens to reserve, tokens a
--   minute (0: no limit), tokens a day (0: no limit), the key's id ('' for none)
-- Returns {status, remaining, reset ms, available, tokens remaining this minute (-1: no limit),
--   tokens reset ms, budget}: status 1 admitted, 0 rate limited, 2 insufficient credits, 3 hold
--   id already used, 4 token limited (reset -1: the request alone is over the limit), 5 over a
--   budget (`budget` names it, 'a:m' or 'k:<key id>:d'; available: what it has left).
--   remaining is -1 without a limit.
local run, holds
if ARGV[3] ~= '' then
  run = this_run(ARGV[6])
  holds = forget_stale_holds(KEYS[7], KEYS[8], KEYS[9], run, KEYS[12])
end
redis.set_repl(redis.REPL_NONE)
local now = redis.call('TIME')
local now_s = tonumber(now[1])
local now_ms = now_s * 1000 + math.floor(tonumber(now[2]) / 1000)
local limit = tonumber(ARGV[1])
local remaining, reset = -1, 0
local count = 0
if limit > 0 then
  local window = tonumber(ARGV[2])
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - window)
  count = redis.call('ZCARD', KEYS[1])
  if count >= limit then
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    return {0, 0, tonumber(oldest[2]) + window - now_ms, 0, -1, 0, ''}
  end
end

-- The token windows: {limit, bucket size s, buckets spanned, hash, zset}.
local tokens = tonumber(ARGV[7])
local windows = {}
if tonumber(ARGV[8]) > 0 then
  windows[#windows + 1] = {tonumber(ARGV[8]), 1, 60, KEYS[2], KEYS[3]}
end
if tonumber(ARGV[9]) > 0 then
  windows[#windows + 1] = {tonumber(ARGV[9]), 300, 288, KEYS[4], KEYS[5]}
end
local tokens_left, tokens_reset = -1, 0
if tokens > 0 then
  for i, w in ipairs(windows) do
    local cap, size, span, h, z = w[1], w[2], w[3], w[4], w[5]
    local bucket = math.floor(now_s / size)
    local cutoff = bucket - span
    local got = redis.call('HMGET', h, 't', 'o', 'r')  -- total, oldest bucket, reserved
    local total = tonumber(got[1] or '0')
    if got[2] and tonumber(got[2]) < cutoff then  -- buckets that left take their tokens along
      for _, b in ipairs(redis.call('ZRANGEBYSCORE', z, '-inf', '(' .. cutoff)) do
        total = total - tonumber(redis.call('HGET', h, b) or '0')
        redis.call('HDEL', h, b)
      end
      redis.call('ZREMRANGEBYSCORE', z, '-inf', '(' .. cutoff)
      redis.call('HSET', h, 't', total)
      local first = redis.call('ZRANGE', z, 0, 0)[1]
      if first then redis.call('HSET', h, 'o', first) else redis.call('HDEL', h, 'o') end
    end
    if total + tokens > cap then
      local unspent = limit > 0 and (limit - count) or -1
      if tokens > cap then return {4, unspent, 0, 0, math.max(0, cap - total), -1, ''} end
      -- When enough of the window's tokens have left it; sooner when what is reserved by
      -- requests in flight would make room once they settle (they usually use less).
      local need, freed, at = total + tokens - cap, 0, 0
      for _, b in ipairs(redis.call('ZRANGE', z, 0, -1)) do
        freed = freed + tonumber(redis.call('HGET', h, b) or '0')
        if freed >= need then
          at = (tonumber(b) + span + 1) * size * 1000 - now_ms
          break
        end
      end
      if i == 1 and math.min(total, tonumber(got[3] or '0')) >= need then
        at = math.min(at, 1000)
      end
      return {4, unspent, 0, 0, math.max(0, cap - total), math.max(at, 1), ''}
    end
    w[6] = tostring(bucket)
    if i == 1 then tokens_left, tokens_reset = cap - total - tokens, 0 end
  end
  for i, w in ipairs(windows) do
    local h, z, b = w[4], w[5], w[6]
    if redis.call('HINCRBY', h, b, ARGV[7]) == tokens then  -- a new bucket (or one at zero)
      redis.call('ZADD', z, b, b)
      redis.call('HSETNX', h, 'o', b)
      redis.call('PEXPIRE', h, (w[3] + 1) * w[2] * 1000)  -- the window lives a span more
      redis.call('PEXPIRE', z, (w[3] + 1) * w[2] * 1000)
    end
    redis.call('HINCRBY', h, 't', ARGV[7])
    if i == 1 then redis.call('HINCRBY', h, 'r', ARGV[7]) end  -- the Retry-After hint's
  end
  if #windows > 0 then
    local minute = windows[1][2] == 1 and windows[1][6] or ''
    local day = windows[#windows][2] == 300 and windows[#windows][6] or ''
    redis.call('SET', KEYS[6], ARGV[7] .. ':' .. minute .. ':' .. day, 'EX', 86700)
  end
end

if limit > 0 then
  local member = now[1] .. '.' .. now[2]
  while redis.call('ZADD', KEYS[1], 'NX', now_ms, member) == 0 do member = member .. '+' end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  remaining = limit - count - 1
  reset = tonumber(oldest[2]) + tonumber(ARGV[2]) - now_ms
end
if ARGV[3] == '' then return {1, remaining, reset, 0, tokens_left, tokens_reset, ''} end
local amount = tonumber(ARGV[4])
local function unreserve()  -- it will not run: its tokens were never used
  if tokens == 0 then return end
  for i, w in ipairs(windows) do
    local h, b = w[4], w[6]
    redis.call('HINCRBY', h, b, -tokens)
    redis.call('HINCRBY', h, 't', -tokens)
    if i == 1 then redis.call('HINCRBY', h, 'r', -tokens) end
  end
  redis.call('DEL', KEYS[6])
end
-- The budgets: every cap of the account and of the key (one HMGET when there are none).
local names = {'a:d', 'a:w', 'a:m'}
if ARGV[10] ~= '' then
  for _, p in ipairs({'d', 'w', 'm'}) do names[#names + 1] = 'k:' .. ARGV[10] .. ':' .. p end
end
local caps = redis.call('HMGET', KEYS[10], 'postpaid', unpack(names))
local budgets = {}
for i, name in ipairs(names) do
  local cap = caps[i + 1]
  if cap then
    local index = period_index(string.sub(name, -1), now_s)
    local field = name .. ':' .. index
    local spent = tonumber(redis.call('HGET', KEYS[11], field) or '0')
    local used = spent + tonumber(redis.call('HGET', KEYS[12], field) or '0')
    if used + amount > tonumber(cap) then
      unreserve()
      alert_budget(KEYS[10], KEYS[13], KEYS[14], KEYS[15], field, spent, 0, used - spent, true)
      return {5, remaining, reset, tonumber(cap) - used, tokens_left, tokens_reset, name}
    end
    budgets[#budgets + 1] = field
  end
end
-- Every redis.call costs about a microsecond warm and several on a busy core, so the common
-- path is written in as few as it takes: the hold is claimed and the amount taken first, and
-- both are given back in the rare refusal (no one sees the difference: the script is atomic).
-- Figures go as the strings they came in where they can (Lua formats a number with sprintf).
if redis.call('HSETNX', KEYS[8], ARGV[3], ARGV[4]) == 0 then
  return {3, remaining, reset, 0, tokens_left, tokens_reset, ''}
end
local left = redis.call('HINCRBY', KEYS[7], 'available', 0 - amount)  -- never -0
if left < 0 and caps[1] ~= '1' then
  redis.call('HINCRBY', KEYS[7], 'available', ARGV[4])
  redis.call('HDEL', KEYS[8], ARGV[3])
  unreserve()
  return {2, remaining, reset, left + amount, tokens_left, tokens_reset, ''}
end
redis.call('HINCRBY', KEYS[7], 'held', ARGV[4])
redis.call('ZADD', KEYS[9], tonumber(now[1]) + tonumber(ARGV[5]), ARGV[3])
if holds ~= 'kept' then redis.call('HSET', KEYS[8], '@run', run) end  -- the first hold here
if #budgets > 0 then
  for _, field in ipairs(budgets) do redis.call('HINCRBY', KEYS[12], field, ARGV[4]) end
  redis.call('HSET', KEYS[12], 'h:' .. ARGV[3], table.concat(budgets, ','))
end
return {1, remaining, reset, left, tokens_left, tokens_reset, ''}
