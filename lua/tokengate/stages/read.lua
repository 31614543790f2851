-- Access stage "read": who asks (the API key, in the request's API's header) and for
-- which route (a known path with a method it takes). A route without a body is handed
-- to its API module (without_body: the model list answered, a stored response checked
-- against the key). Every function returns true | nil, err (tokengate.errors).

local ngx = ngx
local auth = require "tokengate.auth"
local lockout = require "tokengate.lockout"
local limits = require "tokengate.limits"
local apis = require "tokengate.apis"
local state = require "tokengate.state"
local batch = require "tokengate.batch"

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
    local api = ctx.api
    -- the batch service's lines act as the key whose batch they belong to
    local key
    key, err = batch.act_for(ctx, doc, ngx_var.http_authorization)
    if err then
        return nil, err
    end
    if not key then
        key, err = auth.authenticate(doc.keys, ngx_var.http_authorization, api.key(ngx_var),
            doc.previous_keys)
    end
    if not key then
        if err == auth.MISSING then
            ctx.unauthenticated = "unauthenticated_missing_key"
            err = api.MISSING or err
        else
            ctx.unauthenticated = "unauthenticated_invalid_key"
            -- a disabled or expired key is a real secret, not a guess: no lockout
            if err == auth.INVALID then
                lockout.failed()
            end
        end
        return nil, err
    end
    ctx.key, ctx.limit_req = key, limits.request(key, nil, state.request_id(ctx))
    ctx.rate = limits.peek(ctx.limit_req)
    return key
end

-- route(ctx, doc) -> true | nil, err (404/405): a known route with its method; a route
-- without a body (the API module's NO_BODY) goes to the module's without_body(), which
-- answers it (the model list) or prepares it to be forwarded (a stored response).
function _M.route(ctx, doc)
    local route = ctx.route
    local err = apis.check_method(route, ngx_req.get_method(), ctx.uri)
    if err then
        return nil, err
    end
    local api = ctx.api
    if api.NO_BODY[route] then
        ctx.no_body = true
        return api.without_body(ctx, doc)
    end
    return true
end

return _M
