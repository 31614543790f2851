if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[3]) then
  return 0
end
for i = 1, (#KEYS - 1) / 2 do
  local ttl = ARGV[3 + i]
  -- the ARGV strings: signed int64 amounts, exact (see budget_reserve.lua)
  if ARGV[1] ~= '0' then
    redis.call('INCRBY', KEYS[2 * i], ARGV[1])
    redis.call('EXPIRE', KEYS[2 * i], ttl, 'NX')
  end
  if ARGV[2] ~= '0' then
    redis.call('INCRBY', KEYS[2 * i + 1], ARGV[2])
    redis.call('EXPIRE', KEYS[2 * i + 1], ttl, 'NX')
  end
end
return 1
