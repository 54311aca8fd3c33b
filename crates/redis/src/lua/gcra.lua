-- gcra, ported from crates/core/src/policy/gcra.rs.
-- State: a, the theoretical arrival time scaled by limit (units of ms x
-- limit): 8 bytes below 2^53, else its base-2^24 limbs, 8 bytes each.
local BURST = tonumber(ARGV[3])
local s = redis.call('GET', KEYS[1])
local result, value, ttl

local cap = BURST * W
local now_scaled = NOW * LIMIT
if cap < TWO53 and now_scaled < TWO53 - cap and (not s or #s == 8) then
  -- Fast path: while now * limit + capacity stays below 2^53, every admitted
  -- tat does too.
  local tat = 0
  if s then
    tat = struct.unpack('>d', s)
    -- NaN fails every comparison, so it is caught too.
    if not (tat >= 0 and tat < TWO53 and tat % 1 == 0) then lib().bad('theoretical arrival time', tat) end
  end
  local base = tat
  if now_scaled > base then base = now_scaled end
  local spent = base - now_scaled
  local need = COST * W
  if spent + need <= cap then
    tat = base + need
    local room = cap - spent - need
    result = { 1, (room - fmod(room, W)) / W, 1, 0 }
  else
    local room = 0
    if cap > spent then room = cap - spent end
    local retry = nil
    if COST <= BURST and LIMIT > 0 then
      local over = (spent - cap) + need
      retry = (over - fmod(over, LIMIT)) / LIMIT
      if fmod(over, LIMIT) > 0 then retry = retry + 1 end
    end
    result = lib().reply(0, (room - fmod(room, W)) / W, retry)
  end
  value = struct.pack('>d', tat)
  if tat <= now_scaled then
    ttl = 0
  elseif LIMIT == 0 then
    ttl = MAX_TTL
  else
    -- Forgettable once tat <= now x limit: at ceil(tat / limit) - NOW ms,
    -- both terms below 2^53, so exact.
    local at = (tat - fmod(tat, LIMIT)) / LIMIT
    if fmod(tat, LIMIT) > 0 then at = at + 1 end
    ttl = at - NOW
    if ttl < 0 then ttl = 0 elseif ttl > MAX_TTL then ttl = MAX_TTL end
  end
else
  local X = lib()
  local Y = X.widelib()
  local wide, wfits, wnum, wcmp, wadd, wsub = Y.wide, Y.wfits, Y.wnum, Y.wcmp, Y.wadd, Y.wsub
  local wmul, wdivmod, wdivceil = Y.wmul, Y.wdivmod, Y.wdivceil
  local wcap = wmul(wide(BURST), wide(W))
  local wnow = wmul(wide(NOW), wide(LIMIT))
  local tat = {}
  if s then tat = Y.wunpack(s, 1, 'theoretical arrival time') end
  local base = tat
  if wcmp(wnow, tat) > 0 then base = wnow end
  local spent = wsub(base, wnow)
  local need = wmul(wide(COST), wide(W))
  local total = wadd(spent, need)
  if wcmp(total, wcap) <= 0 then
    tat = wadd(base, need)
    result = X.reply(1, wnum((wdivmod(wsub(wcap, total), W))), 0)
  else
    local room = {}
    if wcmp(wcap, spent) > 0 then room = wsub(wcap, spent) end
    local retry = nil
    if COST <= BURST and LIMIT > 0 then
      retry = wdivceil(wsub(total, wcap), LIMIT)
      if wfits(retry) then retry = wnum(retry) end
    end
    result = X.reply(0, wnum((wdivmod(room, W))), retry)
  end
  value = Y.wpack(tat)
  if wcmp(tat, wnow) <= 0 then
    ttl = 0
  elseif LIMIT == 0 then
    ttl = MAX_TTL
  else
    local at = wdivceil(tat, LIMIT)
    if wfits(at) then ttl = X.ttl_after(wnum(at) - NOW, 0) else ttl = MAX_TTL end
  end
end
if ttl <= 0 and GRACE == 0 then
  if s then redis.call('DEL', KEYS[1]) end
else
  if ttl < 0 then ttl = 0 end
  redis.call('SET', KEYS[1], value, 'PX', string.format('%.0f', ttl + GRACE))
end
return result
