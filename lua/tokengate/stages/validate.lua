-- Access stage "validate": what the request asks for and whose it is. The body is read
-- and parsed strictly, checked, sanitized and adjusted by the route's API module
-- (ctx.api: validate, sanitize, adjust, check), names a model the key may use and that
-- the API's kind of vLLM runner serves, its completion limit is checked against the
-- context (tokengate.output.check); the agent session comes from its headers, then the
-- body. Every function returns a value | nil, err (tokengate.errors).

local body_mod = require "tokengate.body"
local limits = require "tokengate.limits"
local models = require "tokengate.models"
local output = require "tokengate.output"
local session = require "tokengate.session"

local _M = {}

-- body(ctx, doc) -> body | nil, err: the body parsed strictly and validated by the API
-- module, the model it names (whose limits then apply; served by the API's kind of vLLM
-- runner, else 400 model_not_supported: an embedding model takes only embeddings),
-- sanitized (every rewrite marks the body changed), with the API module's adjustments
-- made before the count and its references checked.
function _M.body(ctx, doc)
    if ctx.no_body then
        return true
    end
    local route, edge, api = ctx.route, doc.edge, ctx.api
    local body, err = body_mod.parse(route, doc.models, edge, api)
    if not body then
        ctx.model, ctx.stream = err.model, err.stream
        return nil, err
    end
    -- what the client asked for, also in the event of a request refused before the
    -- API's adjust or placed (which set it again)
    ctx.stream = body.stream == true
    if not models.allowed(ctx.key, body.model) then
        return models.not_found(body.model)
    end
    local model = doc.models[body.model]
    ctx.model, ctx.model_entry = model.name, model
    limits.model(ctx.limit_req, ctx.key, model.name)
    ctx.rate = limits.peek(ctx.limit_req)
    local served
    served, err = models.serves(model, api.RUNNER, ctx.uri)
    if not served then
        return nil, err
    end
    local counts
    counts, err = api.sanitize(body, model, edge)
    if not counts then
        return nil, err
    end
    ctx.sanitized = counts
    if counts.removed + counts.stripped + counts.escaped + counts.collapsed > 0 then
        body_mod.changed(body) -- every rewrite of the sanitizer is counted
    end
    api.adjust(ctx, body, model)
    local ok
    ok, err = output.check(api, route, body, model)
    if not ok then
        return nil, err
    end
    ok, err = api.check(ctx, doc, body)
    if not ok then
        return nil, err
    end
    ctx.body = body
    return body
end

-- session(ctx, doc) -> true | nil, err (403 session_budget_exceeded): the agent session
-- the request belongs to (tokengate.session: its headers, read when access began, then
-- the body's fields), refused once the key's session_budget is spent.
function _M.session(ctx, doc)
    session.read(ctx, ctx.body)
    return session.check(ctx, doc)
end

return _M
