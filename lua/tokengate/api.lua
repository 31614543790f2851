-- The interface of an API module: every declaration and hook an API module
-- (lua/tokengate/apis/<api>.lua) may provide, each once, here, with its default. The
-- stages never test an API's name: they read ctx.api (the route's module, chosen by
-- tokengate.apis) and call its hooks. The defaults are OpenAI's shapes (its key header,
-- errors, limit headers, usage), so an OpenAI-compatible API declares its routes, its
-- counter endpoint, validate and sanitize, and little else.
--
-- define(mod) -> mod, the module with every default it does not override; a key that
-- is neither a declaration nor a hook below, or a missing required one, is an error
-- when the module loads (nginx then refuses to start). BASE is the defaults alone: the
-- API of a path that is no route of any module.
--
-- Adding an API: docs/developers/architecture.md, "How to add an API".

local errors = require "tokengate.errors"
local limits = require "tokengate.limits"
local usage = require "tokengate.usage"

local pairs, ipairs, type, error, tostring = pairs, ipairs, type, error, tostring

local _M = {}

-- Declarations (values), with their defaults; false: none (an optional declaration
-- without a default, or a required one). Route names are the module's own; every route
-- is unique across modules (tokengate.apis checks).
local DECLARATIONS = {
    -- NAME: the API's name in messages and docs ("chat", "messages", ...). Required.
    NAME = false,
    -- ROUTES: {path -> route}, the exact paths the module serves. Required.
    ROUTES = false,
    -- PREFIX: paths under it that are no route still get this API's key header and
    -- error shape (route() also reads them); nil: none.
    PREFIX = false,
    -- ALLOW: {route -> methods} ("POST", "GET, HEAD"): the Allow header of a 405 and of
    -- a CORS preflight. Required, for every route.
    ALLOW = false,
    -- PATHS: {route -> the path forwarded to vLLM}; a route absent here is forwarded at
    -- the client's path (normalized), or never (LOCAL, a route answered by the edge).
    PATHS = {},
    -- ENDPOINT: {route -> tokengate.v1.Endpoint (proto/tokengate/v1/counter.proto)}:
    -- how the counter counts the route's body. Required for every route with a body.
    ENDPOINT = {},
    -- FIELDS: {route -> {field -> true}}: the top-level fields vLLM's request model of
    -- the route defines; any other field counts against edge.max_unknown_fields_bytes
    -- (tokengate.bounds.check).
    FIELDS = {},
    -- LOCAL: {route -> true}: answered by the edge from the count (count_answer), after
    -- the request limit; never forwarded.
    LOCAL = {},
    -- NO_BODY: {route -> true}: routes without a body (a listing, a stored object),
    -- handled by without_body() instead of the body, count and budget stages.
    NO_BODY = {},
    -- RUNNER: the vLLM runner a model must be served by to take the module's routes
    -- (models.<name>.runner, tokengate.models.serves): "generate" | "pooling".
    RUNNER = "generate",
    -- GENERATES: false for an API that generates nothing (embeddings): no completion
    -- budget, no output-limit check, 0 completion tokens reserved.
    GENERATES = true,
    -- MAX_TOKENS: the body's fields that bound the completion, the one vLLM reads first
    -- first (tokengate.output: checked against the context, capped, written when absent
    -- into the last one).
    MAX_TOKENS = { "max_tokens" },
    -- DEFAULT_MAX_TOKENS: what vLLM generates when the body has none of MAX_TOKENS and
    -- the counter cannot say (OpenAI's completions: 16); nil: to the end of the context.
    DEFAULT_MAX_TOKENS = false,
    -- PROMPT_NAME: what the API calls the prompt, in a context-length error's message
    -- and param ("messages", "prompt", "input").
    PROMPT_NAME = "messages",
    -- SESSION_FIELDS: the body's fields (dotted paths) that name the agent session when
    -- no header does, first present wins (tokengate.session).
    SESSION_FIELDS = { "safety_identifier", "user" },
    -- SESSION_CHAIN: the one of SESSION_FIELDS that names an earlier answer this request
    -- continues; its session is that answer's when this edge remembers it
    -- (tokengate.session.remember), else the value itself. false: none.
    SESSION_CHAIN = false,
    -- FINISH_FIELD: the key of an answer's finish reason (the trace's reasons,
    -- tokengate.trace.reasons).
    FINISH_FIELD = "finish_reason",
    -- MISSING: the 401 of a request without a key (tokengate.errors.new's shape); nil:
    -- tokengate.auth's (Authorization: Bearer).
    MISSING = false,
}

-- Hooks (functions), with their defaults. Required hooks default to false.
local HOOKS = {}

-- route(uri) -> route, id | nil: the module's routes with a parameter in their path
-- (uri under PREFIX; "response", "resp_..." for GET /v1/responses/{id}). Default: none.
function HOOKS.route()
    return nil
end

-- key(var) -> the API key of the API's own header | nil (then Authorization: Bearer is
-- read, tokengate.auth). var: ngx.var. Default: none.
function HOOKS.key()
    return nil
end

-- endpoint(route, uri) -> the usage event's endpoint of a request of the route.
-- Default: the route's name.
function HOOKS.endpoint(route)
    return route
end

