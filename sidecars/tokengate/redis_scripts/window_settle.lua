
-- KEYS: per window its zset and hash (the key's first, then its levels'). ARGV:
-- request_id, actual tokens, window_ms. Corrects every window that still holds the
-- reservation; the answer is the key's window's.
local rid = ARGV[1]
local actual, window = tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local answer
for w = 1, #KEYS / 2 do
  local z, h = KEYS[2 * w - 1], KEYS[2 * w]
  local prev = redis.call('HGET', h, rid)
  local score = redis.call('ZSCORE', z, rid)
  local r
  if not prev or not score or tonumber(score) <= now - window then
    r = {0, 0, tonumber(redis.call('HGET', h, '#sum') or '0')}
  else
    local delta = actual - tonumber(prev)
    redis.call('HSET', h, rid, actual)
    r = {1, delta, redis.call('HINCRBY', h, '#sum', delta)}
  end
  answer = answer or r
end
return answer
