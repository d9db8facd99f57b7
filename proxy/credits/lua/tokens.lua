-- A guest's settled tokens (its windows live on the rate-limit Redis; a keyed account's are
-- settled by settle.lua, in the same step as its charge): token_settle.lua, prepended.
-- KEYS: the request's reservation, then the buckets hash of each window it reserved in.
-- ARGV: prompt tokens used, completion tokens used.
settle_tokens(KEYS[1], 2, tonumber(ARGV[1]), tonumber(ARGV[2]),
              tonumber(redis.call('TIME')[1]))
return 1
