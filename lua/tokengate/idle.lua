-- Idle unload: a replica that has served nothing for models.<name>.idle_unload.idle_s is
-- put to sleep through vLLM's sleep mode, and the next request for it wakes it and waits
-- until it is awake.
--
-- vLLM's routes (vllm/entrypoints/serve/dev/sleep/api_router.py; served only with
-- --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1): POST /sleep?level=1 (the weights
-- to CPU memory, the KV cache dropped; level 2 would discard the weights, which
-- /wake_up does not load again) answers
-- {"status": "sleeping", "level": n} once the engine sleeps; POST /wake_up answers
-- {"status": "awake" | "sleeping", ...} once the memory is back; GET /is_sleeping
-- answers {"is_sleeping": bool}. /sleep's default mode "abort" aborts every request
-- the engine holds, and a request sent to a sleeping engine is queued unscheduled until
-- a wake (vllm/v1/engine/core.py: sleep, pause_scheduler): so the edge puts a replica to
-- sleep only with nothing in flight on it, and never forwards to one marked asleep.
--
-- State (shared dict, every worker): tokengate.upstream's "asleep" mark, set before
-- /sleep is sent and cleared when /wake_up answered "awake"; its outstanding tokens
-- (what is in flight) and last activity; a lock ("idle-lock:") held by whoever is
-- sending /sleep or /wake_up to a replica, so one call at a time goes to each.
--
-- Sleeping (worker 0, one timer every SWEEP_S, like the health probe and the metrics
-- reader): a replica idle for idle_s, not out, with no outstanding tokens is marked,
-- then its outstanding tokens are read again: a request that took the replica after
-- the first read has incremented them before looking at the mark (upstream.take, then
-- hold), so either it sees the mark and waits, or the sweep sees its tokens and gives
-- up. When /sleep fails (sleep mode not enabled, an error) the mark is cleared and the
-- replica is tried again after another idle_s.
--
-- Re-learning (the same sweep, for every model, idle unload on or off): the marks live
-- in the shared dict and outlive a reload, and a replica may be woken by someone else;
-- so a replica marked asleep is asked (GET /is_sleeping) every SWEEP_S: awake, and the
-- mark goes; still asleep while its model's idle unload is off (turned off by a
-- reload while it slept), and it is woken, since it ranks after every awake replica and
-- no request would wake it while another one takes them.
--
-- Waking (any worker, in a timer of its own so that a client leaving stops nothing):
-- started by the first request that finds the mark and the lock free, and again by a
-- held request whenever the lock is free and the mark still set (a wake that failed).
-- A request waits at most max_hold_ms, polling the mark every POLL_S; then it is
-- answered 503 model_waking with Retry-After, and the wake goes on.

local ngx = ngx
local errors = require "tokengate.errors"
local upstream = require "tokengate.upstream"
local metrics = require "tokengate.metrics"
local shdict = require "tokengate.shdict"

local ngx_log, WARN, ngx_now, ngx_sleep = ngx.log, ngx.WARN, ngx.now, ngx.sleep
local timer_every, timer_at = ngx.timer.every, ngx.timer.at
local pairs = pairs
local find = string.find
local tostring = tostring
local floor = math.floor

local _M = {}

local SWEEP_S = 1      -- s: how often worker 0 looks for idle replicas
local POLL_S = 0.05    -- s: how often a held request looks at the mark
local LOCK_MARGIN_S = 5 -- s: the lock outlives a call by this much (a worker that died)

local dict

local function lock_key(model_name, r)
    return upstream.key("idle-lock:", model_name, r)
end

-- lock(name, r, c) -> the lock's key | nil: replica r of model name locked for one wake
-- or sleep (add is atomic across workers: one of them gets it); nil: one is under way.
-- The lock expires a margin after the call's timeout (c.call_timeout_ms), in case its
-- worker dies.
local function lock(name, r, c)
    local k = lock_key(name, r)
    if not dict:add(k, true, c.call_timeout_ms / 1000 + LOCK_MARGIN_S) then
        return nil
    end
    return k
end

