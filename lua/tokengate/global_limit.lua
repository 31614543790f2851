-- The global limit tier (see tokengate.limits for how tiers combine): one RPM/TPM window
-- per key in Redis, shared by every edge, through the tokengate-limits sidecar
-- (tokengate.v1.GlobalLimits, proto/tokengate/v1/limits.proto) and tokengate.sidecar.
--
-- Reserve is called in the access phase. Settle is needed in the log phase, where
-- cosockets do not exist: settlements are queued per worker and sent by timers. One
-- timer per settlement would create a fake request and a coroutine per request and hit
-- lua_max_running_timers (256) under load; instead at most DRAINERS timers per worker
-- each empty the queue. A settlement that cannot be sent leaves the reservation as
-- reserved until it slides out of the 60 s window (counted in global_settle_failed /
-- global_settle_dropped): the error is on the safe side.
--
-- Failure: when the sidecar (or Redis behind it) is down, answers UNAVAILABLE, or does
-- not answer within edge.global_limits_timeout_ms, the tier is skipped and the local
-- limits alone decide (X-Tokengate-Limits: local, counter global_fallback_<reason>). The
-- sidecar client's breaker then skips the tier for edge.global_limits_backoff_ms
-- (global_fallback_backoff), so an outage costs one timeout per backoff period.

local ngx = ngx
local pb = require "tokengate.pb"
local sidecar = require "tokengate.sidecar"
local metrics = require "tokengate.metrics"

local timer_at = ngx.timer.at
local ngx_log = ngx.log
local ERR = ngx.ERR
local WARN = ngx.WARN
local pcall = pcall
local ceil = math.ceil
local max = math.max

local _M = { name = "global" }

local RESERVE = "/tokengate.v1.GlobalLimits/Reserve"
local SETTLE = "/tokengate.v1.GlobalLimits/Settle"
local LIMITED_BY = { [1] = "requests", [2] = "tokens" }
-- s: Retry-After of a request that can never fit, the same window as the local tier's
local WINDOW = require("tokengate.local_limit").WINDOW
local MAX_QUEUE = 10000 -- settlements waiting per worker
local DRAINERS = 4 -- timers sending settlements per worker
-- the sidecar client's failure reasons -> the fallback counters' names
local FALLBACK = { backoff = "backoff", down = "down", timeout = "timeout",
                   unavailable = "unavailable", status = "error", error = "error" }

local client -- tokengate.sidecar client of the limits sidecar

-- init_worker(edge, hop_address, dict) -> true | nil, err. edge: the compiled edge section
-- (global_limits_timeout_ms, global_limits_backoff_ms); hop_address: the hop server;
-- dict: the breaker's shared dict.
function _M.init_worker(edge, hop_address, dict)
    local err
    client, err = sidecar.new("limits", hop_address, edge.global_limits_timeout_ms,
        edge.global_limits_backoff_ms, dict)
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

-- incoming(req) -> state | nil, refused state | nil, nil (the tier failed: skipped)
--   req = {key_id, model, per_model (limits are the key's override for model),
--          limits = {rpm, tpm}, tokens, request_id ($request_id: retries are idempotent,
--          and it is Settle's handle)}
--   refused state: st.reject = "requests" | "tokens", st.retry_after (whole s, >= 1),
--   st.alone (can never fit).
function _M.incoming(req)
    local msg, failure = client:call(RESERVE, pb.reserve_request(req.key_id, req.model,
        req.per_model, req.limits.rpm, req.limits.tpm, req.tokens, req.request_id))
    local r, err
    if msg then
        r, err = pb.reserve_reply(msg)
        if not r then
            failure = { reason = "error", message = "reply: " .. err }
        end
    end
    if not r then
        local reason = FALLBACK[failure.reason] or "error"
        metrics.incr("global_fallback_" .. reason)
        if reason ~= "backoff" then
            ngx_log(WARN, "tokengate: global limits ", reason, " (", failure.message,
                "): admitting on local limits")
        end
        return nil, nil
    end
    local st = state(r, req.limits)
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

-- ------------------------------------------------------------------ settlement

local queue, qhead, qtail = {}, 1, 0 -- worker-local FIFO of serialized SettleRequests
local running = 0 -- drainer timers alive in this worker

-- drain(): timer handler; sends queued settlements until the queue is empty (also when
-- the worker is exiting: a settlement sent late still corrects the shared window).
local function drain()
    local ok, perr = pcall(function()
        while qhead <= qtail do
            local msg = queue[qhead]
            queue[qhead] = nil
            qhead = qhead + 1
            local reply, failure = client:call(SETTLE, msg)
            if reply and pb.settle_reply(reply) then
                metrics.incr("global_settled")
            else
                metrics.incr("global_settle_failed")
                ngx_log(WARN, "tokengate: global limits settle failed: ",
                    failure and failure.message or "bad reply")
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

-- enqueue(req, actual): sets the request's Redis reservation to actual tokens,
-- asynchronously (callable from the log phase; never blocks).
local function enqueue(req, actual)
    if qtail - qhead + 1 >= MAX_QUEUE then
        metrics.incr("global_settle_dropped")
        return
    end
    qtail = qtail + 1
    queue[qtail] = pb.settle_request(req.key_id, req.model, req.per_model, req.request_id,
        actual)
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

-- uncommit(req): a later tier refused: nothing of the reservation was used.
function _M.uncommit(req)
    enqueue(req, 0)
end

-- settle(req, actual): the request ended having used actual tokens (prompt + completion).
function _M.settle(req, actual)
    if actual ~= req.tokens then
        enqueue(req, actual)
    end
end

-- backing_off() -> true while the tier is skipped after a failure (for /tokengate/status)
function _M.backing_off()
    return client ~= nil and client:backing_off()
end

return _M
