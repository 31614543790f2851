-- The global limit tier (see tokengate.limits for how tiers combine): one RPM/TPM window
-- per key in Redis, shared by every edge, through the tokengate-limits sidecar
-- (tokengate.v1.GlobalLimits, proto/tokengate/v1/limits.proto) and tokengate.sidecar;
-- and the key's budgets (tokengate.budget's counters, in Redis: ReserveBudget,
-- SettleBudget), which survive restarts and are shared by every edge.
--
-- Reserve is called in the access phase. Settle is needed in the log phase, where
-- cosockets do not exist: settlements are queued per worker and sent by timers. One
-- timer per settlement would create a fake request and a coroutine per request and hit
-- lua_max_running_timers (256) under load; instead at most DRAINERS timers per worker
-- each empty the queue. A settlement that cannot be sent leaves the reservation as
-- reserved until it slides out of the 60 s window (counted in global_settle_failed /
-- global_settle_dropped): the error is on the safe side. A budget settlement lost so
-- is made by the ledger when it applies the request's usage event, exactly once
-- (tokengate.ledger.budgets); until then Redis holds the worst case (safe too), or, for
-- a request admitted while Redis was unreachable, the ledger's bill of it.
--
-- Failure: when the sidecar (or Redis behind it) is down, answers UNAVAILABLE, or does
-- not answer within edge.global_limits_timeout_ms, the tier is skipped and the local
-- limits alone decide (X-Tokengate-Limits: local, counter global_fallback_<reason>). The
-- sidecar client's breaker then skips the tier for edge.global_limits_backoff_ms
-- (global_fallback_backoff), so an outage costs one timeout per backoff period. Budgets
-- alike: the edge's own budget counters decide with what Redis last said
-- (tokengate.budget.fallback; global_budget_fallback), and the settlement charges Redis
-- the real cost once it is back.

local ngx = ngx
local pb = require "tokengate.pb"
local sidecar = require "tokengate.sidecar"
local metrics = require "tokengate.metrics"
local budget = require "tokengate.budget"
local shdict = require "tokengate.shdict"

local timer_at, ngx_log = ngx.timer.at, ngx.log
local format = string.format
local ERR, WARN = ngx.ERR, ngx.WARN
local pcall, tostring = pcall, tostring
local ceil, max = math.ceil, math.max

local _M = { name = "global" }

local RESERVE = "/tokengate.v1.GlobalLimits/Reserve"
local SETTLE = "/tokengate.v1.GlobalLimits/Settle"
local RESERVE_BUDGET = "/tokengate.v1.GlobalLimits/ReserveBudget"
local REBUILDING = 3 -- BudgetLimit BUDGET_REBUILDING
local SETTLE_BUDGET = "/tokengate.v1.GlobalLimits/SettleBudget"
local QUOTA = "/tokengate.v1.GlobalLimits/Quota"
local SETTLED = { [SETTLE] = pb.settle_reply, [SETTLE_BUDGET] = pb.budget_settle_reply }
local LIMITED_BY = { [1] = "requests", [2] = "tokens" }
-- s: Retry-After of a request that can never fit, the same window as the local tier's
local WINDOW = require("tokengate.local_limit").WINDOW
local MAX_QUEUE = 10000 -- settlements waiting per worker
local DRAINERS = 4 -- timers sending settlements per worker
-- the sidecar client's failure reasons -> the fallback counters' names
local FALLBACK = { backoff = "backoff", down = "down", timeout = "timeout",
                   unavailable = "unavailable", status = "error", error = "error" }

local client -- tokengate.sidecar client of the limits sidecar
local shared -- the breaker's shared dict: also the settlements' failures (FAILING)
-- keys in shared: the time the settlements began to fail, and how many have failed since
local FAILING, FAILED = "settle_failing", "settle_failed"

-- init_worker(edge, hop_address, dict) -> true | nil, err. edge: the compiled edge section
-- (global_limits_timeout_ms, global_limits_backoff_ms); hop_address: the hop server;
-- dict: the breaker's shared dict.
function _M.init_worker(edge, hop_address, dict)
    local err
    client, err = sidecar.new("limits", hop_address, edge.global_limits_timeout_ms,
        edge.global_limits_backoff_ms, dict)
    shared = dict
    return client ~= nil, err
end

-- state(r, limits) -> a limit state (x-ratelimit-* headers, see tokengate.limits) from a
-- ReserveReply: remaining and reset are Redis's, across all edges.
local function state(r, limits)
    return {
        rpm = limits.rpm, tpm = limits.tpm,
        remaining_requests = r.remaining_requests, remaining_tokens = r.remaining_tokens,
        reset_requests = r.reset_requests_ms / 1000, reset_tokens = r.reset_tokens_ms / 1000,
    }
