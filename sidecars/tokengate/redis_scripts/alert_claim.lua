
-- KEYS[1] the alert's mark, KEYS[2] the pending deliveries. ARGV: the mark's ttl (s),
-- then per webhook a field and its delivery. Returns 1 (claimed: queued for every
-- webhook) or 0 (claimed before, by this ledger or another).
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
return 1
