-- Count drift: the counter's prompt tokens for a request against the usage.prompt_tokens
-- vLLM reported for it. The contract (DESIGN.md §2.1) makes them equal; a difference
-- means the upstream is not the vLLM the counter mirrors (another release, another model
-- directory or chat template, a changed flag), so admission and reservations run on
-- numbers that billing later contradicts. Billing itself keeps vLLM's number; drift is
-- recorded so that it is seen on the first request: the usage event's count_drift, the
-- status counters count_drift_requests and count_drift_tokens, and a warning in nginx's
-- error log at most once per WARN_EVERY_S per model and replica (all workers together),
-- so a systematic drift does not flood the log.
--
-- ctx fields read: count_source, token_estimate (the edge's count), prompt_count,
-- n (set by tokengate.stages.count), u_source, u_prompt (tokengate.usage), model, replica.

local ngx = ngx
local metrics = require "tokengate.metrics"

local ngx_log, WARN = ngx.log, ngx.WARN
local abs = math.abs

local _M = {}

local WARN_EVERY_S = 60

-- of(ctx) -> vLLM's usage.prompt_tokens - the edge's count, tokens; 0 when they agree or
-- cannot be compared: the edge's count is an estimate (count_source "estimate": the
-- counter was down) or none, vLLM reported no usage, or the request has several
-- completions prompts or n > 1 (vLLM's per-chunk usage then reports one prompt or one
-- choice at a time, vllm/entrypoints/openai/completion/serving.py, so a client that
-- leaves mid-stream leaves a partial number).
function _M.of(ctx)
    if ctx.count_source ~= "counter" or not ctx.u_source or not ctx.u_prompt then
        return 0
    end
    if (ctx.prompt_count or 1) ~= 1 or (ctx.n or 1) ~= 1 then
        return 0
    end
    return ctx.u_prompt - (ctx.token_estimate or 0)
end

-- report(ctx, drift): the status counters and the rate-limited warning of a request
-- whose drift (of()'s value) is not 0.
function _M.report(ctx, drift)
    if drift == 0 then
        return
    end
    metrics.incr("count_drift_requests")
    metrics.incr("count_drift_tokens", abs(drift))
    local replica = ctx.replica and ctx.replica.name or "-"
    local model = ctx.model or "-"
    if not metrics.first_in("count_drift_warned\0" .. model .. "\0" .. replica,
            WARN_EVERY_S) then
        return
    end
    ngx_log(WARN, "tokengate: count drift: model ", model, " replica ", replica,
        " reported ", ctx.u_prompt, " prompt tokens where the counter counted ",
        ctx.token_estimate, " (count_drift ", drift > 0 and "+" or "", drift, "); ",
        metrics.get("count_drift_requests"), " drifted request(s) since nginx started ",
        "(count_drift_requests); run `tokengate doctor` (at most one such warning per ",
        WARN_EVERY_S, " s per model and replica)")
end

return _M
