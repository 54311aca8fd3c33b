-- token-bucket, ported from crates/core/src/policy/token_bucket.rs.
-- State: 8 bytes t, when the level was last refilled; then the level l
-- (tokens * window_ms, at most burst * W): 8 bytes below 2^53, else its
-- base-2^24 limbs, 8 bytes each (only when burst * W passes 2^53).
local BURST = tonumber(ARGV[3])
local s = redis.call('GET', KEYS[1])
local last
if s then
  if #s < 16 then lib().corrupt('state has a bad length ' .. #s) end
  last = struct.unpack('>d', s)
  -- NaN fails every comparison, so it is caught too.
  if not (last >= 0 and last < TWO53 and last % 1 == 0) then lib().bad('last refill', last) end
else
  last = NOW
end

-- Clock regression: decided at the last refill, so a clock that steps back
-- never refills the bucket twice.
local now = NOW
if last > now then now = last end
local idle = now - last
local result, value, ttl

local cap = BURST * W
if cap < TWO53 then
  -- Fast path: every level fits a double. A refill or need that rounds
  -- lies above the capacity anyway, and min/compare keep them exact.
  local level = cap
  if s then
    if #s ~= 16 then lib().corrupt('state has a bad length ' .. #s) end
    level = struct.unpack('>d', s, 9)
    if not (level >= 0 and level < TWO53 and level % 1 == 0) then lib().bad('level', level) end
  end
  if level < cap then
    local refill = idle * LIMIT
    if refill >= cap - level then level = cap else level = level + refill end
  else
    level = cap
  end
  local need = COST * W
  if level >= need then
    level = level - need
    result = { 1, (level - fmod(level, W)) / W, 1, 0 }
  else
    local retry = nil
    if COST <= BURST and LIMIT > 0 then
      local short = need - level
      local wait = (short - fmod(short, LIMIT)) / LIMIT
      if fmod(short, LIMIT) > 0 then wait = wait + 1 end
      retry = lib().dsum(0, wait, now - NOW)
    end
    result = lib().reply(0, (level - fmod(level, W)) / W, retry)
  end
  value = struct.pack('>dd', now, level)
  if level >= cap then
    -- Full, and forgettable once the caller's clock reaches the last
    -- refill (at once unless this request stepped back).
    ttl = now - NOW
    if ttl > MAX_TTL then ttl = MAX_TTL end
  elseif LIMIT == 0 then
    ttl = MAX_TTL
  else
    -- Forgettable once refilled to full: now - NOW + the wait, both below
    -- 2^53, so exact below 2^53 and capped to MAX_TTL otherwise.
    local short = cap - level
    local wait = (short - fmod(short, LIMIT)) / LIMIT
    if fmod(short, LIMIT) > 0 then wait = wait + 1 end
    ttl = now - NOW + wait
    if ttl > MAX_TTL then ttl = MAX_TTL end
  end
else
  -- Wide path: the level needs more than 53 bits.
  local X = lib()
  local Y = X.widelib()
  local wide, wfits, wnum, wcmp, wadd, wsub = Y.wide, Y.wfits, Y.wnum, Y.wcmp, Y.wadd, Y.wsub
  local wmul, wdivmod, wdivceil = Y.wmul, Y.wdivmod, Y.wdivceil
  local wcap = wmul(wide(BURST), wide(W))
  local level = wcap
  if s then level = Y.wunpack(s, 9, 'level') end
  level = wadd(level, wmul(wide(idle), wide(LIMIT)))
  if wcmp(level, wcap) > 0 then level = wcap end
  local need = wmul(wide(COST), wide(W))
  if wcmp(level, need) >= 0 then
    level = wsub(level, need)
    result = X.reply(1, wnum((wdivmod(level, W))), 0)
  else
    local retry = nil
    if COST <= BURST and LIMIT > 0 then
      retry = wadd(wdivceil(wsub(need, level), LIMIT), wide(now - NOW))
      if wfits(retry) then retry = wnum(retry) end
    end
    result = X.reply(0, wnum((wdivmod(level, W))), retry)
  end
  value = struct.pack('>d', now) .. Y.wpack(level)
  if wcmp(level, wcap) >= 0 then
    ttl = now - NOW
    if ttl > MAX_TTL then ttl = MAX_TTL end
  elseif LIMIT == 0 then
    ttl = MAX_TTL
  else
    local wait = wdivceil(wsub(wcap, level), LIMIT)
    if wfits(wait) then ttl = X.ttl_after(now - NOW, wnum(wait)) else ttl = MAX_TTL end
  end
end
-- The level is refilled (and last moved) on every request, as in the core.
if ttl <= 0 and GRACE == 0 then
  if s then redis.call('DEL', KEYS[1]) end
else
  if ttl < 0 then ttl = 0 end
  redis.call('SET', KEYS[1], value, 'PX', string.format('%.0f', ttl + GRACE))
end
return result
