-- sliding-log, ported from crates/core/src/policy/sliding_log.rs.
-- State (string): 8 bytes `used` (the sum of the entries' costs), then one
-- 16-byte entry (at_ms, cost) per millisecond with admitted cost, oldest
-- first; all big-endian doubles holding integers below 2^53.
local s = redis.call('GET', KEYS[1])
local used, n = 0, 0
if s then
  local len = #s
  if len < 8 or fmod(len - 8, 16) ~= 0 then lib().corrupt('log has a bad length ' .. len) end
  used = struct.unpack('>d', s, 1)
  -- NaN fails every comparison, so it is caught too.
  if not (used >= 0 and used < TWO53 and used % 1 == 0) then lib().bad('used', used) end
  n = (len - 8) / 16
end

local function entry(i)
  local at, cost = struct.unpack('>dd', s, 9 + (i - 1) * 16)
  if not (at >= 0 and at < TWO53 and at % 1 == 0) then lib().bad('at_ms', at) end
  if not (cost >= 0 and cost < TWO53 and cost % 1 == 0) then lib().bad('cost', cost) end
  return at, cost
end

-- Clock regression: decided at the newest entry's time, so entries can
-- neither be re-counted nor appended out of order.
local newest = 0
if n > 0 then newest = entry(n) end
local now = NOW
if newest > now then now = newest end
-- An entry made at `at` covers at ..= at + W - 1; `first` is the oldest kept.
local first = 1
while first <= n do
  local at, cost = entry(first)
  if now - at < W then break end
  if cost > used then lib().corrupt('log entries exceed used') end
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
  result = { 1, left - COST, 1, 0 }
elseif COST > LIMIT then
  result = { 0, left, 0 }
else
  -- The oldest entries leave first; the request fits once enough of them
  -- have left.
  local X = lib()
  local still, retry = used, nil
  for i = first, n do
    local at, cost = entry(i)
    still = still - cost
    if still + COST <= LIMIT then
      retry = X.dsum(at - NOW, W, 0)
      break
    end
  end
  if retry == nil then X.corrupt('log cannot admit a cost within the limit') end
  result = X.reply(0, left, retry)
end

-- Forgettable once empty, or when the newest entry is W old.
local kept = last - first + 1
local ttl = 0
if kept > 0 or tail ~= '' then
  local newest_kept = now
  if tail == '' then newest_kept = entry(last) end
  -- newest_kept - NOW + W, at least 0: both terms below 2^53, so exact
  -- below 2^53 and capped to MAX_TTL otherwise.
  ttl = newest_kept - NOW + W
  if ttl < 0 then ttl = 0 elseif ttl > MAX_TTL then ttl = MAX_TTL end
end
if ttl <= 0 and GRACE == 0 then
  if s then redis.call('DEL', KEYS[1]) end
else
  local body = ''
  if kept > 0 then body = string.sub(s, 9 + (first - 1) * 16, 8 + last * 16) end
  redis.call('SET', KEYS[1], struct.pack('>d', used) .. body .. tail, 'PX', string.format('%.0f', ttl + GRACE))
end
return result
