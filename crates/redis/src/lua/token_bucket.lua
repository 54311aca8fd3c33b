-- token-bucket, ported from crates/core/src/policy/token_bucket.rs.
-- State (hash): l = level (tokens * window_ms, at most burst * W; plain or
-- limbs), t = when the level was last refilled.
local key = KEYS[1]
local v = redis.call('HMGET', key, 'l', 't')
local existed = v[1] ~= false or v[2] ~= false
local last
if existed then
  if v[1] == false then corrupt('field l is missing') end
  last = int_field(v[2], 't')
else
  last = NOW
end

-- Clock regression: decided at the last refill, so a clock that steps back
-- never refills the bucket twice.
local now = math.max(NOW, last)
local idle = now - last
local result, level_out, ttl

local cap = BURST * W
if cap < TWO53 then
  -- Fast path: every level fits a double. A refill or need that rounds
  -- lies above the capacity anyway, and min/compare keep them exact.
  local level = cap
  if existed then level = int_field(v[1], 'l') end
  if level < cap then
    local refill = idle * LIMIT
    if refill >= cap - level then level = cap else level = level + refill end
  else
    level = cap
  end
  local need = COST * W
  if level >= need then
    level = level - need
    result = reply(1, (level - fmod(level, W)) / W, 0)
  else
    local retry = nil
    if COST <= BURST and LIMIT > 0 then
      local short = need - level
      local wait = (short - fmod(short, LIMIT)) / LIMIT
      if fmod(short, LIMIT) > 0 then wait = wait + 1 end
      retry = dsum(0, wait, now - NOW)
    end
    result = reply(0, (level - fmod(level, W)) / W, retry)
  end
  level_out = level
  if level >= cap then
    ttl = 0
  elseif LIMIT == 0 then
    ttl = MAX_TTL
  else
    local short = cap - level
    local wait = (short - fmod(short, LIMIT)) / LIMIT
    if fmod(short, LIMIT) > 0 then wait = wait + 1 end
    ttl = ttl_after(now - NOW, wait)
  end
else
  -- Wide path: the level needs more than 53 bits.
  local X = widelib()
  local wide, wfits, wnum, wcmp, wadd, wsub = X.wide, X.wfits, X.wnum, X.wcmp, X.wadd, X.wsub
  local wmul, wdivmod, wdivceil, wstore, wload = X.wmul, X.wdivmod, X.wdivceil, X.wstore, X.wload
  local wcap = wmul(wide(BURST), wide(W))
  local level = wcap
  if existed then level = wload(v[1], 'l') end
  level = wadd(level, wmul(wide(idle), wide(LIMIT)))
  if wcmp(level, wcap) > 0 then level = wcap end
  local need = wmul(wide(COST), wide(W))
  if wcmp(level, need) >= 0 then
    level = wsub(level, need)
    result = reply(1, wnum((wdivmod(level, W))), 0)
  else
    local retry = nil
    if COST <= BURST and LIMIT > 0 then
      retry = wadd(wdivceil(wsub(need, level), LIMIT), wide(now - NOW))
      if wfits(retry) then retry = wnum(retry) end
    end
    result = reply(0, wnum((wdivmod(level, W))), retry)
  end
  level_out = wstore(level)
  if wcmp(level, wcap) >= 0 then
    ttl = 0
  elseif LIMIT == 0 then
    ttl = MAX_TTL
  else
    local wait = wdivceil(wsub(wcap, level), LIMIT)
    if wfits(wait) then ttl = ttl_after(now - NOW, wnum(wait)) else ttl = MAX_TTL end
  end
end
-- The level is refilled (and last moved) on every request, as in the core.
local px = keep_for(existed, ttl)
if px then
  redis.call('HSET', key, 'l', level_out, 't', now)
  redis.call('PEXPIRE', key, px)
end
return result
