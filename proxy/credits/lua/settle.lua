-- ARGV: hold id, cost, then journal field/value pairs. Returns the charge, or -1 if already ended.
local held = redis.call('HGET', KEYS[2], ARGV[1])
if not held then return -1 end
held = tonumber(held)
local charge = math.max(0, math.min(tonumber(ARGV[2]), held))
redis.call('HINCRBY', KEYS[1], 'held', 0 - held)
redis.call('HINCRBY', KEYS[1], 'spent', charge)
redis.call('HINCRBY', KEYS[1], 'available', held - charge)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
local entry = {'type', 'charge', 'hold', ARGV[1], 'held', held, 'cost', charge}
for i = 3, #ARGV do entry[#entry + 1] = ARGV[i] end
redis.call('XADD', KEYS[4], '*', unpack(entry))
return charge
