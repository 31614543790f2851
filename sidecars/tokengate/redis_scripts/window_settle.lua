
local z, h, rid = KEYS[1], KEYS[2], ARGV[1]
local actual, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prev = redis.call('HGET', h, rid)
local score = redis.call('ZSCORE', z, rid)
if not prev or not score or tonumber(score) <= now - window then
  return {0, 0, tonumber(redis.call('HGET', h, '#sum') or '0')}
end
local delta = actual - tonumber(prev)
redis.call('HSET', h, rid, actual)
local sum = redis.call('HINCRBY', h, '#sum', delta)
return {1, delta, sum}
