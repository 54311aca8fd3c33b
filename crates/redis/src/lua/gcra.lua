-- gcra, ported from crates/core/src/policy/gcra.rs.
-- State (hash): a = the theoretical arrival time scaled by limit (units of
-- ms x limit; plain or limbs).
local key = KEYS[1]
local v = redis.call('HGET', key, 'a')
local existed = v ~= false
local result, tat_out, ttl

local cap = BURST * W
local now_scaled = NOW * LIMIT
if cap < TWO53 and now_scaled < TWO53 - cap and (not existed or not string.find(v, ',', 1, true)) then
  -- Fast path: while now * limit + capacity stays below 2^53, every admitted
  -- tat does too.
  local tat = 0
  if existed then tat = int_field(v, 'a') end
  local base = math.max(tat, now_scaled)
  local spent = base - now_scaled
  local need = COST * W
  if spent + need <= cap then
    tat = base + need
    local room = cap - spent - need
    result = reply(1, (room - fmod(room, W)) / W, 0)
  else
    local room = 0
    if cap > spent then room = cap - spent end
    local retry = nil
    if COST <= BURST and LIMIT > 0 then
      local over = (spent - cap) + need
      retry = (over - fmod(over, LIMIT)) / LIMIT
      if fmod(over, LIMIT) > 0 then retry = retry + 1 end
    end
    result = reply(0, (room - fmod(room, W)) / W, retry)
  end
  tat_out = tat
  if tat <= now_scaled then
    ttl = 0
  elseif LIMIT == 0 then
    ttl = MAX_TTL
  else
    local at = (tat - fmod(tat, LIMIT)) / LIMIT
    if fmod(tat, LIMIT) > 0 then at = at + 1 end
    ttl = ttl_after(at - NOW, 0)
  end
else
  local X = widelib()
  local wide, wfits, wnum, wcmp, wadd, wsub = X.wide, X.wfits, X.wnum, X.wcmp, X.wadd, X.wsub
  local wmul, wdivmod, wdivceil, wstore, wload = X.wmul, X.wdivmod, X.wdivceil, X.wstore, X.wload
  local wcap = wmul(wide(BURST), wide(W))
  local wnow = wmul(wide(NOW), wide(LIMIT))
  local tat = {}
  if existed then tat = wload(v, 'a') end
  local base = tat
  if wcmp(wnow, tat) > 0 then base = wnow end
  local spent = wsub(base, wnow)
  local need = wmul(wide(COST), wide(W))
  local total = wadd(spent, need)
  if wcmp(total, wcap) <= 0 then
    tat = wadd(base, need)
    result = reply(1, wnum((wdivmod(wsub(wcap, total), W))), 0)
  else
    local room = {}
    if wcmp(wcap, spent) > 0 then room = wsub(wcap, spent) end
    local retry = nil
    if COST <= BURST and LIMIT > 0 then
      retry = wdivceil(wsub(total, wcap), LIMIT)
      if wfits(retry) then retry = wnum(retry) end
    end
    result = reply(0, wnum((wdivmod(room, W))), retry)
  end
  tat_out = wstore(tat)
  if wcmp(tat, wnow) <= 0 then
    ttl = 0
  elseif LIMIT == 0 then
    ttl = MAX_TTL
  else
    local at = wdivceil(tat, LIMIT)
    if wfits(at) then ttl = ttl_after(wnum(at) - NOW, 0) else ttl = MAX_TTL end
  end
end
local px = keep_for(existed, ttl)
if px then
  redis.call('HSET', key, 'a', tat_out)
  redis.call('PEXPIRE', key, px)
end
return result
