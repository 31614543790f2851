-- What a request asks for, beyond its prompt: the route, the completion budget
-- (max_tokens after the server cap, the model's default, the context window) and the
-- stream options the edge needs. Errors use the errors.new shape.

local ngx = ngx
local json = require "tokengate.json"
local errors = require "tokengate.errors"
local messages = require "tokengate.messages"
local responses = require "tokengate.responses"
local embeddings = require "tokengate.embeddings"

local ngx_var = ngx.var
local format = string.format
local sub = string.sub
local pairs = pairs
local ipairs = ipairs
local match = string.match
local clip = errors.clip
local min = math.min
local max = math.max
local json_integer = json.integer
local json_set = json.set
local is_object = json.is_object

local _M = {}

-- ROUTES: request path -> route name; PATHS: route -> the path forwarded to vLLM.
local ROUTES = {
    ["/v1/chat/completions"] = "chat",
    ["/v1/completions"] = "completions",
    ["/v1/models"] = "models",
}
_M.PATHS = { chat = "/v1/chat/completions", completions = "/v1/completions" }
local MODEL_PREFIX = "/v1/models/"
-- The API modules beyond OpenAI's chat and completions (see tokengate.messages for what
-- a module provides), and their routes: route -> module. A module's route(uri) names
-- the routes with a parameter in their path (tokengate.responses: a stored response).
local MODULES = { messages, responses, embeddings }
local APIS = {}
for _, mod in ipairs(MODULES) do
    for path, route in pairs(mod.ROUTES) do
        ROUTES[path] = route
    end
    for route in pairs(mod.ALLOW) do
        APIS[route] = mod
        _M.PATHS[route] = mod.PATHS[route]
    end
end