-- without_body(ctx, doc) -> true | nil, err: a NO_BODY route: checked against the key
-- and answered here (reply.send, which ends the request), or prepared to be forwarded
-- without a body (ctx.model, ctx.model_entry, ctx.pin, the limits: one request of the
-- key's RPM). Required with NO_BODY routes.
HOOKS.without_body = false

-- validate(route, body, models, edge) -> model entry | nil, err (400/404): the body
-- (a tokengate.json object, decoded strictly) has the shape the edge relies on, names a
-- configured model (body.model), and passes the bounds (tokengate.bounds.check with
-- FIELDS[route]). A number it rewrites marks the body changed (tokengate.body.changed).
-- Required with a route that has a body.
HOOKS.validate = false

-- sanitize(body, model, edge) -> counts | nil, err (400 special_token_in_content): every
-- text the model reads, through tokengate.sanitize's visitors under edge.special_tokens;
-- counts: tokengate.sanitize.verdict's {removed, stripped, escaped, collapsed}.
-- Required with a route that has a body.
HOOKS.sanitize = false

-- adjust(ctx, body, model): edits before the count, which the counter must see (nulls
-- dropped, fields vLLM would misread); marks the body changed when it changes it; sets
-- ctx.stream for a stream, ctx.history for a body that continues a stored history.
-- Default: none.
function HOOKS.adjust()
end

-- check(ctx, doc, body) -> true | nil, err: the body's references checked against the
-- key (a stored response it continues: ctx.pin). Default: true.
function HOOKS.check()
    return true
end

-- placed(ctx, body): edits after the count and the replica's choice (ctx.replica),
-- which change no prompt token and which the counter does not read (the stream options
-- the usage watch needs, an id naming the replica); marks the body changed when it
-- changes it. Default: none.
function HOOKS.placed()
end

-- count_answer(model, prompt) -> JSON text of the API's answer to a LOCAL route | nil,
-- err (400 above the context). prompt: the counter's prompt tokens. Required with
-- LOCAL routes.
HOOKS.count_answer = false

-- sse_event(ctx, ev) -> ev | nil (dropped): one event of a stream (without its blank
-- line), read for usage (ctx.u_prompt, u_completion, u_cached, u_source), the stream's
-- end (ctx.sse_done) and its error (ctx.error). Default: OpenAI's "data: " events with
-- cumulative usage (tokengate.usage.openai_event).
HOOKS.sse_event = usage.openai_event

-- whole_usage(ctx, d): the usage of a whole (non-stream) answer, d decoded (cjson).
-- Default: OpenAI's usage object (tokengate.usage.openai_whole).
HOOKS.whole_usage = usage.openai_whole

-- error_body(err) -> JSON text of err (tokengate.errors.new's shape) in the API's
-- shape. Default: OpenAI's {"error": {message, type, param, code}}.
function HOOKS.error_body(err)
    return errors.body(err.message, err.type, err.param, err.code)
end

-- rate_headers(h, st): the key's limits in the API's headers (h: ngx.header; st:
-- tokengate.limits' state). Default: OpenAI's x-ratelimit-*.
HOOKS.rate_headers = limits.headers

-- upstream_error(ctx, err) -> err: vLLM's refusal of a forwarded request (already in
-- tokengate.errors.new's shape), as the API answers it. Default: unchanged.
function HOOKS.upstream_error(_, err)
    return err
end

_M.DECLARATIONS, _M.HOOKS = DECLARATIONS, HOOKS

local REQUIRED = { "NAME", "ROUTES", "ALLOW" }
-- what every route with a body needs, and every LOCAL / NO_BODY route
local WITH_BODY = { "validate", "sanitize" }

-- fail(mod, msg): a module that does not fit the interface stops nginx from loading it
local function fail(mod, msg)
    error("tokengate API module " .. tostring(mod.NAME) .. ": " .. msg, 3)
end

-- define(mod) -> mod, with every default it does not override (see the module comment).
-- A module may export helper functions of its own (lower-case names) beside its hooks.
function _M.define(mod)
    for k, v in pairs(mod) do
        if DECLARATIONS[k] == nil and HOOKS[k] == nil
                and (type(v) ~= "function" or k:match("^%u")) then
            fail(mod, "unknown declaration " .. tostring(k))
        end
    end
    for i = 1, #REQUIRED do
        if not mod[REQUIRED[i]] then
            fail(mod, "has no " .. REQUIRED[i])
        end
    end
    for _, defaults in ipairs({ DECLARATIONS, HOOKS }) do
        for k, v in pairs(defaults) do
            if mod[k] == nil and v then
                mod[k] = v
            end
        end
    end
    for route in pairs(mod.ALLOW) do
        if mod.LOCAL[route] and not mod.count_answer then
            fail(mod, "LOCAL route " .. route .. " without count_answer")
        end
        if mod.NO_BODY[route] then
            if not mod.without_body then
                fail(mod, "NO_BODY route " .. route .. " without without_body")
            end
        else
            if not mod.ENDPOINT[route] then
                fail(mod, "route " .. route .. " has no counter ENDPOINT")
            end
            for i = 1, #WITH_BODY do
                if not mod[WITH_BODY[i]] then
                    fail(mod, "route " .. route .. " has a body and the module no "
                        .. WITH_BODY[i])
                end
            end
        end
    end
    return mod
end

-- BASE: the defaults alone (no routes): the API of a path no module serves.
_M.BASE = _M.define({ NAME = "none", ROUTES = {}, ALLOW = {} })

return _M
