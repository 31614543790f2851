
local cost, tokens, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local hour = ARGV[4]
local n = (#KEYS - 3) / 6
local marked = redis.call('EXISTS', KEYS[#KEYS - 1])
local function num(k) return tonumber(redis.call('GET', k) or '0') end
local used = {}
for i = 1, n do
  local k, a = 6 * i - 4, 4 * i + 1
  used[2 * i - 1] = math.max(num(KEYS[k]), tonumber(ARGV[a + 2]))
    + num(KEYS[k + 2]) + num(KEYS[k + 4])
  used[2 * i] = math.max(num(KEYS[k + 1]), tonumber(ARGV[a + 3]))
    + num(KEYS[k + 3]) + num(KEYS[k + 5])
end
local function reply(admitted, refused, limited)
  local r = {admitted, refused, limited}
  for i = 1, 2 * n do r[3 + i] = used[i] end
  r[4 + 2 * n] = marked
  return r
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return reply(1, 0, 0)
end
-- the ledger marked the key once its bill was whole: a mark the caller saw before and
-- that is gone now went with the rest of Redis's data, before any ledger held the key
if marked == 0 and ARGV[#ARGV - 1] == '1' then
  return reply(0, 0, 3)
end
-- a ledger rebuilding the key's spend after Redis lost its data: nothing is admitted
-- until its hold ends (the lease of a ledger that stopped ends on its own)
local holds = redis.call('HVALS', KEYS[#KEYS])
if #holds > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  for i = 1, #holds do
    if tonumber(holds[i]) > now then return reply(0, 0, 3) end
  end
end
for i = 1, n do
  local a = 4 * i + 1
  local ls, lt = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  if ls > 0 and used[2 * i - 1] + cost > ls then return reply(0, i, 1) end
  if lt > 0 and used[2 * i] + tokens > lt then return reply(0, i, 2) end
end
for i = 1, n do
  local k = 6 * i - 4
  used[2 * i - 1] = used[2 * i - 1] + cost
  used[2 * i] = used[2 * i] + tokens
  -- the ARGV strings, not the Lua numbers: Redis writes a number as %.17g, and INCRBY
  -- refuses 1e+17 (a cost of 1e8 currency units); the strings are the exact int64
  redis.call('INCRBY', KEYS[k + 2], ARGV[1])
  redis.call('INCRBY', KEYS[k + 3], ARGV[2])
  redis.call('EXPIRE', KEYS[k + 2], ttl)
  redis.call('EXPIRE', KEYS[k + 3], ttl)
end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[2] .. ' ' .. hour .. ARGV[#ARGV], 'EX', ttl)
return reply(1, 0, 0)
