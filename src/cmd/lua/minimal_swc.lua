-- The baseline of the Redis benchmark: a minimal sliding-window counter in
-- a dozen lines, as commonly written (floating point, no clock-regression
-- rule, no retry time, no exactness past 2^53). Not used for decisions.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local start = now - now % window
local s = redis.call('HMGET', KEYS[1], 'w', 'p', 'c')
local w, p, c = tonumber(s[1]) or start, tonumber(s[2]) or 0, tonumber(s[3]) or 0
if w ~= start then if w == start - window then p = c else p = 0 end; c = 0 end
if c + p * (window - (now - start)) / window + 1 > limit then return 0 end
redis.call('HSET', KEYS[1], 'w', start, 'p', p, 'c', c + 1)
redis.call('PEXPIRE', KEYS[1], window * 2)
return 1
