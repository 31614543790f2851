-- The API registry: every API module (lua/tokengate/apis/, each on the interface of
-- tokengate.api) and the routes they serve. A request's route and module come from
-- here (ctx.route, ctx.api); everything after asks the module. Adding an API is adding
-- its module to MODULES (docs/developers/architecture.md, "How to add an API").
--
-- Route names are the modules' own, unique across them: "chat", "completions", "models",
-- "model", "messages", "count_tokens", "responses", "input_tokens", "response",
-- "response_cancel", "embeddings", "key".

local errors = require "tokengate.errors"
local api = require "tokengate.api"

local sub, match, format = string.sub, string.match, string.format
local pairs, error = pairs, error
local clip = errors.clip

local _M = {}

-- MODULES: the API modules, in the order route() asks those with parameters in paths.
local MODULES = {
    require "tokengate.apis.chat",
    require "tokengate.apis.completions",
    require "tokengate.apis.models",
    require "tokengate.apis.messages",
    require "tokengate.apis.responses",
    require "tokengate.apis.embeddings",
    require "tokengate.apis.key",
}
_M.MODULES = MODULES

-- ROUTES: request path -> route; API: route -> module; PATHS: route -> the path
-- forwarded to vLLM; ALLOW: route -> the methods it takes (the Allow header of a 405,
-- and of a CORS preflight).
local ROUTES, API = {}, {}
_M.PATHS, _M.ALLOW = {}, {}
for i = 1, #MODULES do
    local mod = MODULES[i]
    for path, route in pairs(mod.ROUTES) do
        ROUTES[path] = route
    end
    for route, methods in pairs(mod.ALLOW) do
        if API[route] then
            error("tokengate API modules " .. API[route].NAME .. " and " .. mod.NAME
                .. " both name a route " .. route)
        end
        API[route] = mod
        _M.ALLOW[route] = methods
        _M.PATHS[route] = mod.PATHS[route]
    end
end
local ALLOW = _M.ALLOW
local TAKES = { POST = "POST", GET = "GET, HEAD", HEAD = "GET, HEAD" }

-- route(uri) -> route name or nil, and the id in the path of a route that has one
-- (GET /v1/models/{id}: the model; the Responses API's stored response routes: the
-- response id). uri: nginx's normalized $uri (percent-decoded, "." / ".." segments and
-- repeated slashes resolved), so /v1/./chat/completions is the chat route.
function _M.route(uri)
    local r = ROUTES[uri]
    if r then
        return r
    end
    for i = 1, #MODULES do
        local mod = MODULES[i]
        local prefix = mod.PREFIX
        if prefix and sub(uri, 1, #prefix) == prefix then
            local route, id = mod.route(uri)
            if route then
                return route, id
            end
        end
    end
    return nil
end

-- api(route, uri) -> the route's API module; for a path that is no route (route nil),
-- the module whose PREFIX starts uri, so that its 404 (or 401) comes in that API's shape
-- after its key header was read; else tokengate.api.BASE (OpenAI's shapes).
function _M.api(route, uri)
    if route then
        return API[route]
    end
    if uri then
        for i = 1, #MODULES do
            local prefix = MODULES[i].PREFIX
            if prefix and sub(uri, 1, #prefix) == prefix then
                return MODULES[i]
            end
        end
    end
    return api.BASE
end

-- endpoint(mod, route, uri) -> the usage event's endpoint: the module's endpoint(route,
-- uri) (the route's name by default), or for a path that is no route the path (a
-- client's string: at most 64 characters and "…", tokengate.errors.clip).
function _M.endpoint(mod, route, uri)
    if route then
        return mod.endpoint(route, uri)
    end
    return clip(uri)
end

-- check_method(route, method, uri) -> nil | err (404 unknown path, 405 wrong method).
function _M.check_method(route, method, uri)
    if not route then
        return errors.unknown_url(method, uri)
    end
    local allow = ALLOW[route]
    if TAKES[method] ~= allow then
        return errors.new(405, format("Method not allowed: use %s %s", match(allow, "^%u+"),
            uri), nil, "method_not_allowed", nil, { Allow = allow })
    end
    return nil
end

return _M
