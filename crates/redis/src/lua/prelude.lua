-- Shared text prepended to every policy script when it is loaded.
--
-- Lua numbers are doubles: integers are exact only below 2^53, and the
-- policies' products (previous * (W - elapsed), now * limit, cost * W) go
-- far past that. Small values stay plain numbers (the fast path); a value
-- that may not fit is a "wide" number: a table of base-2^24 limbs, least
-- significant first, with no zero limb on top ({} is zero). A product of
-- two limbs plus two more limbs stays below 2^49, so every step below is
-- exact in doubles.
--
-- Every EVALSHA runs the whole script again, this text included, and
-- every `local function` allocates a closure each time it runs. So the
-- policies write their fast path inline, and everything else (corrupt-
-- state errors, retry times, exact arithmetic past 2^53) is built by
-- `lib()` only when a request needs it.
--
-- State: one Redis string per key, big-endian doubles holding integers
-- below 2^53 (struct.pack '>d'), read with one GET and written with one
-- SET ... PX: two Redis calls per request, each of which costs more than
-- the arithmetic. Each policy ends the same way: an already forgettable
-- key with no grace is deleted; any other is written with a PX of the ms
-- until forgetting it can change no decision, plus the grace (at least 1,
-- as a PX must be). That PX is passed as a decimal string
-- (string.format '%.0f', exact for integers below 2^53), not as a Lua
-- number: Redis 7.2.0 to 7.2.4 write a number argument with fpconv_dtoa,
-- which puts a whole number with trailing zeros in exponent form (10^8
-- becomes '1e+08'), and SET refuses such a PX (redis/redis#13113).
--
-- Arguments of every script: KEYS[1] the key; ARGV = limit, window_ms,
-- burst, cost, now_ms ('' reads Redis TIME), grace_ms, max_ttl_ms.
-- Reply: {allowed, remaining, retry_kind, retry...} where retry_kind is
-- 0 (never), 1 (one plain number follows) or 2 (limbs follow).

local TWO53 = 9007199254740992
local fmod = math.fmod
local LIMIT = tonumber(ARGV[1])
local W = tonumber(ARGV[2])
local COST = tonumber(ARGV[4])
local NOW = ARGV[5]
if NOW == '' then
  -- One clock for the whole fleet: the Redis server's.
  local t = redis.call('TIME')
  local us = tonumber(t[2])
  NOW = tonumber(t[1]) * 1000 + (us - us % 1000) / 1000
else
  NOW = tonumber(NOW)
end
-- No grace is the usual case: a string comparison, not a parse.
local GRACE = 0
if ARGV[6] ~= '0' then GRACE = tonumber(ARGV[6]) end
local MAX_TTL = tonumber(ARGV[7])

-- The slow path's helpers, built on first use in a call.
local L
local function lib()
  if L then return L end
  local B = 16777216

  local function corrupt(what)
    error({ err = 'RATEWARDEN_CORRUPT ' .. what .. ' under key ' .. KEYS[1] })
  end

  -- The error for a stored number that is not an integer in 0 .. 2^53 - 1.
  local function bad(name, v)
    corrupt('field ' .. name .. ' is not an integer in 0..2^53-1 (' .. tostring(v) .. ')')
  end

  -- The wide-number helpers, built only when a value passes 2^53.
  local W_
  local function widelib()
    if W_ then return W_ end
    -- A plain number (0 <= n < 2^53) as a wide number.
    local function wide(n)
      local a, i = {}, 0
      while n > 0 do
        local r = fmod(n, B)
        i = i + 1
        a[i] = r
        n = (n - r) / B
      end
      return a
    end

    -- Whether a wide number is below 2^53 (then wnum is exact).
    local function wfits(a)
      return #a <= 2 or (#a == 3 and a[3] < 32)
    end

    local function wnum(a)
      local n = 0
      for i = #a, 1, -1 do n = n * B + a[i] end
      return n
    end

    local function wtrim(a)
      local i = #a
      while i > 0 and a[i] == 0 do a[i] = nil; i = i - 1 end
      return a
    end

    local function wcmp(a, b)
      if #a ~= #b then return (#a < #b) and -1 or 1 end
      for i = #a, 1, -1 do
        if a[i] ~= b[i] then return (a[i] < b[i]) and -1 or 1 end
      end
      return 0
    end

    local function wadd(a, b)
      local c, carry = {}, 0
      local n = math.max(#a, #b)
      for i = 1, n do
        local s = (a[i] or 0) + (b[i] or 0) + carry
        if s >= B then c[i] = s - B; carry = 1 else c[i] = s; carry = 0 end
      end
      if carry > 0 then c[n + 1] = carry end
      return c
    end

    -- a - b for a >= b.
    local function wsub(a, b)
      local c, borrow = {}, 0
      for i = 1, #a do
        local s = a[i] - (b[i] or 0) - borrow
        if s < 0 then c[i] = s + B; borrow = 1 else c[i] = s; borrow = 0 end
      end
      return wtrim(c)
    end

    local function wmul(a, b)
      local na, nb = #a, #b
      if na == 0 or nb == 0 then return {} end
      local c = {}
      for i = 1, na + nb do c[i] = 0 end
      for i = 1, na do
        local carry, ai = 0, a[i]
        for j = 1, nb do
          -- At most (B-1) + (B-1)^2 + (B-1) = B^2 - 1: exact, and carry < B.
          local t = c[i + j - 1] + ai * b[j] + carry
          local r = fmod(t, B)
          c[i + j - 1] = r
          carry = (t - r) / B
        end
        c[i + nb] = carry
      end
      return wtrim(c)
    end

    -- floor(a / d) and a mod d for a plain divisor 1 <= d < 2^53. With a small
    -- divisor a limb at a time; otherwise bit by bit, written so that the
    -- remainder r < d never doubles past 2^53: 2r + bit >= d is tested as
    -- r + bit >= d - r.
    local function wdivmod(a, d)
      local q, r = {}, 0
      if d < 536870912 then
        for i = #a, 1, -1 do
          local t = r * B + a[i]
          r = fmod(t, d)
          q[i] = (t - r) / d
        end
        return wtrim(q), r
      end
      for i = #a, 1, -1 do
        local limb, ql, p = a[i], 0, 8388608
        for _ = 23, 0, -1 do
          local bit = 0
          if limb >= p then bit = 1; limb = limb - p end
          local t = d - r
          if r + bit >= t then
            r = r + bit - t
            ql = ql + ql + 1
          else
            r = r + r + bit
            ql = ql + ql
          end
          p = p / 2
        end
        q[i] = ql
      end
      return wtrim(q), r
    end

    local function wdivceil(a, d)
      local q, r = wdivmod(a, d)
      if r > 0 then q = wadd(q, { 1 }) end
      return q
    end

    -- A wide number as stored: one double below 2^53, else its limbs,
    -- one double each.
    local function wpack(a)
      if wfits(a) then return struct.pack('>d', wnum(a)) end
      local parts = {}
      for i = 1, #a do parts[i] = struct.pack('>d', a[i]) end
      return table.concat(parts)
    end

    -- The wide number stored in s from byte `at` to its end: 8 bytes for a
    -- plain number, 3 to 6 limbs (8 bytes each) past 2^53.
    local function wunpack(s, at, name)
      local n = (#s - at + 1) / 8
      if n == 1 then
        local v = struct.unpack('>d', s, at)
        if not (v >= 0 and v < TWO53 and v % 1 == 0) then bad(name, v) end
        return wide(v)
      end
      if n % 1 ~= 0 or n < 3 or n > 6 then
        corrupt('field ' .. name .. ' takes ' .. (#s - at + 1) .. ' bytes, not 8 or 24 to 48')
      end
      local a = {}
      for i = 1, n do
        local limb = struct.unpack('>d', s, at + (i - 1) * 8)
        if not (limb >= 0 and limb < B and limb % 1 == 0) then
          corrupt('field ' .. name .. ' has a bad limb (' .. tostring(limb) .. ')')
        end
        a[i] = limb
      end
      if a[n] == 0 or wfits(a) then corrupt('field ' .. name .. ' is malformed') end
      return a
    end
    W_ = {
      wide = wide, wfits = wfits, wnum = wnum, wcmp = wcmp, wadd = wadd, wsub = wsub,
      wmul = wmul, wdivmod = wdivmod, wdivceil = wdivceil, wpack = wpack, wunpack = wunpack,
    }
    return W_
  end

  -- floor(a * b / c) for plain a, b, c when the quotient is below 2^53.
  local function muldiv(a, b, c)
    local p = a * b
    if p < TWO53 then return (p - fmod(p, c)) / c end
    local X = widelib()
    local q = X.wdivmod(X.wmul(X.wide(a), X.wide(b)), c)
    return X.wnum(q)
  end

  -- d + x + y as a plain number or a wide one, for plain d in (-2^53, 2^53)
  -- and x, y in [0, 2^53); never below 0.
  local function dsum(d, x, y)
    if d < 0 then
      local s = x + d
      if s < 0 then
        s = s + y
        if s < 0 then return 0 end
        return s
      end
      d, x = s, 0
    end
    if d + x + y < TWO53 then return d + x + y end
    local X = widelib()
    return X.wadd(X.wadd(X.wide(d), X.wide(x)), X.wide(y))
  end

  -- The TTL for a key forgettable at `d + x` ms from now (x >= 0), capped.
  local function ttl_after(d, x)
    local t = dsum(d, x, 0)
    if type(t) == 'table' or t > MAX_TTL then return MAX_TTL end
    return t
  end

  local function reply(allowed, remaining, retry)
    if retry == nil then return { allowed, remaining, 0 } end
    if type(retry) == 'number' then return { allowed, remaining, 1, retry } end
    local r = { allowed, remaining, 2 }
    for i = 1, #retry do r[3 + i] = retry[i] end
    return r
  end

  L = {
    corrupt = corrupt, bad = bad, widelib = widelib, muldiv = muldiv, dsum = dsum,
    ttl_after = ttl_after, reply = reply,
  }
  return L
end
