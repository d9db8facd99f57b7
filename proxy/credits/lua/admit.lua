-- One admission, atomically: the rate limit, the token limits and, when a hold id is given, the
-- credit hold. The request limit is a sliding log: at most LIMIT requests in any WINDOW ms, one
-- sorted-set member per admitted request (scored by Redis' own clock, so every worker and host
-- agrees on the time). A request refused by a limit counts nothing; one refused for credits has
-- been counted (requests, not tokens).
--
-- The token limits (proxy.credits.token_windows: the tier's and the model group's, each of
-- prompt + completion tokens or of input or output alone, over a minute or a day) count what
-- requests may use: a request reserves its worst case (an upper bound of its prompt, its
-- completion cap) at admission, and its settlement (token_settle.lua, prepended: the windows'
-- shapes are its `window_shape`) puts the engine's count in its place. Each window is a hash of buckets (1 s for a minute, 5 min for a day: bucket ->
-- tokens, 't' their total, 'o' the oldest bucket that may be left, and in a minute window 'r',
-- what requests in flight still reserve: a hint for Retry-After), read in one HMGET with the
-- buckets that usually leave it and written in one HSET. A window keeps one bucket more than
-- it spans, so it never holds less than the exact sliding window would (it may refuse a
-- little early, never admit over the limit).
-- What this request reserved, and where, is kept under its own key until its settlement
-- ('<code>:<tokens>:<bucket>' per window, comma-separated), so a settlement is applied once.
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
-- KEYS: request window zset, this request's reservation (both under the account's tag), then,
--   with a hold: balance hash, holds hash, hold expiry zset, budgets hash (caps), budgets spent
--   hash, budget holds hash, alerts stream, alerts due zset, alerted hash (a cap's first
--   refusal in a period is an alert: alerts.lua, prepended); then each token window's buckets
--   hash (the last keys, one a window)
-- ARGV: limit (0: no limit), window ms, hold id ('' for none), amount, hold ttl s, this Redis
--   process's run id (the connection's; '' to ask the server), prompt tokens to reserve,
--   completion tokens to reserve, the key's id ('' for none), then each token window's code
--   ('tm' tokens a minute, 'id' input tokens a day, 'om' output tokens a minute ...) and limit
-- Returns {status, remaining, reset ms, available, {tokens remaining in each window}, tokens
--   reset ms, budget, the window that refused}: status 1 admitted, 0 rate limited, 2
--   insufficient credits, 3 hold id already used, 4 token limited (reset -1: the request alone
--   is over that window's limit), 5 over a budget (`budget` names it, 'a:m' or 'k:<key id>:d';
--   available: what it has left). remaining is -1 without a limit.
local run, holds
if ARGV[3] ~= '' then
  run = this_run(ARGV[6])
  holds = forget_stale_holds(KEYS[3], KEYS[4], KEYS[5], run, KEYS[8])
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
    return {0, 0, tonumber(oldest[2]) + window - now_ms, 0, {}, 0, '', 0}
  end
end

