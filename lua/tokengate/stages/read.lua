-- Access stage "read": who asks (the API key, in the request's API's header) and for
-- which route (a known path with a method it takes). The model list and a model's entry
-- are answered here; a route that names a stored response is checked against the key
-- (the API module's stored()). Every function returns true | nil, err (tokengate.errors).

local ngx = ngx
local reply = require "tokengate.reply"
local auth = require "tokengate.auth"
local lockout = require "tokengate.lockout"
local limits = require "tokengate.limits"
local models = require "tokengate.models"
local request = require "tokengate.request"

local ngx_var = ngx.var
local ngx_req = ngx.req

local _M = {}

-- key(ctx, doc) -> key | nil, err (429 blocked client, 401): the API key and the limits
-- it is held to. ctx.unauthenticated: why there is no key (the status counter's reason).
function _M.key(ctx, doc)
    local ok, err = lockout.check()
    if not ok then
        ctx.unauthenticated = "unauthenticated_blocked"
        return nil, err
    end
    local key
    local api = ctx.api
    key, err = auth.authenticate(doc.keys, ngx_var.http_authorization,
        api and api.key(ngx_var), doc.previous_keys)
    if not key then
        if err == auth.MISSING then
            ctx.unauthenticated = "unauthenticated_missing_key"
            err = api and api.MISSING or err
        else
            ctx.unauthenticated = "unauthenticated_invalid_key"
            -- a disabled or expired key is a real secret, not a guess: no lockout
            if err == auth.INVALID then
                lockout.failed()
            end
        end
        return nil, err
    end
    ctx.key, ctx.limit_req = key, limits.request(key, nil, request.id(ctx))
    ctx.rate = limits.peek(ctx.limit_req)
    return key
end

-- route(ctx, doc) -> true | nil, err (404/405): a known route with its method; the
-- model list and GET /v1/models/{id} are answered here; a route that names a stored
-- response is checked against the key (the API module's stored()).
function _M.route(ctx, doc)
    local route, uri = ctx.route, ctx.uri
    local err = request.check_method(route, ngx_req.get_method(), uri)
    if err then
        return nil, err
    end
    local api = ctx.api
    if api and api.STORED and api.STORED[route] then
        ctx.stored = true
        return api.stored(ctx, doc)
    end
    if route == "models" then
        return reply.send(200, models.list(doc, ctx.key))
    elseif route == "model" then
        local text
        text, err = models.retrieve(doc, ctx.key, ctx.model_id)
        if not text then
            return nil, err
        end
        return reply.send(200, text)
    end
    return true
end

return _M
