-- Alerts (proxy.credits.alerts): a budget's charged spend crossing 50, 80 or 100 % of its cap,
-- a cap refusing its first request of a period (100 %: the budget is used up for that
-- request), and the balance falling under the account's threshold ('below' in the caps hash).
-- The caps and the threshold are those admission read for the request (the hold's marks:
-- soft_state.lua), so settling reads no caps.
-- Each is recorded once, atomically with what caused it: per cap, percent and period, and per
-- top-up for the balance (the 'alerted' hash keeps what was last alerted). It goes into the
-- account's alerts stream and is due for delivery at once ('alerts_due': stream id -> when);
-- the leased sender (proxy.credits.webhooks) delivers it. Recorded events are persisted.
-- (Prepended to settle.lua and admit.lua.)

local function record_alert(stream, open, fields)
  redis.set_repl(redis.REPL_ALL)
  local id = redis.call('XADD', stream, 'MAXLEN', '~', '1000', '*', unpack(fields))
  redis.call('ZADD', open, '0', id)
end

-- A budget's field ('<cap>:<period number>', its cap `cap`) now at `spent` after a charge of
-- `charge`; or, with `refused`, a request refused by it (spent and held as they are).
local function alert_budget(stream, open, alerted, field, cap, spent, charge, held, refused)
  local name, index = string.match(field, '^(.*):(%d+)$')
  if cap <= 0 then return end  -- 0: frozen on purpose
  for _, percent in ipairs({50, 80, 100}) do
    local mark = cap * percent / 100
    local crossed = spent >= mark and spent - charge < mark
    if crossed or (refused and percent == 100) then
      local seen = name .. ':' .. percent
      if redis.call('HGET', alerted, seen) ~= index then
        redis.call('HSET', alerted, seen, index)
        record_alert(stream, open, {'type', 'budget', 'cap', name, 'period', index,
                                    'percent', percent, 'limit', cap, 'spent', spent,
                                    'held', held, 'refused', refused and '1' or '0'})
      end
    end
  end
end

-- The balance (credited - spent: what is left, holds included) after a charge of `charge`,
-- against the threshold `below`.
local function alert_balance(balance, stream, open, alerted, charge, below)
  local got = redis.call('HMGET', balance, 'credited', 'spent')
  local credited = got[1] or '0'
  local left = tonumber(credited) - tonumber(got[2] or '0')
  if left < below and left + charge >= below
      and redis.call('HGET', alerted, 'below') ~= credited then
    redis.call('HSET', alerted, 'below', credited)
    record_alert(stream, open, {'type', 'balance', 'threshold', below, 'balance', left})
  end
end
