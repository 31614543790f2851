-- What a request asks for, beyond its prompt: the route, the completion budget
-- (max_tokens after the server cap, the model's default, the context window) and the
-- stream options the edge needs. Errors use the errors.new shape.

local ngx = ngx
local json = require "tokengate.json"
local errors = require "tokengate.errors"
local body_mod = require "tokengate.body"
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

-- OUTPUT_FIELDS: route -> the body's fields that bound the completion, the one vLLM reads
-- first first (chat: max_completion_tokens wins over max_tokens); an API module's is its
-- MAX_TOKENS, else "max_tokens"
local OUTPUT_FIELDS = {
    chat = { "max_completion_tokens", "max_tokens" },
    completions = { "max_tokens" },
}
for route, mod in pairs(APIS) do
    OUTPUT_FIELDS[route] = { mod.MAX_TOKENS or "max_tokens" }
end

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

-- adjust(ctx, route, body, model): the edits made before counting (the counter sees
-- them): a route of an API module gets the module's adjust(ctx, body, model); chat and
-- completions have none. The client's max_tokens is left as sent: the counter checks it
-- as vLLM does, and budget() applies the gateway's cap after.
function _M.adjust(ctx, route, body, model)
    local api = APIS[route]
    if api then
        return api.adjust(ctx, body, model)
    end
end

-- placed(ctx, route, body): the edits made after the count and the replica's choice,
-- which change no prompt token and which the counter does not read: a route of an API
-- module gets the module's placed(ctx, body) when it has one. Chat and completions:
-- stream: true gets stream_options {include_usage, continuous_usage_stats} = true; what
-- the client asked for is kept in ctx.want_usage / ctx.want_continuous so the body
-- filter can take out what it did not ask for.
function _M.placed(ctx, route, body)
    local api = APIS[route]
    if api then
        if api.placed then
            api.placed(ctx, body)
        end
        return
    end
    if body.stream == true then
        ctx.stream = true
        local so = body.stream_options
        if not is_object(so) then
            so = json.object()
            json_set(body, "stream_options", so)
        end
        local want_usage, want_continuous = so.include_usage == true,
            so.continuous_usage_stats == true
        ctx.want_usage, ctx.want_continuous = want_usage, want_continuous
        if not (want_usage and want_continuous) then
            json_set(so, "include_usage", true)
            json_set(so, "continuous_usage_stats", true)
            body_mod.changed(body)
        end
    end
end

local WHAT = { completions = "prompt", responses = "input" }
local function what(route)
    return WHAT[route] or "messages"
end

-- output_fields(route) -> the body's fields that bound the completion (OUTPUT_FIELDS)
local function output_fields(route)
    return OUTPUT_FIELDS[route]
end

-- requested_tokens(route, body) -> the completion limit the client asked for, and its
-- field, or nil: the first field of output_fields that is an integer (vLLM's chat reads
-- max_completion_tokens before max_tokens)
local function requested_tokens(route, body)
    local fields = output_fields(route)
    for i = 1, #fields do
        local v = json_integer(body[fields[i]])
        if v then
            return v, fields[i]
        end
    end
    return nil
end

-- check_output(route, body, model) -> true | nil, err (400): a completion limit above the
-- model's context is refused before anything is counted, in vLLM 0.32's words and with
-- the client's own numbers (vllm/renderers/params.py, TokenizeParams.__post_init__:
-- "max_tokens=N cannot be greater than max_model_len=M. Please request fewer output
-- tokens.", param the field; the Messages API converts max_tokens to chat's
-- max_completion_tokens and the client's name for it is kept). Routes that generate
-- nothing (count_tokens, input_tokens, embeddings) are not checked.
function _M.check_output(route, body, model)
    local api = APIS[route]
    if api and (api.budget or api.LOCAL[route]) then
        return true
    end
    local v, field = requested_tokens(route, body)
    if v and v > model.max_model_len then
        -- %.0f: a client's 1e30 is a double that %d would wrap to a negative number
        return nil, errors.new(400, format("%s=%.0f cannot be greater than max_model_len=%d. "
            .. "Please request fewer output tokens.", field, v, model.max_model_len), field,
            "invalid_value")
    end
    return true
end

-- cap_of(model, key) -> the gateway's cap on a request's completion tokens, and whose it
-- is ("model" | "key"): the tighter of models.<m>.max_tokens_cap and
-- keys.<k>.max_tokens_cap (the model's on a tie); nil with neither
function _M.cap_of(model, key)
    local mc, kc = model.max_tokens_cap, key and key.max_tokens_cap
    if kc and (not mc or kc < mc) then
        return kc, "key"
    end
    return mc, mc and "model" or nil
end

-- lower(route, body, cap): every completion-limit field of body above cap becomes cap
local function lower(route, body, cap)
    local fields = output_fields(route)
    for i = 1, #fields do
        local v = json_integer(body[fields[i]])
        if v and v > cap then
            json_set(body, fields[i], cap)
        end
    end
end

-- no_room(route, model, prompt) -> the 400 of a prompt that leaves no room for a
-- completion (vLLM refuses it too: its sampling max_tokens would be 0)
local function no_room(route, model, prompt)
    return errors.new(400, format("This model's maximum context length is %d tokens. "
        .. "However, your %s resulted in %d tokens, which leaves no room for the "
        .. "completion. Please reduce the length of the %s.", model.max_model_len,
        what(route), prompt, what(route)), what(route), "context_length_exceeded")
end

-- counted_budget(route, model, body, reply, cap) -> completion tokens the request may
-- generate, body_changed | nil, err (400 context_length_exceeded). reply: the counter's
-- CountReply (tokens); cap: cap_of's.
--   - max_tokens given: vLLM 0.32 fits it into the room the prompt leaves
--     (vllm/entrypoints/serve/utils/api_utils.py, get_max_tokens: min(max_model_len -
--     prompt, max_tokens)): the counter's max_tokens_effective is that number (per
--     prompt for completions lists), and the gateway's cap lowers it further (written
--     into the body). A limit above max_model_len was refused by check_output.
--   - max_tokens absent (or null): the model's default_max_tokens (at most the cap), else
--     the cap, clipped to the room left and written into the body (as
--     max_output_tokens for Responses): without it vLLM would generate up to the end
--     of the context, past the cap; with neither, whatever room the context leaves
--     (vLLM's own default).
--   No room at all is an error.
local function counted_budget(route, model, body, reply, cap)
    local prompt = reply.prompt_tokens
    if reply.max_tokens_requested > 0 then
        local out = reply.max_tokens_effective
        if out < 1 then
            return nil, no_room(route, model, prompt)
        end
        if cap and cap < out then
            lower(route, body, cap)
            return cap, true
        end
        return out, false
    end
    local room = model.max_model_len - prompt
    if room < 1 then
        return nil, no_room(route, model, prompt)
    end
    local limit = model.default_max_tokens
    if cap then
        limit = limit and min(limit, cap) or cap
    end
    if limit then
        local out = min(limit, room)
        local fields = output_fields(route)
        json_set(body, fields[#fields], out)
        return out, true
    end
    return room, false
end

-- estimated_budget(route, body, model, prompt, cap) -> the most completion tokens the
-- request may generate when the counter could not answer, body_changed: the explicit
-- max_completion_tokens / max_tokens, lowered to the cap (vLLM may fit it lower still:
-- the room is not known); without one, the default or cap, clipped to the room the
-- estimated prompt (tokens, an over-count) leaves, at least 1, and written into the body
-- as in counted_budget; a completions request without the key gets vLLM's 16 tokens;
-- with neither a default nor a cap, the whole context (vLLM may generate to its end).
-- Budgets reserve this worst case; the TPM window takes at most output_reserve of it
-- (tokengate.limits.reservation).
local function estimated_budget(route, body, model, prompt, cap)
    local given = requested_tokens(route, body)
    if given then
        if cap and cap < given then
            lower(route, body, cap)
            return cap, true
        end
        return given, false
    end
    if route == "completions" and body.max_tokens == nil then
        return 16, false
    end
    local limit = model.default_max_tokens
    if cap then
        limit = limit and min(limit, cap) or cap
    end
    if limit then
        local out = min(limit, max(1, model.max_model_len - prompt))
        local fields = output_fields(route)
        json_set(body, fields[#fields], out)
        return out, true
    end
    return model.max_model_len, false
end

-- budget(route, model, body, counted, key) -> completion tokens the request may generate
-- | nil, err. counted: tokengate.count's result; with the counter's reply the exact
-- rules of counted_budget apply, with an estimate those of estimated_budget; key: the
-- compiled key (its max_tokens_cap, cap_of). Marks body changed (tokengate.body.changed)
-- when max_tokens was written into it; sets counted.requested (the client's completion
-- limit, nil without one) and, when the gateway's cap lowered it, counted.capped_by
-- ("model" | "key"). A route whose API module has budget(route, model, body, counted)
-- asks it (tokengate.embeddings: 0, nothing is generated and nothing written into the
-- body).
function _M.budget(route, model, body, counted, key)
    local api = APIS[route]
    if api and api.budget then
        return api.budget(route, model, body, counted)
    end
    local requested = requested_tokens(route, body)
    local cap, whose = _M.cap_of(model, key)
    local out, changed
    if counted.reply then
        out, changed = counted_budget(route, model, body, counted.reply, cap)
    else
        out, changed = estimated_budget(route, body, model, counted.prompt, cap)
    end
    if not out then
        return nil, changed
    end
    if changed then
        body_mod.changed(body)
    end
    counted.requested = requested
    if requested and changed then
        counted.capped_by = whose
    end
    return out
end

return _M
