-- Release every hold whose expiry has passed on Redis' clock (a crashed worker's), journaled.
-- Holds are soft state (see admit.lua): the release is not persisted, its journal entry is.
-- Holds another Redis process placed are forgotten instead (soft_state.lua, prepended): they
-- are not this process's to journal.
-- KEYS: balance hash, holds hash, hold expiry zset, journal stream, ended zset, budget holds
-- hash. ARGV: none.
local now = redis.call('TIME')
local due = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now[1])
if #due == 0 then return 0 end
if forget_stale_holds(KEYS[1], KEYS[2], KEYS[3], this_run(''), KEYS[6]) == 'forgotten' then
  return 0
end
for _, id in ipairs(due) do
  local held = redis.call('HGET', KEYS[2], id)
  redis.set_repl(redis.REPL_NONE)
  if held then
    held = tonumber(held)
    redis.call('HINCRBY', KEYS[1], 'held', 0 - held)
    redis.call('HINCRBY', KEYS[1], 'available', held)
    redis.call('HDEL', KEYS[2], id)
    release_budgets(KEYS[6], id, held)
  end
  redis.call('ZREM', KEYS[3], id)
  redis.set_repl(redis.REPL_ALL)
  if held then
    redis.call('XADD', KEYS[4], '*', 'type', 'charge', 'hold', id, 'held', held, 'cost', 0,
               'status', 'expired', 'details', '{}')
    redis.call('ZADD', KEYS[5], tonumber(now[1]), id)  -- a late settle must not charge it
  end
end
return #due
