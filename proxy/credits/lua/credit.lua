-- ARGV: amount (may be negative), then journal pairs. Never takes `available` below zero.
local amount = tonumber(ARGV[1])
local available = tonumber(redis.call('HGET', KEYS[1], 'available') or '0')
if available + amount < 0 then return {0, available} end
redis.call('HINCRBY', KEYS[1], 'available', amount)
redis.call('HINCRBY', KEYS[1], 'credited', amount)
local entry = {'type', 'credit', 'amount', amount}
for i = 2, #ARGV do entry[#entry + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(entry))
return {1, available + amount}
