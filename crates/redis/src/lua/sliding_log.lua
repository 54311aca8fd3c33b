-- sliding-log, ported from crates/core/src/policy/sliding_log.rs.
-- State (string): 8 bytes `used` (the sum of the entries' costs), then one
-- 16-byte entry (at_ms, cost) per millisecond with admitted cost, oldest
-- first; all big-endian doubles holding integers below 2^53.
local key = KEYS[1]
local s = redis.call('GET', key)
local existed = s ~= false
local used, n = 0, 0
if existed then
  local len = string.len(s)
  if len < 8 or fmod(len - 8, 16) ~= 0 then corrupt('log has a bad length ' .. len) end
  used = int_field(struct.unpack('>d', s, 1), 'used')
  n = (len - 8) / 16
end

local function entry(i)
  local at, cost = struct.unpack('>dd', s, 9 + (i - 1) * 16)
  return int_field(at, 'at_ms'), int_field(cost, 'cost')
end

-- Clock regression: decided at the newest entry's time, so entries can
-- neither be re-counted nor appended out of order.
local newest = 0
if n > 0 then newest = entry(n) end
local now = math.max(NOW, newest)
-- An entry made at `at` covers at ..= at + W - 1; `first` is the oldest kept.
local first = 1
while first <= n do
  local at, cost = entry(first)
  if now - at < W then break end
  if cost > used then corrupt('log entries exceed used') end
  used = used - cost
  first = first + 1
end
local left = 0
if used < LIMIT then left = LIMIT - used end

local result
local tail = ''
local last = n
if COST <= left then
  if COST > 0 then
    local last_at, last_cost
    if first <= n then last_at, last_cost = entry(n) end
    if last_at == now then
      last = n - 1
      tail = struct.pack('>dd', now, last_cost + COST)
    else
      tail = struct.pack('>dd', now, COST)
    end
    used = used + COST
  end
  result = reply(1, left - COST, 0)
elseif COST > LIMIT then
  result = reply(0, left, nil)
else
  -- The oldest entries leave first; the request fits once enough of them
  -- have left.
  local still, retry = used, nil
  for i = first, n do
    local at, cost = entry(i)
    still = still - cost
    if still + COST <= LIMIT then
      retry = dsum(at - NOW, W, 0)
      break
    end
  end
  if retry == nil then corrupt('log cannot admit a cost within the limit') end
  result = reply(0, left, retry)
end

-- Forgettable once empty, or when the newest entry is W old.
local kept = last - first + 1
local ttl = 0
if kept > 0 or tail ~= '' then
  local newest_kept = now
  if tail == '' then newest_kept = entry(last) end
  ttl = ttl_after(newest_kept - NOW, W)
end
local px = keep_for(existed, ttl)
if px then
  local body = ''
  if kept > 0 then body = string.sub(s, 9 + (first - 1) * 16, 8 + last * 16) end
  redis.call('SET', key, struct.pack('>d', used) .. body .. tail, 'PX', px)
end
return result