-- The token windows: each a hash of buckets, 't' their total, 'o' the oldest bucket that may
-- still be there (the ones before it are gone), 'r' (minute windows) what requests in flight
-- reserve. A bucket leaves once it is `span` buckets old; its tokens leave the total with it.
local prompt, completion = tonumber(ARGV[7]), tonumber(ARGV[8])
local count_windows = (#ARGV - 9) / 2
local first_key = #KEYS - count_windows
local windows, lefts = {}, {}

-- The buckets of window `h` older than `cutoff` (the oldest that may be left is `oldest`, and
-- `seen` has the three just before the cutoff, read already), and their tokens.
local function leaving(h, oldest, cutoff, seen)
  local gone, tokens = {}, 0
  local function add(b, n)
    gone[#gone + 1], tokens = b, tokens + tonumber(n)
  end
  for i = 1, 3 do
    if cutoff - i >= oldest and seen[i] then add(tostring(cutoff - i), seen[i]) end
  end
  if cutoff - oldest > 512 then  -- so many: look at what is there instead
    local all = redis.call('HGETALL', h)
    for i = 1, #all, 2 do
      local b = tonumber(all[i])
      if b and b < cutoff - 3 then add(all[i], all[i + 1]) end
    end
  elseif cutoff - oldest > 3 then  -- more left at once: a window quiet for a while
    local older = {}
    for b = oldest, cutoff - 4 do older[#older + 1] = tostring(b) end
    local got = redis.call('HMGET', h, unpack(older))
    for i, b in ipairs(older) do
      if got[i] then add(b, got[i]) end
    end
  end
  return gone, tokens
end

-- When enough of window `h`'s tokens (`need`) will have left it, in ms from now.
local function room_at(h, need, cutoff, size, span)
  local live, all = {}, redis.call('HGETALL', h)
  for i = 1, #all, 2 do
    local b = tonumber(all[i])
    if b and b >= cutoff then live[#live + 1] = {b, tonumber(all[i + 1])} end
  end
  table.sort(live, function(x, y) return x[1] < y[1] end)
  local freed = 0
  for _, bucket in ipairs(live) do
    freed = freed + bucket[2]
    if freed >= need then return (bucket[1] + span + 1) * size * 1000 - now_ms end
  end
  return 0
end

if prompt + completion > 0 then
  for i = 1, count_windows do
    local code, cap = ARGV[8 + 2 * i], tonumber(ARGV[9 + 2 * i])
    local size, span, tokens = window_shape(code, prompt, completion)
    local h = KEYS[first_key + i]
    local bucket = math.floor(now_s / size)
    local cutoff = bucket - span
    -- One read: the total, the oldest, what is reserved, this bucket, and the three buckets
    -- just past the window (what usually leaves it since the last request).
    local got = redis.call('HMGET', h, 't', 'o', 'r', bucket, cutoff - 1, cutoff - 2,
                           cutoff - 3)
    local total, oldest = tonumber(got[1] or '0'), tonumber(got[2] or cutoff)
    local gone, left_window = {}, 0
    if oldest < cutoff then
      gone, left_window = leaving(h, oldest, cutoff, {got[5], got[6], got[7]})
      total = total - left_window
    end
    if total + tokens > cap then
      local unspent = limit > 0 and (limit - count) or -1
      lefts[i] = math.max(0, cap - total)
      if tokens > cap then return {4, unspent, 0, 0, lefts, -1, '', i} end
      -- When enough of the window's tokens have left it; sooner when what is reserved by
      -- requests in flight would make room once they settle (they usually use less).
      local need = total + tokens - cap
      local at = room_at(h, need, cutoff, size, span)
      if size == 1 and math.min(total, tonumber(got[3] or '0')) >= need then
        at = math.min(at, 1000)
      end
      return {4, unspent, 0, 0, lefts, math.max(at, 1), '', i}
    end
    windows[i] = {h = h, size = size, span = span, code = code, tokens = tokens,
                  bucket = tostring(bucket), total = total, reserved = tonumber(got[3] or '0'),
                  current = got[4], gone = gone, moved = oldest ~= cutoff, cutoff = cutoff}
    lefts[i] = cap - total - tokens
  end
  local reserved = {}
  for i, w in ipairs(windows) do
    if #w.gone > 0 then redis.call('HDEL', w.h, unpack(w.gone)) end
    local fields = {w.bucket, tonumber(w.current or '0') + w.tokens, 't', w.total + w.tokens}
    if w.size == 1 then fields[5], fields[6] = 'r', w.reserved + w.tokens end
    if w.moved then fields[#fields + 1], fields[#fields + 2] = 'o', w.cutoff end
    redis.call('HSET', w.h, unpack(fields))
    if not w.current then  -- a new bucket: the window lives a span more
      redis.call('PEXPIRE', w.h, (w.span + 1) * w.size * 1000)
    end
    reserved[i] = w.code .. ':' .. w.tokens .. ':' .. w.bucket
  end
  if #reserved > 0 then
    redis.call('SET', KEYS[2], table.concat(reserved, ','), 'EX', 86700)
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
if ARGV[3] == '' then return {1, remaining, reset, 0, lefts, 0, '', 0} end
local amount = tonumber(ARGV[4])
local function unreserve()  -- it will not run: its tokens were never used
  if #windows == 0 then return end
  for _, w in ipairs(windows) do
    redis.call('HINCRBY', w.h, w.bucket, 0 - w.tokens)  -- never -0: not an integer to Redis
    redis.call('HINCRBY', w.h, 't', 0 - w.tokens)
    if w.size == 1 then redis.call('HINCRBY', w.h, 'r', 0 - w.tokens) end
  end
  redis.call('DEL', KEYS[2])
end
-- The budgets: every cap of the account and of the key (one HMGET when there are none).
local names = {'a:d', 'a:w', 'a:m'}
if ARGV[9] ~= '' then
  for _, p in ipairs({'d', 'w', 'm'}) do names[#names + 1] = 'k:' .. ARGV[9] .. ':' .. p end
end
local caps = redis.call('HMGET', KEYS[6], 'postpaid', 'below', unpack(names))
local budgets, marks = {}, {}  -- the budgets' fields; the hold's marks (soft_state.lua)
for i, name in ipairs(names) do
  local cap = caps[i + 2]
  if cap then
    local index = period_index(string.sub(name, -1), now_s)
    local field = name .. ':' .. index
    local spent = tonumber(redis.call('HGET', KEYS[7], field) or '0')
    local used = spent + tonumber(redis.call('HGET', KEYS[8], field) or '0')
    if used + amount > tonumber(cap) then
      unreserve()
      alert_budget(KEYS[9], KEYS[10], KEYS[11], field, tonumber(cap), spent, 0, used - spent,
                   true)
      return {5, remaining, reset, tonumber(cap) - used, lefts, 0, name, 0}
    end
    budgets[#budgets + 1] = field
    marks[#marks + 1] = field .. '=' .. cap
  end
end
if caps[2] then marks[#marks + 1] = 'below=' .. caps[2] end
-- Every redis.call costs about a microsecond warm and several on a busy core, so the common
-- path is written in as few as it takes: the hold is claimed and the amount taken first, and
-- both are given back in the rare refusal (no one sees the difference: the script is atomic).
-- Figures go as the strings they came in where they can (Lua formats a number with sprintf).
if redis.call('HSETNX', KEYS[4], ARGV[3], ARGV[4]) == 0 then
  return {3, remaining, reset, 0, lefts, 0, '', 0}
end
local left = redis.call('HINCRBY', KEYS[3], 'available', 0 - amount)  -- never -0
if left < 0 and caps[1] ~= '1' then
  redis.call('HINCRBY', KEYS[3], 'available', ARGV[4])
  redis.call('HDEL', KEYS[4], ARGV[3])
  unreserve()
  return {2, remaining, reset, left + amount, lefts, 0, '', 0}
end
redis.call('HINCRBY', KEYS[3], 'held', ARGV[4])
redis.call('ZADD', KEYS[5], tonumber(now[1]) + tonumber(ARGV[5]), ARGV[3])
if holds ~= 'kept' then redis.call('HSET', KEYS[4], '@run', run) end  -- the first hold here
for _, field in ipairs(budgets) do redis.call('HINCRBY', KEYS[8], field, ARGV[4]) end
if #marks > 0 then redis.call('HSET', KEYS[8], 'h:' .. ARGV[3], table.concat(marks, ',')) end
return {1, remaining, reset, left, lefts, 0, '', 0}
