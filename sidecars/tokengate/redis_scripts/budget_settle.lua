
local cost, tokens, sttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local hour = tonumber(ARGV[4])
local r = redis.call('GET', KEYS[1])
if r == 'settled' then return {0, 0} end
if ARGV[5] ~= '' and r ~= ARGV[5] then return {0, 0} end
-- amounts stay strings (ARGV's, the record's): Redis writes a Lua number as %.17g, which
-- INCRBY refuses from 1e17 on; the strings are the exact int64
local rc, rt, at = '0', '0', nil
if r then
  local c, t, h = string.match(r, '^(%d+) (%d+) (%d+)')
  rc, rt = c, t
  if tonumber(h) == hour then at = 2 elseif tonumber(h) == hour - 1 then at = 4 end
end
redis.call('SET', KEYS[1], 'settled', 'EX', sttl)
for i = 1, (#KEYS - 1) / 6 do
  local k = 6 * i - 4
  local ttl = tonumber(ARGV[5 + i])
  if cost ~= 0 then redis.call('INCRBY', KEYS[k], ARGV[1]) end
  if tokens ~= 0 then redis.call('INCRBY', KEYS[k + 1], ARGV[2]) end
  redis.call('EXPIRE', KEYS[k], ttl)
  redis.call('EXPIRE', KEYS[k + 1], ttl)
  -- its bucket, while it is kept (an expired one is not made again, negative)
  if at and redis.call('EXISTS', KEYS[k + at]) == 1 then
    redis.call('DECRBY', KEYS[k + at], rc)
    redis.call('DECRBY', KEYS[k + at + 1], rt)
  end
end
return {1, r and 1 or 0}
