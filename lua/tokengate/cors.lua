-- Cross-origin requests from browsers (edge.cors, tokengate.config.CorsConfig): the
-- Fetch standard's CORS protocol, https://fetch.spec.whatwg.org/#http-cors-protocol.
--
-- A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered by
-- the edge itself before any key is asked for: browsers never send credentials or an
-- Authorization header on one: 204 for the API's routes, 404 for other paths. Every
-- other answer to an allowed origin carries Access-Control-Allow-Origin and exposes the
-- headers a page needs to follow its limits; with origins listed (not "*") every answer
-- varies by Origin, so a cache between never gives one origin another's headers.
-- No Access-Control-Allow-Credentials: the API key travels in Authorization, set by the
-- page's script, which is an ordinary request header for CORS (no cookies are involved).

local ngx = ngx
local errors = require "tokengate.errors"

local ngx_var, ngx_req, ngx_exit = ngx.var, ngx.req, ngx.exit
local lower, find = string.lower, string.find
local type, tostring = type, tostring

local _M = {}

-- What a page may read of an answer beyond the CORS-safelisted headers.
local EXPOSE = "X-Request-Id, X-Token-Count, X-Token-Count-Source, X-Tokengate-Limits, "
    .. "X-Tokengate-Max-Tokens-Capped, "
    .. "X-Tokengate-Upstream, "
    .. "Retry-After, x-ratelimit-limit-requests, x-ratelimit-limit-tokens, "
    .. "x-ratelimit-remaining-requests, x-ratelimit-remaining-tokens, "
    .. "x-ratelimit-reset-requests, x-ratelimit-reset-tokens, x-budget-limit-spend, "
    .. "x-budget-remaining-spend, x-budget-reset-spend, x-budget-limit-tokens, "
    .. "x-budget-remaining-tokens, x-budget-reset-tokens, "
    .. "anthropic-ratelimit-requests-limit, anthropic-ratelimit-requests-remaining, "
    .. "anthropic-ratelimit-requests-reset, anthropic-ratelimit-tokens-limit, "
    .. "anthropic-ratelimit-tokens-remaining, anthropic-ratelimit-tokens-reset"
-- Access-Control-Request-Headers is a list of header names (RFC 9110 field-name tokens)
-- separated by commas and spaces; it is echoed only when it is nothing else.
local NOT_HEADER_LIST = "[^%w!#$%%&'*+.^_`|~, %-]"
local MAX_REQUEST_HEADERS = 2048 -- bytes of Access-Control-Request-Headers echoed

-- compile(cors) -> cors with .enabled, .any (allow_origins is "*") and .origins (set of
-- the lowercase origins): called once per configuration load (tokengate.config).
function _M.compile(cors)
    local origins = {}
    for i = 1, #cors.allow_origins do
        origins[cors.allow_origins[i]] = true
    end
    cors.origins, cors.any = origins, origins["*"] == true
    cors.enabled = #cors.allow_origins > 0
    cors.max_age = tostring(cors.max_age_s)
    return cors
end

-- allowed(cors, origin) -> the Access-Control-Allow-Origin value for origin ("*", or the
-- origin as sent) | nil. origin: the Origin header (nil when absent; a table when sent
-- twice, which is never allowed).
local function allowed(cors, origin)
    if type(origin) ~= "string" then
        return nil
    end
    if cors.any then
        return "*"
    end
    return cors.origins[lower(origin)] and origin or nil
end

-- preflight(ctx, cors, allow_methods, uri) -> nothing when the request is no preflight;
-- else ends it: 204 with Access-Control-Allow-{Origin,Methods,Headers} and Max-Age for
-- an allowed origin and an API route, 403 (cors_origin_not_allowed) for any other
-- origin, 404 (unknown_url) for a path that is no route, 400 for an
-- Access-Control-Request-Headers that is no list of header names. allow_methods: the
-- route's methods (tokengate.apis.ALLOW), nil for a path that is no route.
-- ctx.preflight: "allowed" | "refused" (the status counter and the log phase read it).
function _M.preflight(ctx, cors, allow_methods, uri)
    if ngx_req.get_method() ~= "OPTIONS" then
        return
    end
    local origin = ngx_var.http_origin
    if not origin or not ngx_var.http_access_control_request_method then
        return
    end
    ctx.preflight = "refused"
    local allow = cors.enabled and allowed(cors, origin)
    local h = ngx.header
    if cors.enabled and not cors.any then
        h["Vary"] = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"
    end
    if not allow then
        return errors.send(ctx, errors.new(403, "Cross-origin requests from "
            .. errors.clip(origin) .. " are not allowed by this gateway.", nil,
            "cors_origin_not_allowed"))
    end
    if not allow_methods then
        h["Access-Control-Allow-Origin"] = allow -- the page may read why: no such path
        return errors.send(ctx, errors.unknown_url("OPTIONS", uri))
    end
    local asked = ngx_var.http_access_control_request_headers
    if asked and (#asked > MAX_REQUEST_HEADERS or find(asked, NOT_HEADER_LIST)) then
        return errors.send(ctx, errors.new(400, "Access-Control-Request-Headers is not a "
            .. "list of header names.", nil, "invalid_request"))
    end
    ctx.preflight = "allowed"
    h["Access-Control-Allow-Origin"] = allow
    h["Access-Control-Allow-Methods"] = allow_methods
    if asked then
        h["Access-Control-Allow-Headers"] = asked
    end
    h["Access-Control-Max-Age"] = cors.max_age
    ngx.status = 204
    return ngx_exit(204)
end

-- headers(ctx, h, cors): the CORS headers of an answer (any status) while edge.cors is
-- on, a preflight's excepted (preflight set its own): for a request whose Origin is
-- allowed, Access-Control-Allow-Origin and -Expose-Headers; Vary: Origin on every answer
-- while origins are listed (the answer depends on it). h: ngx.header.
function _M.headers(ctx, h, cors)
    if not cors.enabled or ctx.preflight then
        return
    end
    if not cors.any then
        h["Vary"] = "Origin"
    end
    local allow = allowed(cors, ngx_var.http_origin)
    if allow then
        h["Access-Control-Allow-Origin"] = allow
        h["Access-Control-Expose-Headers"] = EXPOSE
    end
end

return _M
