-- Access stage "count": how much the request costs. The prompt's tokens (the counter's
-- exact count, or an estimate: tokengate.count), the completion budget
-- (tokengate.output.budget) and the reservation every limit tier will take
-- (tokengate.limits.reservation, tokengate.budget.request); a route that the edge
-- answers from the count itself (the API module's LOCAL: count_tokens, input_tokens)
-- gets its answer here, sent once the request is admitted (tokengate.stages.admit).

local ngx = ngx
local json = require "tokengate.json"
local body_mod = require "tokengate.body"
local count = require "tokengate.count"
local limits = require "tokengate.limits"
local budget = require "tokengate.budget"
local prefix = require "tokengate.prefix"
local output = require "tokengate.output"
local trace = require "tokengate.trace"
local clock = require "tokengate.clock"

local mono_ms = clock.mono_ms
local ngx_now = ngx.now
local json_integer = json.integer

local _M = {}

-- prompt(ctx, doc) -> true | nil, err: the prompt's tokens, the completion budget and
-- the TPM reservation. The counter counts the body's text (tokengate.body.text: the
-- client's bytes unless validating, sanitizing or the API's adjust changed the body),
-- on the counter worker of the request's session (tokengate.session) while that worker
-- is not busier than the others (tokengate.count.prompt's affinity);
-- the completion budget may then write the output limit into the body, which changes
-- no prompt token.
function _M.prompt(ctx, doc)
    if ctx.no_body then
        return true
    end
    local route, body, model, api = ctx.route, ctx.body, ctx.model_entry, ctx.api
    local text = body_mod.text(body)
    local t = mono_ms()
    local counted, err = count.prompt(api.ENDPOINT[route], model.name, text, doc.edge,
        ctx.session_id)
    ctx.count_s = (mono_ms() - t) / 1000
    trace.span(ctx, "count", t)
    if not counted then
        return nil, err
    end
    ctx.token_estimate, ctx.count_source = counted.prompt, counted.source
    if ctx.history and counted.source == "counter" then
        -- the counter saw the body, not the stored history it continues
        ctx.count_source = "history"
    end
    ctx.system_tokens = counted.system
    ctx.prompt_count, ctx.n = counted.prompts, json_integer(body.n) or 1
    local routing = model.routing
    if routing and (routing.policy == "prefix" or routing.policy == "slo") then
        ctx.prefix_plan = prefix.plan(counted.reply, counted.prompt, routing)
    end
    if api.LOCAL[route] then
        -- answered here from the count: one request of the key's RPM, no tokens, no
        -- budget; an estimate is no answer
        if counted.source ~= "counter" then
            ctx.token_estimate, ctx.count_source = nil, nil -- (no X-Token-Count)
            return nil, count.CLOSED
        end
        local answer_text
        answer_text, err = api.count_answer(model, counted.prompt)
        if not answer_text then
            return nil, err
        end
        limits.reservation(ctx.limit_req, 0, 1, 0, 1, 0)
        ctx.local_answer = answer_text
        return true
    end
    local out
    out, err = output.budget(api, model, body, counted, ctx.key)
    if not out then
        return nil, err
    end
    -- the usage event's max_tokens_requested / max_tokens_applied, and the header that
    -- says the gateway's cap lowered the client's limit
    ctx.max_tokens_requested, ctx.max_tokens_applied = counted.requested, out
    ctx.max_tokens_capped_by = counted.capped_by
    local n = json_integer(body.n) or 1
    limits.reservation(ctx.limit_req, counted.prompt, counted.prompts, out, n,
        model.output_reserve)
    ctx.limit_req.estimated = counted.source == "estimate"
    ctx.limit_req.budget = budget.request(ctx.key, model, doc, counted.prompt,
        out * n * counted.prompts, ngx_now(), ctx.batch and model.cost.batch or 1)
    return true
end

return _M
