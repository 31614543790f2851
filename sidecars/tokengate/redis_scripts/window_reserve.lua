
-- KEYS: per window its zset and hash (the key's window first, then its levels').
-- ARGV: request_id, tokens, window_ms, then per window rpm, tpm.
local rid, tokens, window = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local n = #KEYS / 2
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cutoff = now - window

-- every window drops its entries older than the window first
local sums, counts = {}, {}
for w = 1, n do
  local z, h = KEYS[2 * w - 1], KEYS[2 * w]
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
  sums[w], counts[w] = sum, redis.call('ZCARD', z)
end

local function limits(w)
  return tonumber(ARGV[2 + 2 * w]), tonumber(ARGV[3 + 2 * w])
end
local function reset_ms(w)
  if counts[w] == 0 then return 0 end
  local newest = redis.call('ZRANGE', KEYS[2 * w - 1], -1, -1, 'WITHSCORES')
  return math.max(0, tonumber(newest[2]) + window - now)
end
-- the answer in window w's numbers; its last field says which window (0: the key's)
local function reply(w, admitted, limited, never, retry)
  local rpm, tpm = limits(w)
  local r = reset_ms(w)
  local rt = r
  if sums[w] <= 0 then rt = 0 end
  return {admitted, limited, never, math.max(0, rpm - counts[w]), math.max(0, tpm - sums[w]),
          r, rt, retry, w - 1}
end
-- tightest() -> the window with the fewest tokens left
local function tightest()
  local best, left = 1, nil
  for w = 1, n do
    local _, tpm = limits(w)
    if left == nil or tpm - sums[w] < left then best, left = w, tpm - sums[w] end
  end
  return best
end

if redis.call('HEXISTS', KEYS[2], rid) == 1 then
  return reply(tightest(), 1, 0, 0, 0)
end
for w = 1, n do
  local z, h = KEYS[2 * w - 1], KEYS[2 * w]
  local rpm, tpm = limits(w)
  local sum = sums[w]
  if tokens > tpm then
    return reply(w, 0, 2, 1, 0)
  end
  if counts[w] + 1 > rpm then
    local oldest = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
    return reply(w, 0, 1, 0, math.max(1, tonumber(oldest[2]) + window - now))
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
          return reply(w, 0, 2, 0, math.max(1, tonumber(part[2 * j]) + window - now))
        end
      end
      start = start + 100
    end
    return reply(w, 0, 2, 0, window)
  end
end

-- every window admits: the reservation is recorded in all of them
for w = 1, n do
  local z, h = KEYS[2 * w - 1], KEYS[2 * w]
  redis.call('ZADD', z, now, rid)
  sums[w] = sums[w] + tokens
  redis.call('HSET', h, rid, tokens, '#sum', sums[w])
  redis.call('PEXPIRE', z, window + 1000)
  redis.call('PEXPIRE', h, window + 1000)
  counts[w] = counts[w] + 1
end
return reply(tightest(), 1, 0, 0, 0)
