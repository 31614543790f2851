
local check = ARGV[11] == '1'
if check then
  local pos = redis.call('HGET', KEYS[1], 'pos') or ''
  if pos ~= ARGV[1] then
    return {'conflict', pos}
  end
end
local ttl = tonumber(ARGV[3])
local batch = cjson.decode(ARGV[5])
local pending = KEYS[6]
local dup = {}
for i = 1, #batch do
  local e = batch[i]
  if e.ed and (redis.call('SISMEMBER', KEYS[e.s], e.r) == 1
               or redis.call('HEXISTS', pending, e.r) == 1) then
    dup[i] = true
  else
    if e.e and redis.call('HLEN', KEYS[e.e]) ~= e.h then
      return {'retry', i, 'records'}
    end
    if e.pp and redis.call('HEXISTS', pending, e.r) ~= e.pp then
      return {'retry', i, 'waiting'}
    end
    if e.ns then
      for j = 1, #e.ns do
        if redis.call('SISMEMBER', KEYS[e.ns[j]], e.r) == 1 then
          return {'retry', i, 'billed'}
        end
      end
    end
    if e.rec then
      for j = 1, #e.rec, 3 do
        if redis.call('SISMEMBER', KEYS[e.rec[j]], e.rec[j + 1]) == 1 then
          return {'retry', i, 'record read'}
        end
      end
    end
  end
end
-- add_usage(h, e): item e's counts (e.n: field, value pairs), cost (e.c) and its
-- endpoint's cost field (e.ce) added to the usage hash h
local function add_usage(h, e)
  local n = e.n
  for j = 1, #n, 2 do
    redis.call('HINCRBY', h, n[j], n[j + 1])
  end
  if e.c ~= '0' then
    redis.call('HINCRBYFLOAT', h, 'cost', e.c)
    if e.ce then
      redis.call('HINCRBYFLOAT', h, e.ce, e.c)
    end
  end
end
local t = redis.call('TIME')
local now_s = tonumber(t[1])
local until_ms = now_s * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[10])
local mask = {}
local dups = 0
for i = 1, #batch do
  local e = batch[i]
  local ok = false
  if not dup[i] then
    if e.t == 'b' then
      ok = redis.call('SADD', KEYS[e.s], e.r) == 1
    elseif e.t == 'p' then
      ok = redis.call('HSETNX', pending, e.r, e.v) == 1
    else
      ok = true
    end
  end
  if ok then
    if e.t == 'b' or e.t == 'c' then
      if e.t == 'b' then
        redis.call('EXPIRE', KEYS[e.s], ttl)
        if e.sx then
          for j = 1, #e.sx do
            redis.call('SADD', KEYS[e.sx[j]], e.r)
            redis.call('EXPIRE', KEYS[e.sx[j]], ttl)
          end
        end
      end
      add_usage(KEYS[e.u], e)
      redis.call('SADD', KEYS[e.x], e.m)
      -- the same counters of the key's team and organization (tokengate.ledger.join)
      if e.lu then
        for j = 1, #e.lu do
          add_usage(KEYS[e.lu[j]], e)
          redis.call('SADD', KEYS[e.lx], e.lm[j])
        end
      end
      redis.call('ZADD', KEYS[4], e.ds, e.d)
      redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', unpack(e.a))
      -- a correction of a session whose totals expired makes none again
      if e.ss and (e.t == 'b' or redis.call('EXISTS', KEYS[e.ss]) == 1) then
        local s = KEYS[e.ss]
        for j = 1, #e.sn, 2 do
          redis.call('HINCRBY', s, e.sn[j], e.sn[j + 1])
        end
        if e.c ~= '0' then
          redis.call('HINCRBYFLOAT', s, 'cost', e.c)
        end
        local first = tonumber(redis.call('HGET', s, 'first'))
        if not first or e.sm < first then
          redis.call('HSET', s, 'first', e.sm)
        end
        local last = tonumber(redis.call('HGET', s, 'last'))
        if not last or e.sm > last then
          redis.call('HSET', s, 'last', e.sm)
        end
        redis.call('EXPIRE', s, e.sttl)
        local idx = KEYS[e.si]
        redis.call('ZADD', idx, 'GT', e.sm, e.sid)
        redis.call('ZREMRANGEBYRANK', idx, 0, -(e.smax + 1))
        redis.call('EXPIRE', idx, e.sttl)
      end
      if e.w then
        redis.call('HDEL', pending, e.r)
        redis.call('ZREM', KEYS[e.w], e.r)
      end
      if e.ob then
        local o = KEYS[e.ob]
        if e.od then
          redis.call('DEL', o)
        else
          redis.call('HSET', o, '#bill', e.obv)
          for j = 1, #e.obr, 2 do
            redis.call('HSET', o, e.obr[j], e.obr[j + 1])
          end
          redis.call('EXPIRE', o, ttl)
        end
      end
      if e.bq then
        redis.call('HSET', KEYS[e.bq], e.bf[1], e.bf[2])
      end
    elseif e.t == 'p' then
      redis.call('ZADD', KEYS[e.w], until_ms, e.r)
    end
    if e.rec then
      for j = 1, #e.rec, 3 do
        redis.call('SADD', KEYS[e.rec[j]], e.rec[j + 1])
        redis.call('EXPIRE', KEYS[e.rec[j]], ttl)
        if e.t == 's' then
          redis.call('HSET', KEYS[e.e], e.rec[j + 1], e.rec[j + 2])
        end
      end
    end
    if e.t == 's' then
      redis.call('EXPIRE', KEYS[e.e], ttl)
      redis.call('ZADD', KEYS[7], 'NX', e.sc or now_s, e.r)
    elseif e.e and (e.t == 'b' or e.t == 'o') then
      redis.call('DEL', KEYS[e.e])
      redis.call('ZREM', KEYS[7], e.r)
    end
    if e.st then
      for j = 1, #e.st, 3 do
        redis.call('HINCRBY', KEYS[e.st[j]], e.st[j + 1], e.st[j + 2])
      end
    end
    mask[i] = '1'
  else
    mask[i] = '0'
    if e.ed then
      dups = dups + 1
    end
  end
end
if ARGV[9] ~= '' then
  redis.call('ZADD', KEYS[5], now_s, ARGV[9])
  redis.call('HINCRBY', KEYS[2], 'files_done', 1)
end
if check then
  redis.call('HSET', KEYS[1], 'pos', ARGV[2], 'path', ARGV[7], 'ts', ARGV[8])
  redis.call('HINCRBY', KEYS[2], 'batches', 1)
end
local extra = cjson.decode(ARGV[12])
for j = 1, #extra, 2 do
  redis.call('HINCRBY', KEYS[2], extra[j], extra[j + 1])
end
redis.call('HINCRBY', KEYS[2], 'duplicates', dups)
redis.call('HINCRBY', KEYS[2], 'bad_lines', tonumber(ARGV[6]))
return {'ok', table.concat(mask)}
