-- Log stage "settle": what the request used, given back to everything that held a share
-- of it: the key's queue (tokengate.queue), every limit tier and budget
-- (tokengate.limits.settle: the reservation corrected to what is billed), the agent
-- session's spend (tokengate.session), the replica's outstanding tokens and prefix-cache
-- blocks (tokengate.upstream, tokengate.prefix); a count drift is noted
-- (tokengate.drift) and the request counted in the metrics.

local ngx = ngx
local config = require "tokengate.config"
local limits = require "tokengate.limits"
local budget = require "tokengate.budget"
local metrics = require "tokengate.metrics"
local upstream = require "tokengate.upstream"
local prefix = require "tokengate.prefix"
local queue = require "tokengate.queue"
local session = require "tokengate.session"
local drift = require "tokengate.drift"

local ngx_var = ngx.var
local floor = math.floor

local _M = {}

-- finish(ctx): the request leaves its key's queue's count of running requests (before
-- the usage event is built, tokengate.queue.finish).
function _M.finish(ctx)
    if ctx.queue then
        queue.finish(ctx)
    end
end

-- settle(ctx, ev, status): ev: the request's usage event (tokengate.usage.record);
-- status: the status sent. The request's cost is worked out once, for the key's budgets
-- and its session's.
function _M.settle(ctx, ev, status)
    local doc = config.get()
    if ctx.queue then
        queue.settle(ctx, doc, ev.prompt_tokens, ev.completion_tokens)
    end
    local req = ctx.limit_req
    local need_cost = (req and req.budget) or (ctx.session_id and session.needs_cost(ctx.key))
    local cost = need_cost and ctx.model_entry and budget.cost(ctx.model_entry.cost,
        doc.billing, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens,
        ev.system_tokens) or nil
    if cost and ctx.batch then
        -- a batch line's price (tokengate.batch), as the ledger bills it
        cost = cost * ctx.model_entry.cost.batch
    end
    if req then
        limits.settle(req, ev.prompt_tokens + ev.completion_tokens, req.budget and cost,
            limits.charged(req, ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens))
    end
    if ctx.session_id then
        session.settle(ctx, ev.prompt_tokens + ev.completion_tokens,
            session.needs_cost(ctx.key) and cost or nil)
        if ctx.response_id and status < 400 then
            session.remember(ctx, ctx.response_id)
        end
    end
    drift.report(ctx, ev.count_drift)
    metrics.request(ctx, status, ev, doc.models, ngx_var.upstream_connect_time)
    if ctx.replica then
        -- the last try's failure never reaches the balancer: count it here
        if ctx.error == "upstream_unavailable" or ctx.error == "upstream_timeout" then
            upstream.failed(ctx.model, ctx.replica, ctx.error)
        end
        upstream.release(ctx)
        local plan = ctx.prefix_plan
        if plan and ctx.proxied then
            -- the generated tokens' full blocks take the replica's cache too
            local p, bs = ev.prompt_tokens, plan.bs
            prefix.generated(ctx.model, ctx.replica,
                floor((p + ev.completion_tokens) / bs) - floor(p / bs))
        end
    end
end

return _M
