-- Forget an account's holds if another Redis process placed them (soft_state.lua), before the
-- ledger reads them (a balance, the open holds, reconcile).
-- KEYS: balance hash, holds hash, hold expiry zset, budget holds hash. Returns 1 if they were
-- forgotten.
if forget_stale_holds(KEYS[1], KEYS[2], KEYS[3], this_run(''), KEYS[4]) == 'forgotten' then
  return 1
end
return 0
