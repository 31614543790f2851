-- Fair queueing in tokens (edge.queue): a request that no replica of its model can take
-- now waits in its key's queue, and the queued requests are dispatched as replicas free
-- up, fairly between keys, instead of being answered 503 overloaded.
--
-- Order: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
-- Models", OSDI 2024). Each key has a counter of the weighted tokens it was served
-- through the queue: prompt_weight * prompt + completion_weight * completion, divided
-- by the key's fair_share. At dispatch the request's reservation is charged (prompt +
-- reserved completion); at its end the charge is settled to the usage billed, so a
-- request that stops early is not charged for what it never generated. The next
-- request dispatched is the head of the queue of the key with the smallest counter;
-- a key whose queue was empty starts at the smallest counter of the keys waiting (if
-- larger than its own), so idling earns no credit (the paper's counter lift). Equal
-- counters (a key just lifted) go to the key with fewer requests waiting.
-- Priorities are strict: the keys of a priority with a higher kv_cache_threshold
-- (edge.admission.priorities; then a higher max_waiting) are all served before a lower
-- one, since a lower priority is the one to shed first when replicas fill up (the same
-- order admission already uses).
--
-- When: a request queues when its best replica is full for its priority (admission)
-- or at the model's max_concurrency, or when requests of its model already wait (a
-- newcomer must not pass them). A queued request is dispatched when some replica that
-- is not out has room for its priority and a free slot: the free slots of the
-- replicas with room (max_concurrency - in flight; unbounded without max_concurrency)
-- exceed the requests dispatched that have not yet taken their replica.
--
-- Shared by the edge's nginx workers, in lua_shared_dict tokengate_queue:
--   lock                  the dispatcher's mutex (add with a ttl: a worker that dies
--                         holding it does not stop the queue)
--   seq                   ticket ids
--   q:<model>\0<key>      the queue: a list of ticket ids, oldest first
--   act                   the queues with requests: "<model>\0<key>\n..." (under lock)
--   t:<id>                a ticket's state, moved by incr only: 0 waiting; the
--                         dispatcher adds 1, a request that leaves (deadline, client
--                         gone) adds 2: whoever sees its own value (1 or 2) won, 3
--                         means the other did first
--   c:<id>                "<key>\t<tokens>\t<prompt>\t<charge>" of a waiting ticket
--   v:<key>               the key's virtual token counter (weighted tokens)
--   n:<key>, k:<key>      the key's waiting requests and tokens (bounds)
--   N, T                  all waiting requests and tokens (bounds)
--   pn:<priority>, pt:<priority>  waiting requests and tokens per priority (metrics)
--   p:<model>             requests dispatched that have not yet taken their replica
-- Every waiting request looks at its ticket every poll_ms and, when the lock is free,
-- runs one dispatch pass itself: no timer, and the queue moves while anyone waits.

local ngx = ngx
local errors = require "tokengate.errors"
local upstream = require "tokengate.upstream"
local admission = require "tokengate.admission"
local metrics = require "tokengate.metrics"
local shdict = require "tokengate.shdict"

local ngx_now, ngx_sleep, ngx_update_time = ngx.now, ngx.sleep, ngx.update_time
local ngx_log, WARN = ngx.log, ngx.WARN
local tonumber, tostring, pairs, ipairs = tonumber, tostring, pairs, ipairs
local max, min, huge, floor = math.max, math.min, math.huge, math.floor
local find, sub, gmatch, match = string.find, string.sub, string.gmatch, string.match
local concat = table.concat

local _M = {}

local DICT = "tokengate_queue"
local ticket -- defined below
local LOCK_TTL_S = 0.5     -- a dispatch pass takes well under a millisecond
local LOCK_WAIT_S = 1      -- an enqueue waits at most this long for the lock
local PASS_MOST = 256      -- dispatches per pass at most

local dict
local pid = ""
local RECLAIM_S = 5

