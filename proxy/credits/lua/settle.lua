-- End a hold exactly once (charge min(cost, held), release the rest), or journal a use that held
-- nothing (guests); append the journal entry and keep the running totals, in one atomic step.
-- Holds are soft state (see admit.lua): releasing one is not persisted, only the charge is, so
-- the AOF replays to the balance with no hold in it.
--
-- A hold that is gone was either ended already (settled or swept: its id is in the `ended` set
-- for a while, so a retried settle does nothing) or forgotten by a Redis restart; the request
-- then ran on money that was reserved, and is charged from what is available, never more than
-- it held (`recovered` in the journal), and not counted against its budgets (what the hold
-- counted against them was forgotten with it).
--
-- Holds another Redis process placed are forgotten first (soft_state.lua, prepended): a
-- request that was running when Redis restarted goes the "forgotten by a restart" way.
--
-- A charge that takes a budget's spend across 50, 80 or 100 % of its cap, or the balance under
-- the account's threshold, records an alert in the same step (alerts.lua, prepended).
--
-- KEYS: balance hash, holds hash, hold expiry zset, journal stream, totals hash, ended zset,
--       budgets spent hash, budget holds hash, alerts stream, alerts due zset, alerted
--       hash, then, for a request that reserved tokens (its token limits):
--       its reservation and the buckets hash of each window it reserved in
--       (token_settle.lua, prepended)
-- ARGV: hold id ('' for none), cost, amount held, status, model, details (JSON), journal
--       entries kept, journal ttl s (0: none), this Redis process's run id (the connection's;
--       '' to ask the server), prompt tokens used ('' without a reservation), completion
--       tokens used, then pairs of (usage unit, count) that the running totals add up
--       (prompt_tokens, completion_tokens, characters, audio_ms, ...)
-- Returns the charge, or -1 when there was nothing to do (the hold had already ended).
--
-- Figures go to redis.call as the strings they came in where they can: Lua turns a number into
-- a string with sprintf on every call, a measurable share of this script's cost.
local now = redis.call('TIME')
if ARGV[10] ~= '' and #KEYS >= 12 then  -- its tokens, once, whatever became of its hold
  settle_tokens(KEYS[12], 13, tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(now[1]))
end
local cost = tonumber(ARGV[2])
local charge, held = 0, '0'
local recovered = '0'
local below  -- the balance threshold for alerts, when the hold's marks carry one
if ARGV[1] ~= '' then
  forget_stale_holds(KEYS[1], KEYS[2], KEYS[3], this_run(ARGV[9]), KEYS[8])
  held = redis.call('HGET', KEYS[2], ARGV[1])  -- a hold still there has not ended
  if not held then
    if redis.call('ZSCORE', KEYS[6], ARGV[1]) then return -1 end
    if cost <= 0 then return -1 end
    held = ARGV[3]
    local available = tonumber(redis.call('HGET', KEYS[1], 'available') or '0')
    charge = math.max(0, math.min(cost, tonumber(held), available))
    recovered = '1'
  else
    charge = math.max(0, math.min(cost, tonumber(held)))
    redis.set_repl(redis.REPL_NONE)
    redis.call('HINCRBY', KEYS[1], 'held', 0 - tonumber(held))
    redis.call('HINCRBY', KEYS[1], 'available', held)
    redis.call('HDEL', KEYS[2], ARGV[1])
    redis.call('ZREM', KEYS[3], ARGV[1])
    local marks = release_budgets(KEYS[8], ARGV[1], held)
    redis.set_repl(redis.REPL_ALL)
    if marks and charge > 0 then  -- what it cost counts against the budgets it was held in
      for field, cap in string.gmatch(marks, '([^,=]+)=(%d+)') do
        if field == 'below' then
          below = tonumber(cap)
        else
          local spent = redis.call('HINCRBY', KEYS[7], field, charge)
          if spent == charge then  -- the period's first charge: forget periods long over
            local name, index = string.match(field, '^(.*):(%d+)$')
            local over = name .. ':' .. (tonumber(index) - 2)
            redis.call('HDEL', KEYS[7], over)
            redis.set_repl(redis.REPL_NONE)
            redis.call('HDEL', KEYS[8], over)
            redis.set_repl(redis.REPL_ALL)
          end
          alert_budget(KEYS[9], KEYS[10], KEYS[11], field, tonumber(cap), spent, charge, 0,
                       false)
        end
      end
    end
  end
  redis.call('HINCRBY', KEYS[1], 'available', 0 - charge)  -- never -0
  redis.call('HINCRBY', KEYS[1], 'spent', charge)
  if below then alert_balance(KEYS[1], KEYS[9], KEYS[10], KEYS[11], charge, below) end
  -- Ended ids are kept two minutes: longer than any retry of a settlement.
  redis.call('ZADD', KEYS[6], now[1], ARGV[1])
  redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', tonumber(now[1]) - 120)
end
local keep = tonumber(ARGV[7])
if ARGV[1] == '' then
  -- No money moved: an approximately trimmed stream is exact enough.
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'type', 'usage', 'cost', '0',
             'status', ARGV[4], 'details', ARGV[6])
else
  local charge_text = tostring(charge)  -- formatted once for the entry and the totals
  redis.call('XADD', KEYS[4], '*', 'type', 'charge', 'hold', ARGV[1], 'held', held,
             'cost', charge_text, 'status', ARGV[4], 'recovered', recovered, 'details', ARGV[6])
  -- Money entries beyond the retention move into the balance's checkpoint first, so the
  -- journal plus the checkpoint still add up to the balance (see Ledger.reconcile).
  if redis.call('XLEN', KEYS[4]) > keep + 100 then
    local credited, spent = 0, 0
    local old = redis.call('XRANGE', KEYS[4], '-', '+', 'COUNT', 100)
    for _, item in ipairs(old) do
      local f = item[2]
      local kind, amount, charged = nil, 0, 0
      for i = 1, #f, 2 do
        if f[i] == 'type' then kind = f[i + 1]
        elseif f[i] == 'amount' then amount = tonumber(f[i + 1])
        elseif f[i] == 'cost' then charged = tonumber(f[i + 1]) end
      end
      if kind == 'credit' then credited = credited + amount end
      if kind == 'charge' then spent = spent + charged end
      redis.call('XDEL', KEYS[4], item[1])
    end
    redis.call('HINCRBY', KEYS[1], 'trimmed_credited', credited)
    redis.call('HINCRBY', KEYS[1], 'trimmed_spent', spent)
  end
  -- Per day and per model; the all-time totals are the sum of the days (summed when read:
  -- four calls fewer here, on every request).
  local scopes = {'d|' .. math.floor(tonumber(now[1]) / 86400) .. '|'}
  if ARGV[5] ~= '' then scopes[2] = 'm|' .. ARGV[5] .. '|' end
  for _, scope in ipairs(scopes) do
    redis.call('HINCRBY', KEYS[5], scope .. 'requests', '1')
    for i = 12, #ARGV - 1, 2 do
      redis.call('HINCRBY', KEYS[5], scope .. ARGV[i], ARGV[i + 1])
    end
    redis.call('HINCRBY', KEYS[5], scope .. 'cost', charge_text)
  end
end
local ttl = tonumber(ARGV[8])
if ttl > 0 then redis.call('EXPIRE', KEYS[4], ttl) end
return charge