-- api(route, uri) -> the route's API module, or nil for chat, completions and the model
-- list; for a path that is no route (route nil), the module whose PREFIX starts uri, so
-- that its 404 (or 401) comes in that API's shape after its key header was read.
function _M.api(route, uri)
    if route or not uri then
        return APIS[route]
    end
    for i = 1, #MODULES do
        local mod = MODULES[i]
        if sub(uri, 1, #mod.PREFIX) == mod.PREFIX then
            return mod
        end
    end
    return nil
end

-- id(ctx) -> the request's $request_id (32 hex digits), kept in ctx: an ngx.var read
-- looks the variable up by its name each time, and the phases need the id four times.
function _M.id(ctx)
    local id = ctx.request_id
    if not id then
        id = ngx_var.request_id
        ctx.request_id = id
    end
    return id
end

-- route(uri) -> route name ("chat" | "completions" | "models" | "model" | an API
-- module's: "messages" | "count_tokens" | "responses" | "input_tokens" | "response" |
-- "response_cancel" | "embeddings") or nil, and for "model" (GET /v1/models/{id}, the
-- openai client's models.retrieve) the id, for "response" and "response_cancel" the
-- response id.
-- uri: nginx's normalized $uri (percent-decoded, "." / ".." segments and repeated
-- slashes resolved), so /v1/./chat/completions is the chat route.
function _M.route(uri)
    local r = ROUTES[uri]
    if r then
        return r
    end
    if sub(uri, 1, #MODEL_PREFIX) == MODEL_PREFIX and #uri > #MODEL_PREFIX then
        return "model", sub(uri, #MODEL_PREFIX + 1)
    end
    for i = 1, #MODULES do
        local mod = MODULES[i]
        if mod.route and sub(uri, 1, #mod.PREFIX) == mod.PREFIX then
            return mod.route(uri)
        end
    end
    return nil
end

local CAPPED_FIELDS = {
    chat = { "max_completion_tokens", "max_tokens" },
    completions = { "max_tokens" },
}

-- endpoint(route, uri) -> the usage event's endpoint: "chat", "completions", an API
-- module's route ("messages", "count_tokens", "responses", "input_tokens", "response",
-- "response_cancel", "embeddings") or the path (a client's string: at most 64
-- characters and "…", see errors.clip).
function _M.endpoint(route, uri)
    if route == "chat" or route == "completions" or APIS[route] then
        return route
    end
    return clip(uri)
end

-- ALLOW: route -> the methods it takes (the Allow header of a 405, and of a CORS
-- preflight). The model list and a model's entry take GET and HEAD (RFC 9110 §9.3.2:
-- HEAD wherever GET; nginx sends a HEAD answer's headers only), completions POST.
_M.ALLOW = { chat = "POST", completions = "POST", models = "GET, HEAD", model = "GET, HEAD" }
local ALLOW = _M.ALLOW
for route, mod in pairs(APIS) do
    ALLOW[route] = mod.ALLOW[route]
end
local TAKES = { POST = "POST", GET = "GET, HEAD", HEAD = "GET, HEAD" }

-- runner(route) -> the vLLM runner a model must be served by to take the route's
-- requests (models.<name>.runner, tokengate.models.serves): an API module's RUNNER
-- ("pooling": tokengate.embeddings), else "generate" (chat, completions, messages,
-- responses and their token counts).
function _M.runner(route)
    local api = APIS[route]
    return api and api.RUNNER or "generate"
end

-- check_method(route, method, uri) -> nil | err (404 unknown path, 405 wrong method).
function _M.check_method(route, method, uri)
    if not route then
        return errors.new(404, format("Invalid URL (%s %s)", clip(method), clip(uri)), nil,
            "unknown_url")
    end
    local allow = ALLOW[route]
    if TAKES[method] ~= allow then
        return errors.new(405, format("Method not allowed: use %s %s", match(allow, "^%u+"),
            uri), nil, "method_not_allowed", nil, { Allow = allow })
    end
    return nil
end

-- adjust(ctx, route, body, model): applied before counting (neither changes the prompt's
-- tokens, and the counter must see the body that is forwarded):
--   - max_tokens (and max_completion_tokens) above model.max_tokens_cap become the cap;
--   - stream: true gets stream_options {include_usage, continuous_usage_stats} = true;
--     what the client asked for is kept in ctx.want_usage / ctx.want_continuous so the
--     body filter can take out what it did not ask for. Sets ctx.stream.
-- A route of an API module: the module's adjust(ctx, body, model).
function _M.adjust(ctx, route, body, model)
    local api = APIS[route]
    if api then
        return api.adjust(ctx, body, model)
    end
    local cap = model.max_tokens_cap
    if cap then
        local fields = CAPPED_FIELDS[route]
        for i = 1, #fields do
            local v = json_integer(body[fields[i]])
            if v and v > cap then
                json_set(body, fields[i], cap)
            end
        end
    end
    if body.stream == true then
        ctx.stream = true
        local so = body.stream_options
        if not is_object(so) then
            so = json.object()
            json_set(body, "stream_options", so)
        end
        ctx.want_usage = so.include_usage == true
        ctx.want_continuous = so.continuous_usage_stats == true
        json_set(so, "include_usage", true)
        json_set(so, "continuous_usage_stats", true)
    end
end

local WHAT = { completions = "prompt", responses = "input" }
local function what(route)
    return WHAT[route] or "messages"
end

-- max_tokens_field(route) -> the body's field of the completion budget
local function max_tokens_field(route)
    local api = APIS[route]
    return api and api.MAX_TOKENS or "max_tokens"
end

-- completion_budget(route, model, body, reply) -> completion tokens the request may
-- generate, body_changed | nil, err (400 context_length_exceeded, both numbers in the
-- message). reply: the counter's CountReply (tokens).
--   - max_tokens given: prompt + max_tokens must fit max_model_len (checked through the
--     counter's max_tokens_effective, which is per prompt for completions lists);
--   - max_tokens absent (or null): the model's default_max_tokens when configured, else
--     its max_tokens_cap, clipped to the room left and written into the body (as
--     max_output_tokens for Responses: max_tokens_field): without it vLLM would
--     generate up to the end of the context, past the cap; with neither, whatever
--     room the context leaves (vLLM's own default). No room at all is an error.
local function counted_budget(route, model, body, reply)
    local prompt = reply.prompt_tokens
    local requested = reply.max_tokens_requested
    if requested > 0 then
        if reply.max_tokens_effective < requested then
            return nil, errors.new(400, format("This model's maximum context length is %d "
                .. "tokens. However, you requested %d tokens (%d in the %s, %d in the "
                .. "completion). Please reduce the length of the %s or completion.",
                model.max_model_len, prompt + requested, prompt, what(route), requested,
                what(route)), what(route), "context_length_exceeded")
        end
        return requested, false
    end
    local room = model.max_model_len - prompt
    if room < 1 then
        return nil, errors.new(400, format("This model's maximum context length is %d tokens. "
            .. "However, your %s resulted in %d tokens, which leaves no room for the "
            .. "completion. Please reduce the length of the %s.", model.max_model_len,
            what(route), prompt, what(route)), what(route), "context_length_exceeded")
    end
    local limit = model.default_max_tokens or model.max_tokens_cap
    if limit then
        local out = min(limit, room)
        json_set(body, max_tokens_field(route), out)
        return out, true
    end
    return room, false
end

-- estimated_budget(route, body, model, prompt) -> the most completion tokens the request
-- may generate when the counter could not answer, body_changed: the explicit
-- max_completion_tokens / max_tokens (already capped by adjust); without one, the
-- default or cap, clipped to the room the estimated prompt (tokens, an over-count)
-- leaves, at least 1, and written into the body as in completion_budget; a completions
-- request without the key gets vLLM's 16 tokens; with neither a default nor a cap, the
-- whole context (vLLM may generate to its end). Budgets reserve this worst case; the
-- TPM window takes at most output_reserve of it (tokengate.limits.reservation).
local function estimated_budget(route, body, model, prompt)
    local field = max_tokens_field(route)
    local given = json_integer(body.max_completion_tokens) or json_integer(body[field])
    if given then
        return given, false
    end
    if route == "completions" and body.max_tokens == nil then
        return 16, false
    end
    local limit = model.default_max_tokens or model.max_tokens_cap
    if limit then
        local out = min(limit, max(1, model.max_model_len - prompt))
        json_set(body, field, out)
        return out, true
    end
    return model.max_model_len, false
end

-- budget(route, model, body, counted) -> completion tokens the request may generate
-- | nil, err. counted: tokengate.count's result; with the counter's reply the exact
-- rules of counted_budget apply, with an estimate those of estimated_budget. Sets
-- counted.body_changed when max_tokens was written into body (re-encode it). A route
-- whose API module has budget(route, model, body, counted) asks it (tokengate.embeddings:
-- 0, nothing is generated and nothing written into the body).
function _M.budget(route, model, body, counted)
    local api = APIS[route]
    if api and api.budget then
        counted.body_changed = false
        return api.budget(route, model, body, counted)
    end
    local out, changed
    if counted.reply then
        out, changed = counted_budget(route, model, body, counted.reply)
    else
        out, changed = estimated_budget(route, body, model, counted.prompt)
    end
    if not out then
        return nil, changed
    end
    counted.body_changed = changed
    return out
end

return _M
