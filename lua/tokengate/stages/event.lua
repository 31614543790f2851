-- Log stage "event": the usage event line (written by the location's access_log right
-- after the log handler: verified with Debian's nginx 1.22 + lua 0.10.23 that access_log
-- runs after log_by_lua and sees variables it set) and the sampled access-log line
-- (tokengate.sampling); a request without a valid API key writes no event.

local ngx = ngx
local config = require "tokengate.config"
local json = require "tokengate.json"
local metrics = require "tokengate.metrics"
local sampling = require "tokengate.sampling"
local usage = require "tokengate.usage"

local ngx_var = ngx.var

local _M = {}

-- unauthenticated(ctx, status, aborted): the log phase of a request without a valid
-- API key (401, a blocked client's 429, what nginx refused): no usage event (the
-- ledger bills keys; a flood of random keys must not grow the usage file or Redis),
-- one status counter, and an access-log line for the first
-- edge.auth_failures.log_lines_per_s of each second (per worker).
function _M.unauthenticated(ctx, status, aborted)
    local doc = config.get()
    metrics.incr(ctx.unauthenticated or "unauthenticated_refused")
    metrics.request(ctx, status, nil, doc.models)
    if doc.access_log.file == "" or
            not sampling.keep_unauthenticated(doc.edge.auth_failures.log_lines_per_s) then
        return
    end
    local ev = usage.record(ctx, status, aborted)
    ngx_var.tg_access_line = usage.line(ev, usage.access_fields(ctx, "unauthenticated",
        json.null))
    metrics.incr("access_log_lines")
    metrics.incr("unauthenticated_log_lines")
end

-- write(ctx, ev, status): the usage event's line, and the access log's when sampled
-- (decided on the same rounded total_ms the event records).
function _M.write(ctx, ev, status)
    ngx_var.tg_usage_line = usage.line(ev)
    if config.get().access_log.file == "" then
        return
    end
    local kept, tier, rate = sampling.keep(config.rules(), ev.request_id, status, ev.total_ms)
    if kept then
        ngx_var.tg_access_line = usage.line(ev, usage.access_fields(ctx, tier, rate))
        metrics.incr("access_log_lines")
    end
end

return _M
