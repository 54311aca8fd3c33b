-- sliding-window-counter, ported from
-- crates/core/src/policy/sliding_window_counter.rs.
-- State (hash): w = start of the current window, p = previous (cost
-- admitted in the window before), c = current (cost admitted in this one).
local key = KEYS[1]
local v = redis.call('HMGET', key, 'w', 'p', 'c')
local existed = v[1] ~= false or v[2] ~= false or v[3] ~= false
local start, previous, current
if existed then
  start = int_field(v[1], 'w')
  previous = int_field(v[2], 'p')
  current = int_field(v[3], 'c')
else
  start = NOW - fmod(NOW, W)
  previous = 0
  current = 0
end

-- Clock regression: decided at the recorded window start, never rolling
-- the windows back.
local now = NOW
if start > now then now = start end
local window = now - fmod(now, W)
if window ~= start then
  -- Only the window just before this one carries. window > start here, so
  -- the difference is exact where start + W might not be.
  if window - start == W then previous = current else previous = 0 end
  current = 0
  start = window
end
local elapsed = now - window
local carried = muldiv(previous, W - elapsed, W)
-- carried and current are each at most limit for valid state; a sum that
-- rounds lies above limit anyway, so the comparisons below stay exact.
local estimate = carried + current
local left = 0
if estimate < LIMIT then left = LIMIT - estimate end

local result
if COST <= left and estimate <= LIMIT then
  current = current + COST
  result = reply(1, left - COST, 0)
elseif COST <= LIMIT then
  -- The smallest elapsed at which previous * (W - e) div W <= need, for
  -- previous > need.
  local function first_elapsed(prev, need)
    return muldiv(W, prev - need - 1, prev) + 1
  end
  -- The earliest admission: later in this window, else in the next (where
  -- current becomes previous), else two windows on. As windows + e ms
  -- after this window's start.
  local windows, e
  if LIMIT >= current and LIMIT - current >= COST then
    local need = LIMIT - current - COST
    if previous > need then
      local first = first_elapsed(previous, need)
      if first < W then windows, e = 0, first end
    end
  end
  if windows == nil then
    local need = LIMIT - COST
    if current <= need then
      windows, e = 1, 0
    else
      local first = first_elapsed(current, need)
      if first < W then windows, e = 1, first else windows, e = 2, 0 end
    end
  end
  local span = e
  if windows == 1 then
    span = dsum(0, W, e)
  elseif windows == 2 then
    span = dsum(0, W, W)
  end
  local retry
  if type(span) == 'number' then
    retry = dsum(window - NOW, span, 0)
  else
    -- Only with windows near 2^53 ms: add the (then non-negative) offset.
    local X = widelib()
    local d = window - NOW
    if d >= 0 then retry = X.wadd(span, X.wide(d)) else retry = X.wsub(span, X.wide(-d)) end
  end
  result = reply(0, left, retry)
else
  result = reply(0, left, nil)
end

-- Forgettable two windows after the current one's start.
local ttl = MAX_TTL
local two = dsum(0, W, W)
if type(two) == 'number' then ttl = ttl_after(start - NOW, two) end
local px = keep_for(existed, ttl)
if px then
  redis.call('HSET', key, 'w', start, 'p', previous, 'c', current)
  redis.call('PEXPIRE', key, px)
end
return result
