-- A model's vLLM replicas: which one serves a request, and which are out.
-- (Over 600 lines: the choice, the per-replica counts it keeps, their reclaim after a
-- killed worker and the probes that take a replica out or back read and write one set
-- of shared-dict keys, so they stay in one module.)
--
-- Choice, by the model's routing.policy, among the replicas of the best rank (a rank
-- function, tokengate.admission: room in the KV cache, orders them first), awake before
-- asleep:
--   least_outstanding (default): the fewest outstanding reserved tokens, i.e. the sum of
--     the TPM reservations (prompt + output reserve) of the requests the replica is
--     serving now, kept in a shared dict by every worker (incr when the replica is
--     chosen, back at the end). A request count would treat a 30k-token prompt like a
--     30-token one; the edge knows each request's reservation before forwarding, so it
--     can balance by tokens. Ties go to the replica after the one this worker chose last.
--   round_robin: each replica in turn (one turn counter in the shared dict for every
--     worker), whatever its load.
--   prefix: the least cost(r) = (prompt_tokens - h(r)) + load_weight * outstanding(r),
--     tokens, where h(r) is the prompt tokens r is expected to serve from its prefix
--     cache (tokengate.prefix: the counter's KV-event index, else the edge's approximate
--     one). The first term is the prefill r still has to compute, the second the work
--     queued on it before this request; a replica that holds the prefix wins until its
--     outstanding tokens exceed (by load_weight) the prefill it saves, so one hot prefix
--     spreads instead of piling on one replica. With no hit anywhere (and a weight
--     above 0) it is least_outstanding. Ties as there. A request whose count carries no block
--     hashes and no hits (an estimate, embeddings, a prompt shorter than a block) is
--     chosen least_outstanding.
--   slo: the most headroom against the request's latency targets (tokengate.slo: TTFT
--     and TPOT predicted per replica from its expected prefix hit, the prefill work
--     queued there and its running requests); a request without targets is chosen
--     least_outstanding.
-- Choosing and counting are one step (take): a burst that arrives while the requests
-- before it wait for their limits still sees them. The requests in flight on each
-- replica are counted too: a replica at the model's max_concurrency (when set) ranks
-- with the full ones (admission.FULL), so requests go elsewhere, queue
-- (tokengate.queue) or are shed.
--
-- Out: a replica that failed to connect or whose connection broke before any answer
-- (nginx's own 502/504) upstream_max_fails times within upstream_eject_s is out: with
-- health probes (GET /health every upstream_health_interval_ms, by worker 0) until a
-- probe answers 200, without them for upstream_eject_s. A probe that does not answer
-- 200 takes a replica out too. Each ejection and each readmission is one log line; no
-- request is sent to a replica that is out (nginx logs one connect() error per try),
-- except when every replica is out: then the least loaded is tried anyway, better a
-- likely failure than a certain one.
--
-- Retries: nginx passes a request to the next replica only when nothing of it was sent
-- to the failed one (a POST is not idempotent; nginx never resends one after sending);
-- the balancer then picks another replica that this request has not tried.
--
-- Asleep: a replica that tokengate.idle put to sleep (vLLM's sleep mode) ranks after
-- every awake replica of the same rank, so light traffic stays on the awake ones; it is
-- still taken (and woken) when it is the best.
--
-- Names: a replica given by host name is resolved again every
-- upstream_resolve_interval_ms by worker 0 (DNS A records from edge.dns_servers, with
-- Debian's lua-nginx-dns), and every worker uses the address found last; a name that
-- has no address yet is out. A failed lookup keeps the address the replica had.

local ngx = ngx
local prefix = require "tokengate.prefix"
local shdict = require "tokengate.shdict"
local slo = require "tokengate.slo"
local clock = require "tokengate.clock"

local ngx_log, WARN, tcp, ngx_now = ngx.log, ngx.WARN, ngx.socket.tcp, ngx.now
local mono_ms = clock.mono_ms
local timer_every = ngx.timer.every
local tonumber, pairs = tonumber, pairs
local match = string.match
local tostring = tostring
local io_open = io.open
local ipairs, type, setmetatable = ipairs, type, setmetatable

local _M = {}

local dict -- the shared dict of outstanding tokens, failures, "out" and "asleep" marks
local pid = tostring(ngx.worker.pid())
-- this worker's kinds of keys of its share: "wreq:<pid>:", "wtok:<pid>:", "wpace:<pid>:"
local WREQ, WTOK, WPACE
local RECLAIM_S = 5 -- how often worker 0 looks for counts of workers that are gone
local KINDS = { "req", "tok", "pace" }
local held, register -- defined below
local eject_s, max_fails, health_timeout_ms
local probing -- health probes run (upstream_health_interval_ms > 0)
local rotate = 0 -- this worker's tie breaker

-- key(kind, model, r) -> the shared-dict key of replica r of model for kind (a prefix
-- such as "tok:"); the modules that keep state per replica (admission, idle) use it too
local keys = setmetatable({}, { __mode = "k" }) -- replica table -> {model, kind -> key}
local function key(kind, model, r)
    -- built once per replica and kind: a decision reads several per replica
    local ks = keys[r]
    if not ks or ks[1] ~= model then
        ks = { model }
        keys[r] = ks
    end
    local k = ks[kind]
    if not k then
        k = kind .. model .. "\0" .. r.name
        ks[kind] = k
    end
    return k
end
_M.key = key

-- Policy slo reads each replica's slow state (out, asleep, its admission rank for a
-- priority level) from a copy of this worker's at most SNAPSHOT_MS old: a decision then
-- reads two or three shared-dict numbers per replica (requests in flight, and
-- tokengate.slo's queued prefill and anchor) instead of eight, the difference between
-- a decision in 20 us and one in 40 on an nginx worker whose caches the request's
-- other stages have just filled. Out and asleep marks and the admission metrics
-- change seldom (a failure, a probe, an idle timer, a metrics read every
-- edge.admission.metrics_interval_ms); a mark this worker sets itself, and an out mark
-- any fresh read finds (the balancer looks again before it sends), are seen at once.
local SNAPSHOT_MS = 250
-- replica table -> this worker's view of it under policy slo: {model, kreq (its key of
-- requests in flight), st (tokengate.slo.state), at (mono ms of the copy; nil: read
-- again), out, asleep, ranks = {[level] = rank}}
local views = setmetatable({}, { __mode = "k" })

-- forget(r): r's copy is read again at its next decision
local function forget(r)
    local v = views[r]
    if v then
        v.at = nil
    end
end

-- init_worker(doc, dict_name) -> true | nil, err. doc: the compiled configuration
-- (models.<name>.upstreams = [{name = "host:port", host, addr = <IP literal> | null,
-- port, resolve}], edge: dns_servers, upstream_resolve_interval_ms,
-- upstream_max_fails, upstream_eject_s (s), upstream_health_interval_ms (0: off),
-- upstream_health_timeout_ms).
function _M.init_worker(doc, dict_name)
    local err
    dict, err = shdict.get(dict_name)
    if not dict then
        return nil, err
    end
    local edge = doc.edge
    eject_s, max_fails = edge.upstream_eject_s, edge.upstream_max_fails
    health_timeout_ms = edge.upstream_health_timeout_ms
    probing = edge.upstream_health_interval_ms > 0
    pid = tostring(ngx.worker.pid())
    WREQ, WTOK, WPACE = "wreq:" .. pid .. ":", "wtok:" .. pid .. ":", "wpace:" .. pid .. ":"
    register()
    local models = doc.models or {}
    _M.reclaim(false, models)
    if ngx.worker.id() ~= 0 then
        return true
    end
    if ngx.get_phase() == "init_worker" then -- (not in the Lua unit tests' init phase)
        local ok, err = timer_every(RECLAIM_S, _M.reclaim, models)
        if not ok then
            return nil, "reclaim timer: " .. err
        end
    end
    local interval = edge.upstream_health_interval_ms
    if interval > 0 then
        -- the first probe at once: a replica is ready only once one passed (_M.probed)
        local ok, err = ngx.timer.at(0, _M.probe_all, doc.models)
        if ok then
            ok, err = timer_every(interval / 1000, _M.probe_all, doc.models)
        end
        if not ok then
            return nil, "health probe timer: " .. err
        end
    end
    interval = edge.upstream_resolve_interval_ms
    if interval > 0 and #edge.dns_servers > 0 and _M.has_names(doc.models) then
        local ok, err = ngx.timer.at(0, _M.resolve_all, doc.models, edge.dns_servers)
        if ok then
            ok, err = timer_every(interval / 1000, _M.resolve_all, doc.models,
                edge.dns_servers)
        end
        if not ok then
            return nil, "resolve timer: " .. err
        end
    end
    return true
end

-- address(model, r) -> the replica's IP literal: the last one resolved, else the one
-- compiled; nil while a name has none yet
function _M.address(model, r)
    if r.resolve then
        return dict:get(key("addr:", model, r)) or (type(r.addr) == "string" and r.addr or nil)
    end
    return r.addr
end

-- is_out(model, r) -> true while the replica is skipped (failed, or no address yet)
function _M.is_out(model, r)
    local out = dict:get(key("out:", model, r)) == true or _M.address(model, r) == nil
    local v = views[r]
    if out and v and not v.out then
        v.at = nil
    end
    return out
end

-- probed(model, r) -> true when r's last health probe since nginx started answered
-- 200, or probes are off (nothing then says otherwise). /readyz counts a replica only
-- then: vLLM binds its port before the model is loaded, and a replica not probed yet
-- (a fresh start) may be one that is still loading.
function _M.probed(model, r)
    return not probing or dict:get(key("up:", model, r)) == true
end

-- the rank of a full replica: tokengate.admission's ranks are ROOM 1, HEADROOM 2,
-- UNKNOWN 3, FULL 4 (it takes this one: it requires this module)
local FULL = 4
_M.FULL = FULL
local OUT = math.huge -- the rank of a replica that is out: after every other

-- asleep(model_name, r) -> true while r is marked asleep (tokengate.idle: put to sleep,
-- being put to sleep, or not yet awake again)
function _M.asleep(model_name, r)
    return dict:get(key("asleep:", model_name, r)) == true
end

-- mark_asleep(model_name, r, on): sets (on) or clears the mark; only tokengate.idle
-- calls it.
function _M.mark_asleep(model_name, r, on)
    forget(r)
    if on then
        -- a replica that sleeps drops its KV cache (vLLM's sleep mode)
        prefix.forget(model_name, r)
        dict:set(key("asleep:", model_name, r), true)
    else
        dict:delete(key("asleep:", model_name, r))
    end
end

-- outstanding(model_name, r) -> tokens reserved by the requests r serves now (0: none
-- in flight; every reservation is at least one token: output_reserve >= 1)
function _M.outstanding(model_name, r)
    return dict:get(key("tok:", model_name, r)) or 0
end

-- last_active(model_name, r) -> s (ngx.now) when a request forwarded to r last ended
-- (one in flight keeps r busy through its outstanding tokens; one refused before it was
-- forwarded is no activity); nil when none did since the shared dict was created.
-- touch(model_name, r) sets it to now.
function _M.last_active(model_name, r)
    return dict:get(key("last:", model_name, r))
end

function _M.touch(model_name, r)
    -- plain set: every writer writes "now", so the last one is the latest
    dict:set(key("last:", model_name, r), ngx_now())
end

-- policy(model) -> the model's routing.policy ("least_outstanding" when it has none)
local function policy(model)
    local routing = model.routing
    return routing and routing.policy or "least_outstanding"
end

-- best(model, tried, rank, level, prompt, first, plan, targets) -> replica, its rank, its
-- outstanding tokens, its expected prefix hit (tokens), the hit's source | nil: the
-- replica of model (compiled model entry) not in tried (a set of names) with the best
-- rank, then awake before asleep, then the least cost of the model's policy (module
-- comment); rank(model_name, r, level, prompt) -> number, lower is better (nil: all rank
-- alike; tokengate.admission.rank: level, prompt are its priority level and prompt
-- tokens). plan: tokengate.prefix.plan's (policy prefix), or nil: then the policy's
-- cost, least outstanding for prefix. Replicas that are out rank OUT: taken only when
-- all untried ones are out. nil when every one was tried or none has an address. The
-- scan starts at `first` (a replica of model) when given, else after the one this
-- worker chose last (round_robin: after the one any worker chose last); the first of
-- equals wins. targets: the request's latency targets (tokengate.slo; policy slo), nil
-- without. Reads only: take() counts.
-- better(k, asleep, cost, k2, asleep2, cost2) -> whether a replica of rank k, asleep
-- or not, at cost beats the best so far (rank, then awake before asleep, then cost)
local function better(k, asleep, cost, best_rank, best_asleep, best_cost)
    return k < best_rank or (k == best_rank and (asleep ~= best_asleep and not asleep
        or asleep == best_asleep and cost < best_cost))
end

-- view(name, r, now) -> this worker's view of replica r of model name (views), its
-- copy of out and asleep read again when older than SNAPSHOT_MS at `now` (mono ms)
local function view(name, r, now)
    local v = views[r]
    if not v or v.model ~= name then
        v = { model = name, kreq = key("req:", name, r), st = slo.state(name, r) }
        views[r] = v
    end
    local at = v.at
    if not at or now - at > SNAPSHOT_MS then
        v.at, v.out, v.asleep, v.ranks = now, _M.is_out(name, r), _M.asleep(name, r), {}
    end
    return v
end

local cand = {} -- best_slo()'s candidates (reused: no table per request)

-- best_slo(model, tried, rank, level, prompt, plan, targets, start): best() under
-- policy slo: the rank (OUT when out; a rank rank() calls steady, tokengate.admission,
-- from the view's copy), awake before asleep, then the most headroom against targets
-- (tokengate.slo.headroom of the TTFT and TPOT slo.predict_state predicts with the
-- replica's expected prefix hit from plan and its requests in flight, this one
-- included). Returns best()'s values, the chosen replica's requests in flight in place
-- of its outstanding tokens (take()'s check for a race). The predictions of the
-- candidates are timed together (targets.predict_ms); the chosen one's is kept in
-- targets (slo.chosen). The choice is timed (targets.decision_ms: from its start,
-- targets.chose_at (mono ms, the copies' now), to the chosen prediction in hand), the
-- predictions of the candidates together (targets.predict_ms); both add up over the
-- choices of a request.
local function best_slo(model, tried, rank, level, prompt, plan, targets, start)
    local list = model.upstreams
    local n = #list
    local name = model.name
    local cap = model.max_concurrency or 0
    local now = mono_ms()
    local m = 0
    for i = 0, n - 1 do
        local r = list[(start + i) % n + 1]
        if not (tried and tried[r.name]) and (r.addr or _M.address(name, r)) then
            local v = view(name, r, now)
            local k = 0
            if v.out then
                k = OUT
            elseif rank then
                k = level and v.ranks[level]
                if not k then
                    local steady
                    k, steady = rank(name, r, level, prompt)
                    if steady and level then
                        v.ranks[level] = k
                    end
                end
            end
            local flying = dict:get(v.kreq) or 0
            if cap > 0 and k < FULL and flying >= cap then
                k = FULL
            end
            local hit, source = 0, nil
            if plan then
                hit, source = prefix.expected(name, r, plan)
            end
            m = m + 1
            local c = cand[m]
            if not c then
                c = {}
                cand[m] = c
            end
            c.r, c.st, c.k, c.asleep, c.flying, c.hit, c.source = r, v.st, k, v.asleep, flying,
                hit, source
        end
    end
    if m == 0 then
        return nil
    end
    local t0 = mono_ms()
    local pick, best_rank, best_asleep, best_cost
    for i = 1, m do
        local c = cand[i]
        local ttft, tpot, ahead = slo.predict_state(c.st, prompt - c.hit, c.flying + 1, t0)
        local cost = -slo.headroom(ttft, tpot, targets)
        if not pick or better(c.k, c.asleep, cost, best_rank, best_asleep, best_cost) then
            pick, best_rank, best_asleep, best_cost = c, c.k, c.asleep, cost
        end
        c.ttft, c.tpot, c.ahead = ttft, tpot, ahead
    end
    local t1 = mono_ms()
    targets.chose_at = now
    targets.predict_ms = (targets.predict_ms or 0) + (t1 - t0)
    targets.decision_ms = (targets.decision_ms or 0) + (t1 - now)
    slo.chosen(targets, pick.r, pick.ttft, pick.tpot, pick.ahead, pick.flying + 1)
    return pick.r, best_rank, pick.flying, pick.hit, pick.source
end

local function best(model, tried, rank, level, prompt, first, plan, targets)
    local list = model.upstreams
    local n = #list
    local name = model.name
    local pol = policy(model)
    local rr = pol == "round_robin"
    local start = rotate
    if first then
        for i = 1, n do
            if list[i] == first then
                start = i - 1
                break
            end
        end
    elseif rr then
        start = dict:incr("rr:" .. name, 1, 0) or rotate
    else
        rotate = rotate + 1
        start = rotate
    end
    if targets and pol == "slo" then
        return best_slo(model, tried, rank, level, prompt, plan, targets, start)
    end
    local weight = plan and model.routing.load_weight
    local cap = model.max_concurrency or 0
    local choice, best_rank, best_asleep, best_cost, best_out, best_hit, best_source
    for i = 0, n - 1 do
        local r = list[(start + i) % n + 1]
        if not (tried and tried[r.name]) and _M.address(name, r) then
            local out = dict:get(key("tok:", name, r)) or 0
            local asleep = _M.asleep(name, r)
            local k = 0
            if _M.is_out(name, r) then
                k = OUT
            elseif rank then
                k = rank(name, r, level, prompt)
                if cap > 0 and k < FULL and _M.in_flight(name, r) >= cap then
                    k = FULL
                end
            end
            local cost, hit, source = out, nil, nil
            if plan then
                hit, source = prefix.expected(name, r, plan)
                cost = (prompt - hit) + weight * out
            elseif rr then
                cost = 0
            end
            if not choice or better(k, asleep, cost, best_rank, best_asleep, best_cost) then
                choice, best_rank, best_asleep, best_cost = r, k, asleep, cost
                best_out, best_hit, best_source = out, hit, source
            end
        end
    end
    return choice, best_rank, best_out, best_hit, best_source
end

-- held(model_name, r, n, tokens, paced): n requests and their tokens more (or fewer)
-- in flight on replica r, of a paced priority or not (paced: its max_prefill_tokens is
-- set, tokengate.admission.sent): the totals every worker reads ("req:", "tok:",
-- "pace:"), and this worker's own share of them ("wreq:<pid>:", ...), from which
-- reclaim() takes back what a worker that died (a crash, a kill after a reload's
-- shutdown timeout) left counted.
-- -> the new outstanding tokens and requests in flight of r (every worker's)
held = function(model_name, r, n, tokens, paced)
    local flying = dict:incr(key("req:", model_name, r), n, 0)
    local now = dict:incr(key("tok:", model_name, r), tokens, 0)
    dict:incr(key(WREQ, model_name, r), n, 0)
    dict:incr(key(WTOK, model_name, r), tokens, 0)
    if paced then
        dict:incr(key("pace:", model_name, r), n, 0)
        dict:incr(key(WPACE, model_name, r), n, 0)
    end
    return now, flying
end

-- alive(worker_pid) -> whether that process still runs (an nginx worker of this host)
function _M.alive(worker_pid)
    local f = io_open("/proc/" .. worker_pid .. "/stat")
    if f then
        f:close()
        return true
    end
    return false
end

-- register(): this worker's pid in the list reclaim() walks ("wpid:<i>", i = 1..n).
register = function()
    local i = dict:incr("wpid_n", 1, 0)
    dict:set("wpid:" .. i, pid)
end

-- reclaim(premature, models): takes the requests and tokens that workers which are gone
-- (a crash, a kill after a reload's shutdown timeout) left counted on each replica of
-- models out of the totals (each worker at its start, worker 0 every RECLAIM_S): a
-- replica would otherwise stay full at max_concurrency, and its outstanding tokens
-- high, for good. Walks the registered pids, not the dict.
function _M.reclaim(premature, models)
    if premature then
        return
    end
    local n = dict:get("wpid_n") or 0
    for i = 1, n do
        local owner = dict:get("wpid:" .. i)
        -- the first to see a worker gone takes it (several new workers start at once)
        if owner and owner ~= pid and not _M.alive(owner)
                and dict:incr("wpid_taken:" .. i, 1, 0) == 1 then
            for name, m in pairs(models) do
                for _, r in ipairs(m.upstreams) do
                    local tail = name .. "\0" .. r.name
                    for _, kind in ipairs(KINDS) do
                        local k = "w" .. kind .. ":" .. owner .. ":" .. tail
                        local v = dict:get(k)
                        if v and v ~= 0 then
                            dict:incr(kind .. ":" .. tail, -v, 0)
                        end
                        dict:delete(k)
                    end
                end
            end
            dict:delete("wpid:" .. i)
            dict:delete("wpid_taken:" .. i)
        end
    end
end

-- take(ctx, model, tried, rank, level, prompt, tokens) -> replica, its rank | nil: the
-- best replica (best(): tried, rank, level and prompt as there, ctx.prefix_plan its
-- plan), which serves the request from now on: its `tokens` (the request's
-- reservation) count as outstanding there until release(ctx), and the request among
-- the paced ones (paced()) when its priority (level) has max_prefill_tokens. A replica ctx held before
-- (a retry) is released first. With a plan, ctx.prefix_expected (tokens) and
-- ctx.prefix_source ("events" | "approximate") say what the chosen replica is expected
-- to serve from its prefix cache. (Named arguments, not varargs: a loop that passes
-- varargs on is never compiled.)
--
-- The choice and the count are one step, so a burst spreads: no yield comes between the
-- read and the incr, so the next request of this worker sees this one's tokens. Another
-- worker may incr between this worker's read and its incr (both chose the same replica
-- on the same reading); the incr's result says so (it exceeds what was read by more
-- than `tokens`; under policy slo, which reads requests in flight, by more than this
-- one), and then the choice is made again with this request's own tokens left out: it
-- moves when another replica now costs strictly less (once, so two workers never chase
-- each other; not for round_robin, which reads no load).
--
-- The increment comes before any look at r's asleep mark (tokengate.idle.hold): the
-- sleeper marks first and reads the tokens after, so one of the two always sees the
-- other.
function _M.take(ctx, model, tried, rank, level, prompt, tokens)
    _M.release(ctx)
    local plan, targets = ctx.prefix_plan, ctx.slo
    local r, k, seen, hit, source = best(model, tried, rank, level, prompt, nil, plan, targets)
    if not r then
        return nil
    end
    local name = model.name
    local pol = policy(model)
    local paced = type(level) == "table" and type(level.max_prefill_tokens) == "number"
    local now, flying = held(name, r, 1, tokens, paced)
    -- policy slo reads requests in flight, the others outstanding tokens
    local raced
    if targets and pol == "slo" then
        raced = (flying or 0) - 1 > seen
    else
        raced = (now or 0) - tokens > seen and pol ~= "round_robin"
    end
    if raced then
        held(name, r, -1, -tokens, paced)
        local r2, k2, _, hit2, source2 = best(model, tried, rank, level, prompt, r, plan,
            targets)
        if r2 then
            r, k, hit, source = r2, k2, hit2, source2
        end
        held(name, r, 1, tokens, paced)
    end
    ctx.replica, ctx.replica_tokens, ctx.replica_model = r, tokens, name
    ctx.replica_paced = paced
    ctx.prefix_expected, ctx.prefix_source = hit, source
    return r, k
end

-- in_flight(model_name, r) -> the requests this edge has on replica r now (taken and
-- not yet released: forwarded, or about to be).
function _M.in_flight(model_name, r)
    return dict:get(key("req:", model_name, r)) or 0
end

-- paced(model_name, r) -> the requests of paced priorities (their max_prefill_tokens
-- set: tokengate.admission.sent) this edge has on replica r now.
function _M.paced(model_name, r)
    return dict:get(key("pace:", model_name, r)) or 0
end

-- others(model, r) -> the set of the names of model's replicas other than r: take()'s
-- `tried` for a request that only r can serve (it holds the request's stored response)
function _M.others(model, r)
    local set = {}
    local list = model.upstreams
    for i = 1, #list do
        if list[i] ~= r then
            set[list[i].name] = true
        end
    end
    return set
end

-- release(ctx, forget): the request left its replica (it ended, is retried elsewhere,
-- or was refused before it was forwarded: forget, and it names no replica).
function _M.release(ctx, forget)
    local r = ctx.replica
    if r and ctx.replica_tokens then
        held(ctx.replica_model, r, -1, -ctx.replica_tokens, ctx.replica_paced)
        ctx.replica_tokens = nil
        if not forget then
            _M.touch(ctx.replica_model, r)
        end
    end
    if forget then
        ctx.replica = nil
    end
end

-- failed(model_name, r, why): one failure of r (connect error, broken before answering);
-- at upstream_max_fails within upstream_eject_s the replica is out: with health probes,
-- until a probe passes (a mark that expired by itself would send requests to a replica
-- that is still dead, one failed connect each, until the next probe); without them,
-- for upstream_eject_s, after which a request tries it again. One log line per
-- ejection: add, not set, decides which worker writes it.
function _M.failed(model_name, r, why)
    local fails = dict:incr(key("fail:", model_name, r), 1, 0, eject_s)
    if fails and fails >= max_fails then
        forget(r)
        local k = key("out:", model_name, r)
        local ttl = probing and 0 or eject_s
        if dict:add(k, true, ttl) then
            prefix.forget(model_name, r) -- back in, it may be a restarted vLLM
            ngx_log(WARN, "tokengate: upstream ", r.name, " of ", model_name, " out ",
                probing and "until its health probe passes" or "for " .. eject_s .. " s",
                " (", why, ")")
        elseif not probing then
            dict:set(k, true, ttl) -- tried again while out (every one was): out again
        end
    end
end

-- call(r, addr, method, path, timeout_ms) -> sock, status | nil: method ("GET", or
-- "POST" with an empty body) path on replica r at addr (timer context: cosockets),
-- over HTTP/1.0 so that the answer is never chunked and ends when the replica closes;
-- connect, send and each read wait at most timeout_ms. sock stands after the status
-- line (headers, blank line, body follow): the caller reads what it needs and closes it.
function _M.call(r, addr, method, path, timeout_ms)
    local sock = tcp()
    sock:settimeouts(timeout_ms, timeout_ms, timeout_ms)
    local ok = sock:connect(addr, r.port)
    if not ok then
        return nil
    end
    ok = sock:send(method .. " " .. path .. " HTTP/1.0\r\nHost: " .. r.name
        .. (method == "POST" and "\r\nContent-Length: 0" or "") .. "\r\n\r\n")
    local line = ok and sock:receive("*l")
    local status = line and tonumber(match(line, "^HTTP/1%.%d (%d%d%d)"))
    if not status then
        sock:close()
        return nil
    end
    return sock, status
end

-- probe(r, addr) -> true when GET /health answers 200 within upstream_health_timeout_ms
local function probe(r, addr)
    local sock, status = _M.call(r, addr, "GET", "/health", health_timeout_ms)
    if sock then
        sock:close()
    end
    return status == 200
end

-- probe_all(premature, models): the health timer: every replica of every model.
function _M.probe_all(premature, models)
    if premature then
        return
    end
    for name, m in pairs(models) do
        for i = 1, #m.upstreams do
            local r = m.upstreams[i]
            local addr = _M.address(name, r)
            if not addr then -- unresolved: nothing to probe yet
            elseif probe(r, addr) then
                local k = key("out:", name, r)
                if dict:get(k) then -- one writer (this timer): one line per readmission
                    ngx_log(WARN, "tokengate: upstream ", r.name, " of ", name,
                        " passed its health probe: back in")
                    dict:delete(k)
                    forget(r)
                end
                dict:delete(key("fail:", name, r))
                dict:set(key("up:", name, r), true)
            else
                dict:delete(key("up:", name, r))
                forget(r)
                if dict:add(key("out:", name, r), true, 0) then
                    prefix.forget(name, r)
                    ngx_log(WARN, "tokengate: upstream ", r.name, " of ", name,
                        " failed its health probe: out until it answers")
                else
                    -- out already: an ejection made before probes were on may expire; no
                    -- longer
                    dict:set(key("out:", name, r), true, 0)
                end
            end
        end
    end
end

-- has_names(models) -> true when some replica is given by a host name
function _M.has_names(models)
    for _, m in pairs(models) do
        for i = 1, #m.upstreams do
            if m.upstreams[i].resolve then
                return true
            end
        end
    end
    return false
end

-- resolve_all(premature, models, servers): the resolve timer: the A record of every
-- replica given by name, from servers ({{address, port}, ...}).
function _M.resolve_all(premature, models, servers)
    if premature then
        return
    end
    local resolver = require "nginx.dns.resolver" -- Debian's lua-nginx-dns
    local r, err = resolver:new({ nameservers = servers, retrans = 2, timeout = 1000 })
    if not r then
        ngx_log(WARN, "tokengate: DNS resolver: ", err)
        return
    end
    for name, m in pairs(models) do
        for i = 1, #m.upstreams do
            local u = m.upstreams[i]
            if u.resolve then
                local answers, qerr = r:query(u.host, { qtype = r.TYPE_A })
                local addr
                if answers and not answers.errcode then
                    for j = 1, #answers do
                        if answers[j].address then
                            addr = answers[j].address
                            break
                        end
                    end
                end
                local k = key("addr:", name, u)
                if addr and addr ~= dict:get(k) then
                    ngx_log(WARN, "tokengate: upstream ", u.name, " of ", name, " is now ", addr)
                    dict:set(k, addr)
                elseif not addr then
                    ngx_log(WARN, "tokengate: upstream ", u.name, " of ", name,
                        " did not resolve (", qerr or (answers and answers.errstr) or
                        "no A record", "): keeping its address")
                end
            end
        end
    end
end

-- states(doc, more) -> {[model] = {[replica name] = {outstanding_tokens, out, asleep,
-- address, more = more(model name, r)}}} (for the status server)
function _M.states(doc, more)
    local all = {}
    for name, m in pairs(doc.models) do
        local s = {}
        for i = 1, #m.upstreams do
            local r = m.upstreams[i]
            s[r.name] = { outstanding_tokens = dict:get(key("tok:", name, r)) or 0,
                          out = _M.is_out(name, r), asleep = _M.asleep(name, r),
                          address = _M.address(name, r),
                          more = more and more(name, r) }
        end
        all[name] = s
    end
    return all
end

return _M