end

-- fallback(failure, what) -> the fallback counters' reason; logged unless it is part of
-- an outage (tokengate.sidecar logs those once). what: what decides instead.
local function fallback(failure, what)
    local reason = FALLBACK[failure.reason] or "error"
    if not failure.outage then -- an outage is logged once, by tokengate.sidecar
        ngx_log(WARN, "tokengate: global limits ", reason, " (", failure.message,
            "): admitting on ", what)
    end
    return reason
end

-- incoming(req) -> state | nil, refused state | nil, nil (the tier failed: skipped)
--   req = {key_id, model, per_model (limits are the key's override for model),
--          limits = {rpm, tpm}, tokens, request_id ($request_id: retries are idempotent,
--          and it is Settle's handle), windows (the key's team's and organization's,
--          reserved in the same script: all or none)}
--   refused state: st.reject = "requests" | "tokens", st.retry_after (whole s, >= 1),
--   st.alone (can never fit).
function _M.incoming(req)
    local msg, failure = client:call(RESERVE, pb.reserve_request(req.key_id, req.model,
        req.per_model, req.limits.rpm, req.limits.tpm, req.tokens, req.request_id,
        req.windows))
    local r, err
    if msg then
        r, err = pb.reserve_reply(msg)
        if not r then
            failure = { reason = "error", message = "reply: " .. err }
        end
    end
    if not r then
        metrics.incr("global_fallback_" .. fallback(failure, "local limits"))
        return nil, nil
    end
    -- whose window the numbers are: the key's, or the level's (the one that refused,
    -- or the tightest)
    local lv = r.level > 0 and req.windows[r.level] or nil
    local st = state(r, lv or req.limits)
    st.level = lv
    if r.admitted then
        metrics.incr("global_admitted")
        return st
    end
    metrics.incr("global_refused")
    st.reject = LIMITED_BY[r.limited_by] or "tokens"
    st.alone = r.never_fits
    st.retry_after = r.never_fits and WINDOW or max(1, ceil(r.retry_after_ms / 1000))
    return nil, st
end

-- reserve_budget(bud, request_id) -> true | nil, refusal {index, kind, used} | nil, nil
--   (the tier failed: the edge's own counters and what Redis last said decided,
--   tokengate.budget.fallback). bud: a tokengate.budget reservation already admitted by
--   the edge's counters; admitted: each item's spent / used become Redis's totals
--   (every edge's). refusal: items[index] refused, kind "spend" | "tokens", used: its
--   total before this request (nano-units or tokens); or kind "unknown" (fallback: a
--   budget Redis has not answered for since this nginx started); or kind "rebuilding"
--   (a ledger rebuilds the key's spend after Redis lost its data: BudgetLimit
--   BUDGET_REBUILDING in limits.proto).
function _M.reserve_budget(bud, request_id)
    local items = bud.items
    local msg, failure = client:call(RESERVE_BUDGET, pb.budget_request(bud.key_id,
        request_id, items, bud.cost, bud.tokens))
    local r, err
    if msg then
        r, err = pb.budget_reserve_reply(msg)
        if r and r.limited_by == REBUILDING then
            -- Redis lost its data and a ledger rebuilds the bill: Redis's numbers are not
            -- whole, so neither they nor this edge's own (learn) decide until it is done
            metrics.incr("global_budget_refused")
            return nil, { index = 1, kind = "rebuilding" }
        end
        if r and (#r.usage ~= #items or (not r.admitted and not items[r.refused])) then
            r, err = nil, "usage of " .. #r.usage .. " counters (refused "
                .. tostring(r.refused) .. "), not " .. #items
        end
        if not r then
            failure = { reason = "error", message = "reply: " .. err }
        end
    end
    if not r then
        fallback(failure, "the edge's budget counters")
        metrics.incr("global_budget_fallback")
        return nil, budget.fallback(bud)
    end
    budget.learn(bud, r.usage, r.admitted)
    if r.admitted then
        metrics.incr("global_budget_admitted")
        return true
    end
    metrics.incr("global_budget_refused")
    local u = r.usage[r.refused]
    local kind = r.limited_by == 2 and "tokens" or "spend"
    return nil, { index = r.refused, kind = kind,
                  used = kind == "tokens" and u.tokens or u.spent_nano }
end

-- quota(key_id, windows, items) -> reply {windows, counters} (tokengate.pb.quota_reply)
-- | nil, err: what Redis holds now for the key's window and its levels' (windows:
-- {id}) and for the budget counters of items (tokengate.budget.items); nothing is
-- reserved. err: why the sidecar did not answer (the caller answers from this edge's
-- own counters).
function _M.quota(key_id, windows, items)
    local msg, failure = client:call(QUOTA, pb.quota_request(key_id, windows, items))
    if not msg then
        return nil, failure.message
    end
    local r, err = pb.quota_reply(msg)
    if r and (#r.windows ~= #windows + 1 or #r.counters ~= #items) then
        r, err = nil, "quota reply of " .. #r.windows .. " windows, " .. #r.counters
            .. " counters"
    end
    return r, err
end

-- ------------------------------------------------------------------ settlement

-- worker-local FIFO of serialized SettleRequests / BudgetSettleRequests, and their paths
local queue, paths, qhead, qtail = {}, {}, 1, 0
local running = 0 -- drainer timers alive in this worker

-- settle_failed(why): one settlement was not made. Logged once per run of failures (a
-- limits or Redis outage fails every settlement until it ends: one line each made
-- hundreds), whichever worker saw the first; counted in shared until settle_made.
local function settle_failed(why)
    metrics.incr("global_settle_failed")
    shared:incr(FAILED, 1, 0)
    if shdict.run_began(shared, FAILING) then
        ngx_log(WARN, "tokengate: global limits settlements failing (", why, "): their "
            .. "reservations stay until their window passes, the budgets' until the "
            .. "ledger settles them; counted and logged when one is made again")
    end
end

-- settle_made(): one settlement was made; ends a run of failures, logged once with how
-- many failed (shdict.run_over: one worker logs it).
local function settle_made()
    metrics.incr("global_settled")
    local took = shdict.run_over(shared, FAILING)
    if took then
        local failed = shared:get(FAILED) or 0
        shared:delete(FAILED)
        ngx_log(WARN, "tokengate: global limits settlements made again; ", failed,
            " failed over ", format("%.1f", took), " s")
    end
end

-- drain(): timer handler; sends queued settlements until the queue is empty (also when
-- the worker is exiting: a settlement sent late still corrects the shared window).
local function drain()
    local ok, perr = pcall(function()
        while qhead <= qtail do
            local msg, path = queue[qhead], paths[qhead]
            queue[qhead], paths[qhead] = nil, nil
            qhead = qhead + 1
            local reply, failure = client:call(path, msg)
            if reply and SETTLED[path](reply) then
                settle_made()
            else
                settle_failed(failure and failure.message or "bad reply")
            end
        end
    end)
    if not ok then
        ngx_log(ERR, "tokengate: global limits settle: ", perr)
    end
    if qhead > qtail then
        qhead, qtail = 1, 0
    end
    running = running - 1
end

-- enqueue(path, msg): sends the settlement msg (serialized) to path, asynchronously
-- (callable from the log phase; never blocks).
local function enqueue(path, msg)
    if qtail - qhead + 1 >= MAX_QUEUE then
        metrics.incr("global_settle_dropped")
        return
    end
    qtail = qtail + 1
    queue[qtail], paths[qtail] = msg, path
    -- one more drainer while there is more queued than the running ones are taking
    if running < DRAINERS and qtail - qhead + 1 > running then
        local ok, err = timer_at(0, drain)
        if ok then
            running = running + 1
        elseif running == 0 then
            -- no timer left: the queue waits for the next settlement to start one
            ngx_log(ERR, "tokengate: global limits settle timer: ", err)
        end
    end
end

-- settle_window(req, actual): sets the request's Redis reservation to actual tokens.
local function settle_window(req, actual)
    enqueue(SETTLE, pb.settle_request(req.key_id, req.model, req.per_model, req.request_id,
        actual, req.windows))
end

-- uncommit(req): a later tier refused: nothing of the reservation was used.
function _M.uncommit(req)
    settle_window(req, 0)
end

-- settle(req, actual): the request ended having used actual tokens (prompt + completion).
function _M.settle(req, actual)
    if actual ~= req.tokens then
        settle_window(req, actual)
    end
end

-- settle_budget(bud, request_id, tokens, cost_nano): the request the edge's budget
-- counters admitted ended having used tokens that cost cost_nano (nano-units): Redis
-- corrects its reservation, or charges the real cost when it holds none (the
-- reservation failed). Always sent: it also ends the reservation's record in Redis.
function _M.settle_budget(bud, request_id, tokens, cost_nano)
    enqueue(SETTLE_BUDGET, pb.budget_request(bud.key_id, request_id, bud.items, cost_nano,
        tokens))
end

-- backing_off() -> true while the tier is skipped after a failure (for /tokengate/status)
function _M.backing_off()
    return client ~= nil and client:backing_off()
end

return _M
