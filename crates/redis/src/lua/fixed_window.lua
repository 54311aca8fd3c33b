-- fixed-window, ported from crates/core/src/policy/fixed_window.rs.
-- State (hash): w = start of the window `c` counts in, c = cost admitted
-- in it.
local key = KEYS[1]
local v = redis.call('HMGET', key, 'w', 'c')
local existed = v[1] ~= false or v[2] ~= false
local start, current
if existed then
  start = int_field(v[1], 'w')
  current = int_field(v[2], 'c')
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
  result = reply(1, left - COST, 0)
elseif COST <= LIMIT then
  -- Counts never fall inside a window: the next window is the first chance.
  result = reply(0, left, dsum(window - NOW, W, 0))
else
  result = reply(0, left, nil)
end

-- Forgettable one window after its start.
local ttl = ttl_after(start - NOW, W)
local px = keep_for(existed, ttl)
if px then
  redis.call('HSET', key, 'w', start, 'c', current)
  redis.call('PEXPIRE', key, px)
end
return result
