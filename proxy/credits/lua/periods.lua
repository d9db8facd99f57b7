-- Budget periods (UTC): a day, a week from Monday, a calendar month, each numbered so that a
-- new period is a new number (a budget's figures are kept per number: it resets on the
-- boundary with nothing to sweep). Prepended to admit.lua; proxy.credits.budgets computes
-- the same numbers and their boundaries in Python.
local function period_index(period, now_s)
  local day = math.floor(now_s / 86400)
  if period == 'd' then return day end
  if period == 'w' then return math.floor((day + 3) / 7) end  -- 1970-01-01 was a Thursday
  -- The civil date of `day` (H. Hinnant's days_from_civil, inverted): year * 12 + month - 1.
  local z = day + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
                          - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400 + (month <= 2 and 1 or 0)
  return year * 12 + month - 1
end
