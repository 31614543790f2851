-- The answer on its way out (header and body filters): the headers every answer
-- carries (X-Request-Id, the limits, the count, the replica, CORS), errors in the
-- request's API's shape (what nginx made itself, a backend's non-JSON error, the
-- backend's own JSON error rewritten), and the usage watch (tokengate.usage).

local ngx = ngx
local config = require "tokengate.config"
local errors = require "tokengate.errors"
local budget = require "tokengate.budget"
local usage = require "tokengate.usage"
local state = require "tokengate.state"
local cors = require "tokengate.cors"
local trace = require "tokengate.trace"
local clock = require "tokengate.clock"
local slo = require "tokengate.slo"

local ngx_var = ngx.var
local mono_ms = clock.mono_ms
local find, format = string.find, string.format
local concat = table.concat
local type, tostring = type, tostring

local _M = {}

-- is_json(content_type) -> true when the header value names a JSON body
local function is_json(ct)
    if type(ct) == "table" then
        ct = ct[1]
    end
    return ct ~= nil and find(ct, "json", 1, true) ~= nil
end

-- headers(ctx): the header filter. Headers every answer carries; an error page nginx
-- made itself (a backend down or slow, a body that timed out) or a non-JSON error from
-- the backend becomes an error in the API's shape (body() sends it); so does the
-- backend's 4xx JSON error, rewritten by body() (no Content-Length: its length changes).
function _M.headers(ctx)
    local h = ngx.header
    -- the usage event's request_id; vLLM also uses it in its response ids
    h["X-Request-Id"] = state.request_id(ctx)
    if ctx.trace then
        h["traceparent"] = trace.header(ctx)
    end
    if ctx.rate then
        ctx.api.rate_headers(h, ctx.rate)
        -- the level whose window the headers show (the tightest; tokengate.limits)
        if ctx.rate.level then
            h["X-Tokengate-Limit-Level"] = ctx.rate.level.level
        end
    end
    local req = ctx.limit_req
    if req and req.budget then
        budget.headers(h, req.budget)
    end
    if ctx.token_estimate then
        h["X-Token-Count"] = ctx.token_estimate
        h["X-Token-Count-Source"] = ctx.count_source
    end
    if ctx.limits_tier then
        h["X-Tokengate-Limits"] = ctx.limits_tier
    end
    if ctx.max_tokens_capped_by then
        h["X-Tokengate-Max-Tokens-Capped"] = format("%d -> %d (%s cap)",
            ctx.max_tokens_requested, ctx.max_tokens_applied, ctx.max_tokens_capped_by)
    end
    if ctx.queue_ms then
        h["X-Tokengate-Queue-Ms"] = ctx.queue_ms
    end
    local t = ctx.slo
    if t and t.decision then
        h["X-Tokengate-SLO"] = slo.header(t)
    end
    if ctx.replica then
        h["X-Tokengate-Upstream"] = ctx.replica.name
        if ctx.prefix_source then
            h["X-Tokengate-Expected-Cached-Tokens"] = ctx.prefix_expected
            h["X-Tokengate-Expected-Cached-Source"] = ctx.prefix_source
        end
    end
    cors.headers(ctx, h, config.get().edge.cors)
    local status = ngx.status
    if status >= 400 and not is_json(h["Content-Type"]) then
        if ctx.proxied and status == 504 and ngx_var.upstream_connect_time == "-" then
            status = 503 -- never connected: unavailable rather than slow
            ngx.status = status
        end
        local err = errors.nginx(status, ctx.proxied)
        local text = errors.render(ctx, err)
        ctx.replace_body, ctx.error = text, err.code
        h["Content-Type"] = "application/json"
        h["Content-Length"] = #text
        if ctx.proxied and status >= 502 and status <= 504 then
            h["Retry-After"] = tostring(config.get().edge.upstream_retry_after_s)
        end
    elseif ctx.proxied and status >= 400 then
        -- the backend refused or failed the request (vLLM's JSON error, a stream's too:
        -- vLLM refuses before the first chunk): body() answers it in the API's shape
        ctx.upstream_error = {}
        h["Content-Length"] = nil
        status = errors.upstream_status(status)
        ngx.status = status
    elseif ctx.proxied then
        local ct = h["Content-Type"]
        if type(ct) == "table" then
            ct = ct[1]
        end
        if ct and find(ct, "text/event-stream", 1, true) then
            ctx.sse = true
            h["Content-Length"] = nil
        end
    end
    ctx.status_sent = status
end

-- upstream_error(ctx, chunk, eof) -> what to send of the backend's error body: nothing
-- until eof, then the whole body in the API's shape (tokengate.errors.upstream; its code
-- or type becomes the usage event's error), or unchanged when it is no JSON error
-- object. A body above MAX_UPSTREAM_ERROR bytes is no error object vLLM writes (its
-- messages are bounded): it passes unchanged from there on.
local MAX_UPSTREAM_ERROR = 65536
local function upstream_error(ctx, chunk, eof)
    local parts = ctx.upstream_error
    parts[#parts + 1] = chunk
    parts.bytes = (parts.bytes or 0) + #chunk
    if not eof and parts.bytes <= MAX_UPSTREAM_ERROR then
        return ""
    end
    ctx.upstream_error = nil
    local text = concat(parts)
    local err = eof and errors.upstream(ctx.status_sent, text)
    if not err then
        return text
    end
    err = ctx.api.upstream_error(ctx, err)
    ctx.error = err.code or err.type
    return errors.render(ctx, err)
end

-- body(ctx, chunk, eof) -> the text to send of this body_filter call: the replacement
-- error body, the backend's error in the API's shape, or what the usage watch passes
-- (tokengate.usage); nil: the chunk unchanged.
function _M.body(ctx, chunk, eof)
    local replace, rewrite = ctx.replace_body, ctx.upstream_error
    local out
    if replace then
        out = eof and replace or ""
    elseif rewrite then
        out = upstream_error(ctx, chunk, eof)
    end
    if not ctx.proxied then
        return out
    end
    if not ctx.t_first and chunk ~= "" then
        ctx.t_first = mono_ms()
        slo.first(ctx, not (replace or rewrite))
    end
    if eof then
        ctx.eof = true
    end
    if replace or rewrite then
        return out
    end
    if ctx.sse then
        return usage.sse(ctx, chunk, eof)
    end
    usage.whole(ctx, chunk, eof)
    return nil
end

return _M
