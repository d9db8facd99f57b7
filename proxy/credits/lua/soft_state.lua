-- Holds are soft state: placed and released without being logged (admit.lua), so admission never
-- waits for an fsync. But a snapshot can capture them with no record of their release: an AOF
-- rewrite, or the full sync that makes a replica. A Redis restarted from that AOF, or a replica
-- promoted, would then hold money for requests long ended. So each account's holds carry the run
-- id of the Redis process that placed them ('@run' in the holds hash), and before anything else
-- reads or changes them, holds placed by another process are forgotten: their amount goes back
-- to available, logged, so the AOF replays to the same state. A request that was running then
-- finds no hold and is charged from what is available, never more than it held (settle.lua).
-- (Prepended to the scripts that touch holds; proxy.credits.ledger.lua_script.)

-- The run id of this Redis process: `given` (the connection's, proxy.store.script_pipe) or, for
-- callers without one, asked of the server (INFO costs ~7 us: not on the request path).
local function this_run(given)
  if given and given ~= '' then return given end
  return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
end

-- Forget the account's holds if another Redis process placed them (logged, whatever the
-- caller's replication mode), and what they held against its budgets (`capheld`). Returns
-- 'kept' (they are this process's), 'none' (there are none) or 'forgotten'.
local function forget_stale_holds(balance, holds, expiry, run, capheld)
  local tag = redis.call('HGET', holds, '@run')
  if tag == run then return 'kept' end
  if not tag and redis.call('EXISTS', holds, expiry) == 0 then return 'none' end
  redis.set_repl(redis.REPL_ALL)
  local held = redis.call('HGET', balance, 'held')
  if held and held ~= '0' then
    redis.call('HINCRBY', balance, 'available', held)
    redis.call('HSET', balance, 'held', '0')
  end
  redis.call('DEL', holds, expiry, capheld)
  return 'forgotten'
end

-- A hold that ends stops counting against the budgets it counted against. admit.lua recorded
-- them, with each cap in force then, and the balance threshold for alerts, as the hold's marks
-- ('h:<hold id>' in the budget holds hash: '<field>=<cap>,...,below=<threshold>'). Returns
-- the marks (or nil), for settle.lua's alerts.
local function release_budgets(capheld, hold_id, held)
  local marks = redis.call('HGET', capheld, 'h:' .. hold_id)
  if not marks then return nil end
  redis.call('HDEL', capheld, 'h:' .. hold_id)
  for field in string.gmatch(marks, '([^,=]+)=%d+') do
    if field ~= 'below' then  -- left at 0 when the last ends (settle.lua drops old periods')
      redis.call('HINCRBY', capheld, field, 0 - tonumber(held))  -- never -0 (not an integer)
    end
  end
  return marks
end