-- init_worker() -> true | nil, err. Takes back what workers that are gone left waiting
-- (reclaim: at each worker's start, and every RECLAIM_S in worker 0).
function _M.init_worker()
    local err
    dict, err = shdict.get(DICT)
    if not dict then
        return nil, err
    end
    pid = tostring(ngx.worker.pid())
    _M.reclaim()
    if ngx.worker.id() == 0 then
        local ok, err = ngx.timer.every(RECLAIM_S, _M.reclaim)
        if not ok then
            return nil, "queue reclaim timer: " .. err
        end
    end
    return true
end

local function conf(doc)
    return doc.edge.queue
end

-- enabled(doc) -> whether requests queue (edge.queue.enabled)
function _M.enabled(doc)
    local c = conf(doc)
    return c.enabled == true and dict ~= nil
end

local function lock()
    return dict:add("lock", true, LOCK_TTL_S)
end

local function unlock()
    dict:delete("lock")
end

-- wait_lock() -> true | nil: the lock, waiting for it up to LOCK_WAIT_S (access phase)
local function wait_lock()
    local deadline = ngx_now() + LOCK_WAIT_S
    while not lock() do
        if ngx_now() >= deadline then
            return nil
        end
        ngx_sleep(0.001)
    end
    return true
end

local function qname(model, key_id)
    return model .. "\0" .. key_id
end

local function active()
    local list = {}
    for entry in gmatch(dict:get("act") or "", "[^\n]+") do
        list[#list + 1] = entry
    end
    return list
end

local function set_active(list)
    dict:set("act", concat(list, "\n"))
end

-- rank_of(level) -> the strict order of a priority: higher thresholds first
local function rank_of(level)
    return level.kv_cache_threshold * 1e6 + level.max_waiting
end

-- lowest_counter(list, except) -> the smallest counter of the keys waiting (nil: none)
local function lowest_counter(list, except)
    local low
    for _, entry in ipairs(list) do
        local k = sub(entry, (find(entry, "\0", 1, true)) + 1)
        if k ~= except then
            local v = dict:get("v:" .. k) or 0
            if not low or v < low then
                low = v
            end
        end
    end
    return low
end

-- headroom(model, level, prompt) -> whether a replica of model can take one more
-- dispatched request of this priority now (see the top).
local function headroom(model, level, prompt)
    local name = model.name
    local cap = model.max_concurrency or 0
    local free = 0
    for _, r in ipairs(model.upstreams) do
        if upstream.address(name, r) and not upstream.is_out(name, r)
                and admission.rank(name, r, level, prompt) ~= admission.FULL then
            if cap <= 0 then
                free = huge
                break
            end
            free = free + max(0, cap - upstream.in_flight(name, r))
        end
    end
    return free > (dict:get("p:" .. name) or 0)
end

local function retry_after(doc, model)
    local most = doc.edge.admission.max_retry_after_s
    local rate = 0
    for _, r in ipairs(model.upstreams) do
        rate = rate + (admission.finish_rate(model.name, r) or 0)
    end
    return admission.estimate(dict:get("N") or 0, rate, most)
end

local function count(key_id, prio, n, tokens)
    dict:incr("n:" .. key_id, n, 0)
    dict:incr("k:" .. key_id, tokens, 0)
    dict:incr("N", n, 0)
    dict:incr("T", tokens, 0)
    dict:incr("pn:" .. prio, n, 0)
    dict:incr("pt:" .. prio, tokens, 0)
end

-- ticket(id) -> {key, tokens, prompt, charge, pid, model, prio} of ticket id's "c:"
-- entry ("<key>\t<tokens>\t<prompt>\t<charge>\t<pid>\t<model>\t<priority>"; zeros
-- when gone)
ticket = function(id)
    local k, t, p, ch, owner, m, prio = match(dict:get("c:" .. id) or "",
        "^([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$")
    return { key = k, tokens = tonumber(t) or 0, prompt = tonumber(p) or 0,
             charge = tonumber(ch) or 0, pid = owner, model = m, prio = prio }
end

-- reclaim(premature): the tickets of workers that are gone (a crash, a kill after a
-- reload's shutdown timeout) leave their queue and give back their counts, the slot
-- of one dispatched and its charge: otherwise the queue would count them, and hold
-- every newcomer of their model behind them, for good.
function _M.reclaim(premature)
    if premature or not dict then
        return
    end
    local keys = dict:get_keys(0)
    for i = 1, #keys do
        local id = match(keys[i], "^c:(%d+)$")
        local info = id and ticket(id)
        if info and info.pid and info.pid ~= pid and not upstream.alive(info.pid)
                and dict:add("r:" .. id, true, 60) then -- one reclaimer per ticket
            local state = dict:get("t:" .. id)
            if state == 0 and dict:incr("t:" .. id, 2) == 2 then
                count(info.key, info.prio, -1, -info.tokens)
                dict:incr("w:" .. info.model, -1, 0)
            elseif state == 1 or state == 5 then
                if state == 1 then
                    dict:incr("w:" .. info.model, -1, 0)
                end
                dict:incr("p:" .. info.model, -1, 0)
                dict:incr("v:" .. info.key, -info.charge, 0)
            end
            dict:delete("c:" .. id)
            dict:delete("t:" .. id)
        end
    end
end

-- pass(doc): one dispatch pass (the lock held): for each model with requests waiting,
-- dispatch heads while a replica has headroom, the best key first (strict priority,
-- then the smallest counter). Queues found empty leave the active list.
local function pass(doc)
    local list = active()
    if #list == 0 then
        return
    end
    local keys, models = doc.keys_by_id, doc.models
    local done = 0
    local by_model = {} -- per model: its queues, each {entry, key, rank}
    for _, entry in ipairs(list) do
        local sep = find(entry, "\0", 1, true)
        local m, k = sub(entry, 1, sep - 1), sub(entry, sep + 1)
        local key, model = keys[k], models[m]
        if key and model then
            local q = by_model[m]
            if not q then
                q = {}
                by_model[m] = q
            end
            q[#q + 1] = { entry = entry, key = key, rank = rank_of(key.admission) }
        else
            -- a key or model a reload removed: its requests wait out their deadline
            dict:delete("q:" .. entry)
        end
    end
    for m, queues in pairs(by_model) do
        local model = models[m]
        while done < PASS_MOST do
            local pick, pick_v, pick_n
            for _, q in ipairs(queues) do
                if not q.empty then
                    local v = dict:get("v:" .. q.key.id) or 0
                    local n = dict:get("n:" .. q.key.id) or 0
                    if not pick or q.rank > pick.rank or (q.rank == pick.rank
                            and (v < pick_v or v == pick_v and n < pick_n)) then
                        pick, pick_v, pick_n = q, v, n
                    end
                end
            end
            if not pick then
                break
            end
            local id = dict:lpop("q:" .. pick.entry)
            if not id then
                pick.empty = true
            else
                local info = ticket(id)
                local tokens, prompt, charge = info.tokens, info.prompt, info.charge
                if dict:get("t:" .. id) ~= 0 then
                    -- it left (counted out by quit)
                elseif not headroom(model, pick.key.admission, prompt) then
                    dict:lpush("q:" .. pick.entry, id) -- back at the head
                    break -- strict: nothing of this model passes the best
                elseif dict:incr("t:" .. id, 1) == 1 then
                    dict:incr("p:" .. m, 1, 0)
                    dict:incr("v:" .. pick.key.id, charge, 0)
                    count(pick.key.id, pick.key.priority, -1, -tokens)
                    done = done + 1
                end
            end
        end
    end
    local left = {}
    for _, entry in ipairs(list) do
        if (dict:llen("q:" .. entry) or 0) > 0 then
            left[#left + 1] = entry
        end
    end
    set_active(left)
end

-- dispatch(doc): a dispatch pass, when no other worker runs one now.
function _M.dispatch(doc)
    if not dict or not lock() then
        return
    end
    local ok, err = pcall(pass, doc)
    unlock()
    if not ok then
        ngx_log(WARN, "tokengate queue: dispatch pass failed: ", err)
    end
end

-- busy(model_name) -> whether requests of the model wait (a newcomer queues behind)
function _M.busy(model_name)
    return dict ~= nil and (dict:get("w:" .. model_name) or 0) > 0
end

-- charge_of(c, prompt, out, share) -> the weighted tokens of a request in a counter
local function charge_of(c, prompt, out, share)
    return (c.prompt_weight * prompt + c.completion_weight * out) / share
end

-- quit(ctx) -> true when the request left its queue before it was dispatched (counted
-- out here); false when the dispatcher had picked it first (its ticket said so).
local function quit(ctx)
    local q = ctx.queue
    local v = dict:incr("t:" .. q.id, 2)
    if v == 3 then
        return false
    end
    dict:delete("c:" .. q.id)
    dict:delete("t:" .. q.id)
    q.left = true
    dict:incr("w:" .. q.model, -1, 0)
    count(ctx.key.id, q.prio, -1, -q.tokens)
    ctx.queue_ms = floor((ngx_now() - q.t0) * 1000 + 0.5)
    return true
end

-- wait(ctx, doc, prompt, out) -> true (dispatched: take a replica) | nil, err.
-- The request's key (ctx.key) queues for its model (ctx.model_entry); prompt: its
-- prompt tokens; out: its reserved completion tokens (all n choices). Errors: 429
-- queue_full (the key's bounds), 503 overloaded (the edge's bounds), 503
-- queue_timeout (its deadline: edge.queue.max_wait_ms, or X-Tokengate-Queue-Timeout-Ms
-- when lower), all with Retry-After. Leaves ctx.queue for finish() and settle(), and
-- ctx.queue_ms: the wait, ms.
function _M.wait(ctx, doc, prompt, out)
    local c = conf(doc)
    local key, model = ctx.key, ctx.model_entry
    local tokens = prompt + out
    local prio = key.priority
    local t0 = ngx_now()
    ctx.queue_ms = 0
    local wait_ms = c.max_wait_ms
    local asked = ngx.var.http_x_tokengate_queue_timeout_ms
    if asked and match(asked, "^%d+$") then
        wait_ms = min(wait_ms, tonumber(asked))
    end
    if not wait_lock() then
        metrics.queue_refused("full")
        return nil, admission.overloaded(model)
    end
    -- the bounds are checked and the request counted under the lock: a burst of one key
    -- over several workers cannot pass key_max_requests between check and count
    if (dict:get("n:" .. key.id) or 0) + 1 > c.key_max_requests
            or (dict:get("k:" .. key.id) or 0) + tokens > c.key_max_tokens then
        unlock()
        metrics.queue_refused("key_full")
        local s = retry_after(doc, model)
        return nil, errors.new(429, "Too many requests of key " .. errors.clip(key.id)
            .. " are waiting for model " .. errors.clip(model.name) .. " (at most "
            .. c.key_max_requests .. " requests and " .. c.key_max_tokens .. " tokens). "
            .. "Please retry after " .. s .. " s.", nil, "queue_full",
            "requests", { ["Retry-After"] = tostring(s) })
    end
    if (dict:get("N") or 0) + 1 > c.max_requests
            or (dict:get("T") or 0) + tokens > c.max_tokens then
        unlock()
        metrics.queue_refused("full")
        return nil, admission.overloaded(model)
    end
    local id = dict:incr("seq", 1, 0)
    local charge = charge_of(c, prompt, out, key.fair_share or 1)
    local ttl = c.max_wait_ms / 1000 + 60
    dict:set("t:" .. id, 0, ttl)
    dict:set("c:" .. id, concat({ key.id, tokens, prompt, charge, pid, model.name, prio },
        "\t"), ttl)
    local entry = qname(model.name, key.id)
    local list = active()
    local len = dict:rpush("q:" .. entry, id)
    if len == 1 then
        -- the lift: a key that was not waiting starts no lower than those waiting
        local low = lowest_counter(list, key.id)
        if low and low > (dict:get("v:" .. key.id) or 0) then
            dict:set("v:" .. key.id, low)
        end
        local present = false
        for _, e in ipairs(list) do
            if e == entry then
                present = true
                break
            end
        end
        if not present then
            list[#list + 1] = entry
            set_active(list)
        end
    end
    count(key.id, prio, 1, tokens)
    dict:incr("w:" .. model.name, 1, 0)
    local ok, err = pcall(pass, doc)
    unlock()
    if not ok then
        ngx_log(WARN, "tokengate queue: dispatch pass failed: ", err)
    end
    ctx.queue = { id = id, t0 = t0, charge = charge, tokens = tokens, prio = prio,
                  model = model.name, dispatched = false }
    local deadline = t0 + wait_ms / 1000
    local poll = c.poll_ms / 1000
    while true do
        if dict:get("t:" .. id) == 1 then
            return _M.dispatched(ctx)
        end
        local now = ngx_now()
        if now >= deadline then
            if not quit(ctx) then
                return _M.dispatched(ctx) -- dispatched just now
            end
            metrics.queue_refused("timeout")
            local s = retry_after(doc, model)
            return nil, errors.new(503, "The request waited " .. ctx.queue_ms .. " ms in "
                .. "the queue of model " .. errors.clip(model.name) .. " (its limit: "
                .. wait_ms .. " ms) and no replica could take it. Please retry after "
                .. s .. " s.", nil,
                "queue_timeout", nil, { ["Retry-After"] = tostring(s) })
        end
        -- at least 1 ms: ngx.sleep(0) only yields, and the cached clock it leaves may
        -- never reach the deadline (a spin that held a request forever)
        ngx_sleep(max(0.001, min(poll, deadline - now)))
        ngx_update_time()
        _M.dispatch(doc)
    end
end

-- dispatched(ctx) -> true: the request's ticket was dispatched (its queue wait ends).
function _M.dispatched(ctx)
    local q = ctx.queue
    q.dispatched = true
    dict:incr("t:" .. q.id, 4) -- seen (5): reclaim() knows its waiter counted it out
    ctx.queue_ms = floor((ngx_now() - q.t0) * 1000 + 0.5)
    dict:incr("w:" .. q.model, -1, 0)
    metrics.queue_wait(q.model, ngx_now() - q.t0)
    return true
end

-- took(ctx): a dispatched request took its replica (or gave up): one fewer pending.
function _M.took(ctx)
    local q = ctx.queue
    if q and q.dispatched and not q.took then
        q.took = true
        dict:delete("c:" .. q.id)
        dict:delete("t:" .. q.id)
        dict:incr("p:" .. q.model, -1, 0)
        metrics.queue_dispatched(ctx.key.id, q.model)
    end
end

-- finish(ctx): the start of the log phase of a request that queued (no yield): a
-- client that left while it waited is taken out of its queue (or, when the dispatcher
-- had just picked it, the slot and the charge are given back); a dispatched one that
-- never took its replica gives its slot back.
function _M.finish(ctx)
    local q = ctx.queue
    if not q or not dict or q.left then
        return
    end
    if q.dispatched then
        return _M.took(ctx)
    end
    if quit(ctx) then
        metrics.queue_refused("left")
        return
    end
    q.dispatched, q.took, q.settled = true, true, true
    dict:delete("c:" .. q.id)
    dict:delete("t:" .. q.id)
    dict:incr("w:" .. q.model, -1, 0)
    dict:incr("p:" .. q.model, -1, 0)
    dict:incr("v:" .. ctx.key.id, -q.charge, 0)
    metrics.queue_refused("left")
end

-- settle(ctx, doc, prompt, completion): the charge of a dispatched request, settled to
-- its billed prompt and completion tokens (the usage event's).
function _M.settle(ctx, doc, prompt, completion)
    local q = ctx.queue
    if not q or not dict or q.left or q.settled or not q.dispatched then
        return
    end
    q.settled = true
    local real = charge_of(conf(doc), prompt or 0, completion or 0, ctx.key.fair_share or 1)
    if real ~= q.charge then
        dict:incr("v:" .. ctx.key.id, real - q.charge, 0)
    end
end

-- depth() -> {[priority] = {requests, tokens}} waiting now (for the metrics)
function _M.depth(doc)
    local out = {}
    if not dict then
        return out
    end
    for name in pairs(doc.edge.admission.priorities) do
        out[name] = { requests = dict:get("pn:" .. name) or 0,
                      tokens = dict:get("pt:" .. name) or 0 }
    end
    return out
end

-- counter(key_id) -> the key's virtual token counter (weighted tokens; for tests and
-- the status page)
function _M.counter(key_id)
    return dict and dict:get("v:" .. key_id) or 0
end

return _M
