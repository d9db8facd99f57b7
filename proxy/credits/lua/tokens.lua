-- A guest's settled tokens (its windows live on the rate-limit Redis; a keyed account's are
-- settled by settle.lua, in the same step as its charge): token_settle.lua, prepended.
-- KEYS: minute tokens hash, its buckets zset, day tokens hash, its buckets zset, the request's
--   reservation. ARGV: tokens used.
return settle_tokens(KEYS[1], KEYS[3], KEYS[5], tonumber(ARGV[1]))
