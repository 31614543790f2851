
local z, h, rid = KEYS[1], KEYS[2], ARGV[1]
local rpm, tpm, tokens, window = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
  tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window

local sum = tonumber(redis.call('HGET', h, '#sum') or '0')
local old = redis.call('ZRANGEBYSCORE', z, '-inf', cutoff)
if #old > 0 then
  for i = 1, #old, 1000 do
    local part = {}
    for j = i, math.min(i + 999, #old) do part[#part + 1] = old[j] end
    local vals = redis.call('HMGET', h, unpack(part))
    for j = 1, #vals do sum = sum - (tonumber(vals[j]) or 0) end
    redis.call('HDEL', h, unpack(part))
  end
  redis.call('ZREMRANGEBYSCORE', z, '-inf', cutoff)
  if sum < 0 then sum = 0 end
  redis.call('HSET', h, '#sum', sum)
end

local count = redis.call('ZCARD', z)
local function reset_ms()
  if count == 0 then return 0 end
  local newest = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  return math.max(0, tonumber(newest[2]) + window - now)
end
local function reply(admitted, limited, never, retry)
  local r = reset_ms()
  local rt = r
  if sum <= 0 then rt = 0 end
  return {admitted, limited, never, math.max(0, rpm - count), math.max(0, tpm - sum),
          r, rt, retry}
end

if redis.call('HEXISTS', h, rid) == 1 then
  return reply(1, 0, 0, 0)
end
if tokens > tpm then
  return reply(0, 2, 1, 0)
end
if count + 1 > rpm then
  local oldest = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
  return reply(0, 1, 0, math.max(1, tonumber(oldest[2]) + window - now))
end
if sum + tokens > tpm then
  -- walk from the oldest entry until enough tokens would have left the window
  local need, freed, start = sum + tokens - tpm, 0, 0
  while true do
    local part = redis.call('ZRANGE', z, start, start + 99, 'WITHSCORES')
    if #part == 0 then break end
    local ids = {}
    for j = 1, #part, 2 do ids[#ids + 1] = part[j] end
    local vals = redis.call('HMGET', h, unpack(ids))
    for j = 1, #ids do
      freed = freed + (tonumber(vals[j]) or 0)
      if freed >= need then
        return reply(0, 2, 0, math.max(1, tonumber(part[2 * j]) + window - now))
      end
    end
    start = start + 100
  end
  return reply(0, 2, 0, window)
end

redis.call('ZADD', z, now, rid)
sum = sum + tokens
redis.call('HSET', h, rid, tokens, '#sum', sum)
redis.call('PEXPIRE', z, window + 1000)
redis.call('PEXPIRE', h, window + 1000)
count = count + 1
return reply(1, 0, 0, 0)
