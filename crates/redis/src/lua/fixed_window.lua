-- fixed-window, ported from crates/core/src/policy/fixed_window.rs.
-- State (16 bytes): the start of the window `current` counts in, and
-- current, the cost admitted in it.
local s = redis.call('GET', KEYS[1])
local start, current
if s then
  if #s ~= 16 then lib().corrupt('state has a bad length ' .. #s) end
  start, current = struct.unpack('>dd', s)
  -- NaN fails every comparison, so it is caught too.
  if not (start >= 0 and start < TWO53 and start % 1 == 0) then lib().bad('window start', start) end
  -- Windows are aligned to multiples of W: another start was not written
  -- here, and rolling from it would drop its count.
  if fmod(start, W) ~= 0 then lib().corrupt('field window start is not a multiple of window_ms (' .. string.format('%.0f', start) .. ')') end
  if not (current >= 0 and current < TWO53 and current % 1 == 0) then lib().bad('current count', current) end
else
  start = NOW - fmod(NOW, W)
  current = 0
end

-- Clock regression: a request from before the recorded window is decided
-- at its start, so a clock that steps back never resets it.
local now = NOW
if start > now then now = start end
local window = now - fmod(now, W)
if window ~= start then
  current = 0
  start = window
end
local left = LIMIT - current
if left < 0 then left = 0 end

local result
if COST <= left then
  current = current + COST
  result = { 1, left - COST, 1, 0 }
elseif COST <= LIMIT then
  -- Counts never fall inside a window: the next window is the first chance.
  local X = lib()
  result = X.reply(0, left, X.dsum(window - NOW, W, 0))
else
  result = { 0, left, 0 }
end

-- Forgettable one window after its start while it counts: start - NOW + W,
-- at least 0; from its start when it counts nothing (a peek or a refusal
-- is all it saw), as is_forgettable says. Both terms are below 2^53, so
-- the sum is exact when it is below 2^53, and at or above it otherwise,
-- which caps to MAX_TTL.
local counting = W
if current == 0 then counting = 0 end
local ttl = start - NOW + counting
if ttl < 0 then ttl = 0 elseif ttl > MAX_TTL then ttl = MAX_TTL end
if ttl <= 0 and GRACE == 0 then
  if s then redis.call('DEL', KEYS[1]) end
else
  redis.call('SET', KEYS[1], struct.pack('>dd', start, current), 'PX', string.format('%.0f', ttl + GRACE))
end
return result
