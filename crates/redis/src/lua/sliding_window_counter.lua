-- sliding-window-counter, ported from
-- crates/core/src/policy/sliding_window_counter.rs.
-- State (24 bytes): the start of the current window, previous (cost
-- admitted in the window before), current (cost admitted in this one).
local s = redis.call('GET', KEYS[1])
local start, previous, current
if s then
  if #s ~= 24 then lib().corrupt('state has a bad length ' .. #s) end
  start, previous, current = struct.unpack('>ddd', s)
  -- NaN fails every comparison, so it is caught too.
  if not (start >= 0 and start < TWO53 and start % 1 == 0) then lib().bad('window start', start) end
  -- Windows are aligned to multiples of W: another start was not written
  -- here, and rolling from it would drop its count.
  if fmod(start, W) ~= 0 then lib().corrupt('field window start is not a multiple of window_ms (' .. string.format('%.0f', start) .. ')') end
  if not (previous >= 0 and previous < TWO53 and previous % 1 == 0) then lib().bad('previous count', previous) end
  if not (current >= 0 and current < TWO53 and current % 1 == 0) then lib().bad('current count', current) end
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
-- carried = floor(previous * (W - elapsed) / W), plainly while the product
-- stays below 2^53.
local carried = previous * (W - elapsed)
if carried < TWO53 then
  carried = (carried - fmod(carried, W)) / W
else
  carried = lib().muldiv(previous, W - elapsed, W)
end
-- carried and current are each at most limit for valid state; a sum that
-- rounds lies above limit anyway, so the comparisons below stay exact.
local estimate = carried + current
local left = 0
if estimate < LIMIT then left = LIMIT - estimate end

local result
if COST <= left and estimate <= LIMIT then
  current = current + COST
  result = { 1, left - COST, 1, 0 }
elseif COST <= LIMIT then
  local X = lib()
  local muldiv, dsum = X.muldiv, X.dsum
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
    local Y = X.widelib()
    local d = window - NOW
    if d >= 0 then retry = Y.wadd(span, Y.wide(d)) else retry = Y.wsub(span, Y.wide(-d)) end
  end
  result = X.reply(0, left, retry)
else
  result = { 0, left, 0 }
end

-- Forgettable once nothing it counted counts, as is_forgettable says: two
-- windows after the current one's start while it counts, one while only
-- the previous window does, from its start when neither does (a peek or a
-- refusal is all it saw): start - NOW + that, at least 0. Both terms are
-- below 2^53, so the sum is exact when it is below 2^53, and at or above
-- it otherwise, which caps to MAX_TTL.
local ttl = MAX_TTL
local counting = 0
if current > 0 then counting = W + W elseif previous > 0 then counting = W end
if counting < TWO53 then
  ttl = start - NOW + counting
  if ttl < 0 then ttl = 0 elseif ttl > MAX_TTL then ttl = MAX_TTL end
end
if ttl <= 0 and GRACE == 0 then
  if s then redis.call('DEL', KEYS[1]) end
else
  redis.call('SET', KEYS[1], struct.pack('>ddd', start, previous, current), 'PX', string.format('%.0f', ttl + GRACE))
end
return result