-- locked(act) -> fn(name, r, c): act(name, r, c, k) with replica r's lock taken (k: its
-- key, which act releases, dict:delete(k), once its work ends); nothing when a wake or a
-- sleep of r is under way (lock).
local function locked(act)
    return function(name, r, c)
        local k = lock(name, r, c)
        if k then
            act(name, r, c, k)
        end
    end
end

-- init_worker(doc, dict_name) -> true | nil, err. doc: the compiled configuration
-- (models.<name>.idle_unload: idle_s (0: off), max_hold_ms, retry_after_s,
-- call_timeout_ms). Worker 0 runs the sweep, also with idle unload off: replicas may
-- still be marked asleep from before a reload (sweep).
function _M.init_worker(doc, dict_name)
    local err
    dict, err = shdict.get(dict_name)
    if not dict then
        return nil, err
    end
    if ngx.worker.id() ~= 0 then
        return true
    end
    local ok, err = timer_every(SWEEP_S, _M.sweep, doc.models)
    if not ok then
        return nil, "idle unload timer: " .. err
    end
    return true
end

-- post(name, r, path, timeout_ms) -> status, body | nil: POST path on replica r of
-- model name; body: the answer after the headers (vLLM's JSON is a few bytes).
local function post(name, r, path, timeout_ms)
    local addr = upstream.address(name, r)
    if not addr then
        return nil
    end
    local sock, status = upstream.call(r, addr, "POST", path, timeout_ms)
    if not sock then
        return nil
    end
    local body = sock:receive("*a")
    sock:close()
    return status, body
end

-- is_sleeping(name, r, c) -> true when GET /is_sleeping answers {"is_sleeping": true},
-- false for any other answer (a vLLM without sleep mode: 404), nil for none
local function is_sleeping(name, r, c)
    local addr = upstream.address(name, r)
    if not addr then
        return nil
    end
    local sock, status = upstream.call(r, addr, "GET", "/is_sleeping", c.call_timeout_ms)
    if not sock then
        return nil
    end
    local body = sock:receive("*a")
    sock:close()
    if not body then
        return nil
    end
    return status == 200 and find(body, '"is_sleeping":%s*true') ~= nil
end

-- wake_up(premature, name, r, c): the wake timer: POST /wake_up, clears the mark when
-- vLLM answers that the replica is awake; releases the lock either way.
local function wake_up(premature, name, r, c)
    if not premature and upstream.asleep(name, r) then
        ngx.update_time()
        local t0 = ngx_now()
        local status, body = post(name, r, "/wake_up", c.call_timeout_ms)
        if status == 200 and body and find(body, '"awake"', 1, true) then
            upstream.mark_asleep(name, r, false)
            upstream.touch(name, r)
            metrics.incr("idle_wakes")
            ngx.update_time()
            ngx_log(WARN, "tokengate: upstream ", r.name, " of ", name, " is awake after ",
                floor((ngx_now() - t0) * 1000), " ms")
        else
            ngx_log(WARN, "tokengate: upstream ", r.name, " of ", name, ": POST /wake_up ",
                "answered ", status or "nothing", ": still asleep")
        end
    end
    dict:delete(lock_key(name, r))
end

-- wake(name, r, c): starts a wake of replica r unless one (or a sleep) is under way.
local wake = locked(function(name, r, c, k)
    local ok, err = timer_at(0, wake_up, name, r, c)
    if not ok then
        dict:delete(k)
        ngx_log(WARN, "tokengate: wake timer for ", r.name, " of ", name, ": ", err)
    end
end)

-- relearn(name, r, c): a replica marked asleep, not locked: asks it. Awake (woken by
-- someone else, or never asleep): the mark goes, so it takes requests again. Asleep
-- while idle unload is off for its model (turned off while it slept): woken, since
-- nothing else would wake it while another replica takes the requests. No answer: the
-- mark stays (a replica that is down is the health probe's business).
local relearn = locked(function(name, r, c, k)
    local sleeping = is_sleeping(name, r, c)
    dict:delete(k)
    if sleeping == false then
        upstream.mark_asleep(name, r, false)
        upstream.touch(name, r) -- idle from now: asleep again after idle_s, not at once
        ngx_log(WARN, "tokengate: upstream ", r.name, " of ", name, " is awake (GET ",
            "/is_sleeping): it takes requests again")
    elseif sleeping and c.idle_s == 0 then
        wake(name, r, c)
    end
end)

-- put_to_sleep(name, r, c): one replica, idle and not locked: mark, check, /sleep.
local put_to_sleep = locked(function(name, r, c, k)
    upstream.mark_asleep(name, r, true)
    if upstream.outstanding(name, r) > 0 then -- a request took it meanwhile
        upstream.mark_asleep(name, r, false)
        dict:delete(k)
        return
    end
    local status = post(name, r, "/sleep?level=1", c.call_timeout_ms)
    if status ~= 200 then
        upstream.mark_asleep(name, r, false)
        upstream.touch(name, r) -- next try after another idle_s
        dict:delete(k)
        ngx_log(WARN, "tokengate: upstream ", r.name, " of ", name, ": POST /sleep answered ",
            status or "nothing", " (vLLM needs --enable-sleep-mode and "
            .. "VLLM_SERVER_DEV_MODE=1): it stays awake")
        return
    end
    metrics.incr("idle_sleeps")
    ngx_log(WARN, "tokengate: upstream ", r.name, " of ", name, " is asleep after ",
        c.idle_s, " s idle")
    -- requests that came while it fell asleep are held: the first of them to find the
    -- lock free wakes it
    dict:delete(k)
end)

-- sweep(premature, models): the idle timer (worker 0): every replica of every model.
-- A replica marked asleep is asked whether it still is (relearn), whatever the
-- model's idle_s: the mark outlives a reload (shared dict) that turned idle unload off,
-- and a replica may be woken by hand. Only models with idle unload on put replicas to
-- sleep.
function _M.sweep(premature, models)
    if premature then
        return
    end
    ngx.update_time()
    local now = ngx_now()
    for name, m in pairs(models) do
        local c = m.idle_unload
        for i = 1, #m.upstreams do
            local r = m.upstreams[i]
            local last = upstream.last_active(name, r)
            if upstream.asleep(name, r) then
                relearn(name, r, c)
            elseif c.idle_s == 0 then -- off: nothing to put to sleep
            elseif not last then
                -- first sight since the dict was created (an edge restart): a
                -- replica may be asleep already
                upstream.touch(name, r)
                if is_sleeping(name, r, c) then
                    upstream.mark_asleep(name, r, true)
                end
            elseif now - last >= c.idle_s and upstream.outstanding(name, r) == 0
                    and not upstream.is_out(name, r) then
                put_to_sleep(name, r, c)
            end
        end
    end
end

-- nudge(model, r): starts a wake of r when it is marked asleep, without waiting (the
-- balancer's retry, which cannot wait: vLLM queues the request until it is awake).
function _M.nudge(model, r)
    if upstream.asleep(model.name, r) then
        wake(model.name, r, model.idle_unload)
    end
end

-- hold(ctx) -> true | nil, err (503 model_waking): the request's replica (taken:
-- upstream.take) is awake, or woken within max_hold_ms. Every held request counts in
-- idle_held, every one that waited in vain in idle_wake_timeouts.
function _M.hold(ctx)
    local model, r = ctx.model_entry, ctx.replica
    local name = model.name
    if not upstream.asleep(name, r) then
        return true
    end
    local c = model.idle_unload
    metrics.incr("idle_held")
    local deadline = ngx_now() + c.max_hold_ms / 1000
    repeat
        wake(name, r, c)
        ngx_sleep(POLL_S)
        if not upstream.asleep(name, r) then
            return true
        end
    until ngx_now() >= deadline
    metrics.incr("idle_wake_timeouts")
    return nil, errors.new(503, "Model " .. errors.clip(name) .. " is waking up from "
        .. "idle (its replica was put to sleep) and was not ready within "
        .. c.max_hold_ms .. " ms. Please retry after " .. c.retry_after_s .. " s.", nil,
        "model_waking", nil, { ["Retry-After"] = tostring(c.retry_after_s) })
end

return _M
