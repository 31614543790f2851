-- Access stage "admit": the request's reservation in every limit tier (tokengate.limits:
-- the key's RPM and TPM windows, local and global, then its budgets), or 429; a request
-- the edge answers itself (count_tokens, input_tokens) gets that answer once admitted.

local reply = require "tokengate.reply"
local limits = require "tokengate.limits"
local upstream = require "tokengate.upstream"
local trace = require "tokengate.trace"
local clock = require "tokengate.clock"

local mono_ms = clock.mono_ms

local _M = {}

-- reserve(ctx) -> true | nil, err (429): the reservation in every limit tier, with the
-- prompt tokens the replica is expected to serve from its prefix cache weighed
-- (tokengate.limits.weigh). A refused request gives its replica's share back.
function _M.reserve(ctx)
    local req = ctx.limit_req
    if ctx.model_entry then
        -- the replica's expected prefix-cache hits count cached_tokens_weight each
        limits.weigh(req, limits.cached_weight(ctx.key, ctx.model_entry), ctx.prefix_expected)
    end
    local t = mono_ms()
    local ok, err = limits.reserve(req)
    trace.span(ctx, "limits", t)
    ctx.rate, ctx.limits_tier = req.state, req.tier
    if not ok then
        upstream.release(ctx, true)
    end
    return ok, err
end

-- answer(ctx) -> true, or the edge's own answer (count_tokens) once it is admitted.
function _M.answer(ctx)
    local text = ctx.local_answer
    if not text then
        return true
    end
    return reply.send(200, text)
end

return _M
