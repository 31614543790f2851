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
local errors = require "tokengate.errors"

local ngx_var, ngx_req = ngx.var, ngx.req

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

-- A header value with a control character other than HTAB (RFC 9110 5.5: field values
-- are visible characters, spaces and tabs) passes nginx and is forwarded; vLLM's HTTP
-- server (h11) then refuses the request with a bare 400, after it was admitted. In the
-- raw header block the lines end with CR LF, which the fast check lets through.
local CONTROL_IN_BLOCK = "[%z\1-\8\11\12\14-\31\127]"
local CONTROL_IN_VALUE = "[%z\1-\8\10-\31\127]"

-- the headers the edge never forwards as the client sent them: the trace context
-- (tokengate.trace forwards it only when valid, else drops it)
local OWN = { traceparent = true, tracestate = true }

-- control_header() -> nil | the name of a request header whose value holds a control
-- character. One scan of the raw header block (ngx.req.raw_header), the headers one by
-- one only when it finds one (or when there is no raw block: HTTP/2).
local function control_header()
    local ok, raw = pcall(ngx_req.raw_header, true)
    if ok and not string.find(raw, CONTROL_IN_BLOCK) then
        return nil
    end
    for name, v in pairs(ngx_req.get_headers(0)) do
        if OWN[name] then
            v = ""
        elseif type(v) == "table" then
            v = table.concat(v, ",")
        end
        if string.find(v, CONTROL_IN_VALUE) then
            return name
        end
    end
    return nil
end

-- route(ctx, doc) -> true | nil, err (404/405, 400 invalid_header): a known route with
-- its method and no control character in a header; a route without a body (the API
-- module's NO_BODY) goes to the module's without_body(), which answers it (the model
-- list) or prepares it to be forwarded (a stored response).
function _M.route(ctx, doc)
    local route = ctx.route
    local err = apis.check_method(route, ngx_req.get_method(), ctx.uri)
    if err then
        return nil, err
    end
    local bad = control_header()
    if bad then
        return nil, errors.new(400, "Header " .. errors.clip(bad) .. " holds a control "
            .. "character: header values may hold visible characters, spaces and tabs "
            .. "only.", nil, "invalid_header")
    end
    local api = ctx.api
    if api.NO_BODY[route] then
        ctx.no_body = true
        return api.without_body(ctx, doc)
    end
    return true
end

return _M
