-- The OpenAI Responses API (POST /v1/responses, POST /v1/responses/input_tokens, GET
-- /v1/responses/{id}, POST /v1/responses/{id}/cancel): what of it the edge reads, in one
-- place (the hooks: tokengate.api):
--
--   validate:   the body's shape the edge relies on (vLLM's ResponsesRequest,
--               vllm/entrypoints/openai/responses/protocol.py; the counter checks the
--               rest, naming the field); background mode and previous_input_messages
--               are refused (see below)
--   sanitize:   every text the model reads: instructions, input (a string or items:
--               messages and their parts, function and custom tool calls and their
--               outputs, reasoning), tools, chat_template_kwargs
--   adjust:     nulls and request_id dropped; a stream sets ctx.stream (vLLM's Responses
--               stream ends with response.completed, which carries the usage)
--   placed:     the response id (vLLM's request_id) is the edge's: see "Stored responses"
--   usage:      response.completed (also for an incomplete response) of a stream, the
--               usage of a whole answer: {input_tokens, input_tokens_details:
--               {cached_tokens}, output_tokens}
--   without_body: a route that names a stored response (GET, cancel): see "Stored
--               responses"
--   errors:     OpenAI's shape; limit headers: OpenAI's x-ratelimit-*
--
-- input_tokens (OpenAI's "Get input token counts", {"object": "response.input_tokens",
-- "input_tokens": n}) is answered here, by the counter's count alone: nothing reaches vLLM.
--
-- Stored responses. vLLM keeps a response (store, with VLLM_ENABLE_RESPONSES_API_STORE=1)
-- in the memory of the replica that made it, under the request_id of the body. The edge
-- writes that id itself: "resp_" .. <request id, 32 hex> .. <replica tag, 8 hex> ..
-- <owner tag, 16 hex>, where the replica tag names the model and replica that serve it
-- (SHA-256 of "<model>\0<replica name>") and the owner tag is HMAC-SHA1 keyed with the
-- key's digest (never known to another client) over the two parts before it. A request
-- that names a response (GET, cancel, previous_response_id) is therefore checked and
-- routed without any state at the edge, across edges and restarts: an id that another
-- key made, or that no replica of the configuration made, is "not found" (404, as
-- OpenAI answers an id it does not know), and the request goes to the replica that
-- holds the response. A response whose replica has left the configuration is gone.
--
-- previous_response_id pulls a history the edge cannot see (vLLM's store): the counter
-- counts what the body holds, X-Token-Count-Source says "history" (the count is a lower
-- bound), the reservation is made on it and settled, as always, with vLLM's usage.
-- background: true is refused: vLLM answers at once and generates afterwards, out of
-- the edge's sight, so nothing could be metered or limited. previous_input_messages (a
-- vLLM extension that puts chat messages before the input) is refused: they would
-- reach the model without being counted or sanitized.

local ngx = ngx
local json = require "tokengate.json"
local errors = require "tokengate.errors"
local api = require "tokengate.api"
local bounds = require "tokengate.bounds"
local body_mod = require "tokengate.body"
local sanitize = require "tokengate.sanitize"
local output = require "tokengate.output"
local models_mod = require "tokengate.models"
local limits = require "tokengate.limits"
local usage = require "tokengate.usage"
local digest = require "tokengate.digest"
local state = require "tokengate.state"

local type, pairs, setmetatable = type, pairs, setmetatable
local format, sub, match, lower = string.format, string.sub, string.match, string.lower
local hmac_sha1, ngx_var, ngx_req = ngx.hmac_sha1, ngx.var, ngx.req
local is_array, is_object, json_set, null = json.is_array, json.is_object, json.set, json.null
local fail = errors.refuse

-- The fields of vLLM 0.32's ResponsesRequest (vllm/entrypoints/openai/responses/
-- protocol.py; tests/edge/test_edge_costly_inputs.py compares them with vLLM's model):
-- any other top-level field counts against edge.max_unknown_fields_bytes.
local FIELDS = bounds.set({
    "background", "cache_salt", "chat_template_kwargs", "ec_transfer_params",
    "enable_response_messages", "frequency_penalty", "ignore_eos", "include",
    "include_reasoning", "include_stop_str_in_output", "input", "instructions",
    "kv_transfer_params", "logit_bias", "max_output_tokens", "max_tool_calls",
    "media_io_kwargs", "metadata", "min_p", "mm_payload", "mm_processor_kwargs", "model",
    "parallel_tool_calls", "presence_penalty", "previous_input_messages",
    "previous_response_id", "priority", "prompt", "prompt_cache_key", "reasoning",
    "repetition_penalty", "request_id", "return_mm_kwargs", "seed", "service_tier",
    "session_id", "skip_special_tokens", "stop", "stop_token_ids", "store", "stream",
    "structured_outputs", "temperature", "text", "tool_choice", "tools", "top_k",
    "top_logprobs", "top_p", "truncation", "user", "vllm_xargs", "watermarking",
})

local _M = {
    NAME = "responses",
    ROUTES = { ["/v1/responses"] = "responses",
               ["/v1/responses/input_tokens"] = "input_tokens" },
    -- paths under it that are no route still get this API's error shape; route() reads
    -- the routes that name a stored response
    PREFIX = "/v1/responses",
    PATHS = { responses = "/v1/responses" }, -- input_tokens is never forwarded
    ALLOW = { responses = "POST", input_tokens = "POST", response = "GET, HEAD",
              response_cancel = "POST" },
    -- tokengate.v1.ENDPOINT_RESPONSES (an input token count takes the same body)
    ENDPOINT = { responses = 5, input_tokens = 5 },
    FIELDS = { responses = FIELDS, input_tokens = FIELDS },
    -- answered by the edge itself, after the count and the request limit
    LOCAL = { input_tokens = true },
    -- routes that name a stored response: no body, no count; one request of the key's RPM
    NO_BODY = { response = true, response_cancel = true },
    -- the completion budget's field (tokengate.output)
    MAX_TOKENS = { "max_output_tokens" },
    PROMPT_NAME = "input",
    -- the agent session when no header names it (tokengate.session): the response this
    -- one continues, then OpenAI's end-user ids
    SESSION_FIELDS = { "previous_response_id", "safety_identifier", "user" },
    SESSION_CHAIN = "previous_response_id",
}

-- The parts of a stored response id (module comment).
local ID_PREFIX = "resp_"
local ID_PATTERN = "^resp_(%x+)$"
local RID_LEN, TAG_LEN, MAC_LEN = 32, 8, 16

-- replica_tag(model_name, r) -> 8 hex digits naming the model and replica
local replica_tag = digest.replica_tag(TAG_LEN, true)

-- owner_tag(key, head) -> 16 hex digits binding head (request id .. replica tag) to key
local function owner_tag(key, head)
    return sub(digest.hex(hmac_sha1(key.digest, head)), 1, MAC_LEN)
end

-- tags: compiled config -> {replica tag -> {model, replica}}, built once per
-- configuration (a reload compiles a new one)
local tags = setmetatable({}, { __mode = "k" })

local function replicas_by_tag(doc)
    local t = tags[doc]
    if not t then
        t = {}
        for name, m in pairs(doc.models) do
            for i = 1, #m.upstreams do
                t[replica_tag(name, m.upstreams[i])] = { model = m, replica = m.upstreams[i] }
            end
        end
        tags[doc] = t
    end
    return t
end

-- response_id(key, rid, model_name, r) -> the id the edge gives the response that
-- replica r of model makes for request rid (32 hex) of key
function _M.response_id(key, rid, model_name, r)
    local head = rid .. replica_tag(model_name, r)
    return ID_PREFIX .. head .. owner_tag(key, head)
end

local function not_found(id, param)
    return fail(404, format("Response with id '%s' not found.", errors.clip(id)), param,
        "not_found")
end

-- owned(doc, key, id, param) -> {model, replica} | nil, err (404): where the response
-- id (a string) was made, when key made it; an id of another key, of a replica that is
-- no longer configured, or of no edge (vLLM's own) is not found.
function _M.owned(doc, key, id, param)
    local digits = match(id, ID_PATTERN)
    if not digits or #digits ~= RID_LEN + TAG_LEN + MAC_LEN then
        return not_found(id, param)
    end
    local head = sub(digits, 1, RID_LEN + TAG_LEN)
    if owner_tag(key, head) ~= sub(digits, RID_LEN + TAG_LEN + 1) then
        return not_found(id, param)
    end
    local place = replicas_by_tag(doc)[sub(head, RID_LEN + 1)]
    if not place then
        return not_found(id, param)
    end
    return place
end

-- route(uri) -> "response" | "response_cancel", the response id | nil: the routes that
-- name a stored response (GET /v1/responses/{id}, POST /v1/responses/{id}/cancel).
function _M.route(uri)
    local id = match(uri, "^/v1/responses/([^/]+)$")
    if id then
        return "response", id
    end
    id = match(uri, "^/v1/responses/([^/]+)/cancel$")
    if id then
        return "response_cancel", id
    end
    return nil
end

-- TRUE_ARG: what FastAPI reads as true in a query parameter (pydantic's bool parsing)
local TRUE_ARG = { ["true"] = true, ["1"] = true, yes = true, on = true, t = true, y = true }

-- replay_args() -> true | nil, err (400): a retrieve's query. stream=true replays a
-- response's events, which vLLM keeps for background responses only (refused here):
-- for any other it fails after its 200 (an empty stream), so it is refused here too;
-- starting_after must be an integer.
local function replay_args()
    local args = ngx_var.args
    if not args then
        return true
    end
    local stream = ngx_var.arg_stream
    if stream and TRUE_ARG[lower(stream)] then
        return fail(400, "stream: a stored response is replayed as events only when it "
            .. "was made in the background, which this gateway does not run; retrieve it "
            .. "without stream", "stream", "unsupported_parameter")
    end
    local after = ngx_var.arg_starting_after
    if after and not match(after, "^%d+$") then
        return fail(400, "starting_after: must be an integer", "starting_after",
            "invalid_type")
    end
    return true
end

-- without_body(ctx, doc) -> true | nil, err (404, 400): a request that names a stored
-- response (ctx.model_id, the path's id): the key must have made it and may still use
-- its model; a retrieve's query is checked (replay_args) and a HEAD asks vLLM with GET;
-- the request is pinned to the replica that holds it (ctx.pin) and counts one request
-- of the key's RPM, no tokens.
function _M.without_body(ctx, doc)
    local place, err = _M.owned(doc, ctx.key, ctx.model_id)
    if not place then
        return nil, err
    end
    if ctx.route == "response" then
        local ok
        ok, err = replay_args()
        if not ok then
            return nil, err
        end
        if ngx_req.get_method() == "HEAD" then
            -- vLLM routes GET only; nginx sends a HEAD client the headers alone
            ngx_req.set_method(ngx.HTTP_GET)
        end
    end
    local model = place.model
    if not models_mod.allowed(ctx.key, model.name) then
        return not_found(ctx.model_id)
    end
    ctx.model, ctx.model_entry, ctx.pin = model.name, model, place.replica
    limits.model(ctx.limit_req, ctx.key, model.name)
    ctx.rate = limits.peek(ctx.limit_req)
    limits.reservation(ctx.limit_req, 0, 1, 0, 1, 0)
    ctx.token_estimate = nil
    return true
end

-- the booleans of vLLM 0.32's ResponsesRequest (vllm/entrypoints/openai/responses/
-- protocol.py)
-- (null is taken for each: the edge drops a top-level null, vLLM then takes its default)
local BOOLEANS = { "background", "enable_response_messages", "ignore_eos",
                   "include_reasoning", "include_stop_str_in_output", "parallel_tool_calls",
                   "skip_special_tokens", "store", "stream" }

-- validate(route, body, models, edge) -> model entry | nil, err (400/404). Checks:
-- model (a configured one), input (a string or an array of objects), instructions (a
-- string), max_output_tokens (an integer >= 1; input_tokens ignores one), stream,
-- store and background (booleans; background true refused), previous_response_id (a
-- string), previous_input_messages (refused), tools (an array), chat_template_kwargs
-- (edge.chat_template_kwargs_allowed), then the bounds: unknown fields, and
-- text.format's schema as a structured-output schema (tokengate.bounds).
function _M.validate(route, body, models, edge)
    local ok, err = body_mod.api_model(body)
    if not ok then
        return nil, err
    end
    local input = body.input
    if input == nil or input == null then
        return fail(400, "input: Field required (a string or an array of input items)",
            "input", "missing_required_parameter")
    end
    if type(input) ~= "string" then
        if not is_array(input) then
            return fail(400, "input: must be a string or an array of input items", "input",
                "invalid_type")
        end
        for i = 1, #input do
            if not is_object(input[i]) then
                local param = format("input[%d]", i - 1)
                return fail(400, param .. ": must be an input item object", param,
                    "invalid_type")
            end
        end
    end
    ok, err = body_mod.api_string(body, "instructions")
    if not ok then
        return nil, err
    end
    if route == "responses" then
        ok, err = body_mod.api_posint(body, "max_output_tokens")
        if not ok then
            return nil, err
        end
        for i = 1, #BOOLEANS do
            ok, err = body_mod.api_bool(body, BOOLEANS[i])
            if not ok then
                return nil, err
            end
        end
        ok, err = body_mod.api_top_logprobs(body)
        if not ok then
            return nil, err
        end
        if body.background == true then
            return fail(400, "background: background responses are not supported by this "
                .. "gateway (they are generated after the answer, where they cannot be "
                .. "metered); send the request without background", "background",
                "unsupported_parameter")
        end
    end
    local prev = body.previous_input_messages
    if prev ~= nil and prev ~= null then
        return fail(400, "previous_input_messages: not supported by this gateway; send the "
            .. "history as input items", "previous_input_messages", "unsupported_parameter")
    end
    ok, err = body_mod.api_string(body, "previous_response_id")
    if not ok then
        return nil, err
    end
    local text = body.text
    local fmt = is_object(text) and text.format
    return body_mod.check_api(_M.FIELDS[route], body, models, edge, "text.format.schema",
        is_object(fmt) and fmt.schema)
end

-- ROLE_OF[item type]: the role whose tokens are checked in an item that is no message
local ROLE_OF = {
    function_call = "assistant", custom_tool_call = "assistant", reasoning = "assistant",
    function_call_output = "tool", custom_tool_call_output = "tool",
}

-- texts(st, list, param, tokens, field): the `field` strings of a list of parts
-- (reasoning summaries and contents)
local function texts(st, list, param, tokens, field)
    if not is_array(list) then
        return
    end
    for j = 1, #list do
        local p = list[j]
        if is_object(p) and type(p[field]) == "string" then
            p[field] = sanitize.text(st, p[field], format("%s[%d].%s", param, j - 1, field),
                tokens)
        end
    end
end

-- a tool call item's identifier and its names (namespace: a namespaced tool's)
local CALL_ID, CALL_NAME = { "call_id" }, { "name", "namespace" }

-- item(st, it, param): one input item. A message's content (a string or parts: text,
-- output_text, refusal) under its role's tokens; a tool call's name, namespace, id and
-- arguments (read as vLLM decodes them) or custom input; a tool output (a string or
-- parts); a reasoning item's summary and content texts.
local function item(st, it, param)
    local kind = it.type
    local role = it.role
    local tokens
    if type(role) == "string" and (kind == nil or kind == "message") then
        tokens = st.by_role[role]
        if it.content ~= nil then
            it.content = sanitize.content(st, it.content, param .. ".content", tokens)
        end
        return
    end
    tokens = st.by_role[ROLE_OF[kind] or "user"]
    sanitize.strings(st, it, param, tokens, sanitize.check, CALL_ID)
    sanitize.strings(st, it, param, tokens, sanitize.text, CALL_NAME)
    if kind == "function_call" then
        sanitize.arguments(st, it, param .. ".arguments", tokens)
    elseif type(it.input) == "string" then
        it.input = sanitize.text(st, it.input, param .. ".input", tokens)
    end
    if it.output ~= nil then
        it.output = sanitize.content(st, it.output, param .. ".output", tokens)
    end
    if kind == "reasoning" then
        texts(st, it.summary, param .. ".summary", tokens, "text")
        texts(st, it.content, param .. ".content", tokens, "text")
    end
end

-- tool(st, t, param): a tool's name, description, parameters (a function's schema) and
-- format (a custom tool's grammar), and a namespace's tools, against every special and
-- structural token (the template renders tools into the system turn).
local function tool(st, t, param)
    sanitize.tool(st, t, param, "parameters")
    if type(t.format) == "table" then
        sanitize.value(st, t.format, param .. ".format", st.all, false)
    end
    sanitize.objects(st, t.tools, param .. ".tools", tool)
end

-- sanitize(body, model, edge) -> counts | nil, err (tokengate.sanitize.verdict's shape):
-- instructions (the system role's tokens), input (a string: the user's; items: item()),
-- tools, chat_template_kwargs (every special and structural token).
function _M.sanitize(body, model, edge)
    local st = sanitize.state(model, edge)
    if type(body.instructions) == "string" then
        body.instructions = sanitize.text(st, body.instructions, "instructions",
            st.by_role.system)
    end
    local input = body.input
    if type(input) == "string" then
        body.input = sanitize.text(st, input, "input", st.by_role.user)
    else
        for i = 1, #input do
            item(st, input[i], format("input[%d]", i - 1))
        end
    end
    sanitize.objects(st, body.tools, "tools", tool)
    return sanitize.finish(st, body)
end

-- adjust(ctx, body, model): top-level fields given as null are dropped (null means the
-- default, and vLLM 0.32 takes null for background, truncation, service_tier ... in the
-- request, generates, and then fails to build its response of them: a 400 after the
-- whole generation, with nothing billed); an input_tokens body loses max_output_tokens
-- (it generates nothing; elsewhere it stays as sent: tokengate.output.budget applies
-- the gateway's cap); the client's request_id is dropped (placed() writes the edge's); a
-- stream sets ctx.stream; previous_response_id sets ctx.history (the count source
-- "history").
function _M.adjust(ctx, body)
    local changed = json.drop_nulls(body) > 0
    if ctx.route == "input_tokens" and body.max_output_tokens ~= nil then
        json_set(body, "max_output_tokens", nil)
        changed = true
    end
    if body.request_id ~= nil then
        json_set(body, "request_id", nil)
        changed = true
    end
    if changed then
        body_mod.changed(body)
    end
    if body.stream == true then
        ctx.stream = true
    end
    if type(body.previous_response_id) == "string" then
        ctx.history = true
    end
end

-- check(ctx, doc, body) -> true | nil, err (404, 400): the body's references, against
-- the key: a previous_response_id must be the key's, of the model the body names; the
-- request is pinned to its replica (ctx.pin).
function _M.check(ctx, doc, body)
    local pid = body.previous_response_id
    if type(pid) ~= "string" then
        return true
    end
    local place, err = _M.owned(doc, ctx.key, pid, "previous_response_id")
    if not place then
        return nil, err
    end
    if place.model.name ~= ctx.model then
        return fail(400, format("previous_response_id: response '%s' was made by model "
            .. "'%s', not '%s'", errors.clip(pid), place.model.name, ctx.model),
            "previous_response_id", "invalid_value")
    end
    ctx.pin = place.replica
    return true
end

-- placed(ctx, body): the body gets the edge's response id for the chosen replica
-- (ctx.replica) as vLLM's request_id. Set after the count (the id changes no prompt
-- token, and a count of a body without it can be cached).
function _M.placed(ctx, body)
    local id = _M.response_id(ctx.key, state.request_id(ctx), ctx.model, ctx.replica)
    json_set(body, "request_id", id)
    body_mod.changed(body)
    ctx.response_id = id -- the session of requests that continue it (tokengate.session)
end

-- count_answer(model, prompt) -> JSON text of OpenAI's input token count
-- ({"object": "response.input_tokens", "input_tokens": n}) | nil, err (400) for a
-- prompt above the context window, which vLLM would refuse.
function _M.count_answer(model, prompt)
    local _, err = output.above_context(model, prompt, "This model's maximum context length "
        .. "is %d tokens. However, your input resulted in %d tokens, which exceeds this "
        .. "limit even without any output tokens. Please reduce the length of the input.",
        "input")
    if err then
        return nil, err
    end
    return format('{"object":"response.input_tokens","input_tokens":%d}', prompt)
end

-- read_usage(ctx, u): a Responses usage object into ctx's usage fields
-- (tokengate.usage): prompt = input_tokens (cached ones included), cached =
-- input_tokens_details.cached_tokens, completion = output_tokens.
local function read_usage(ctx, u)
    usage.final(ctx, u, "input_tokens", "output_tokens", "input_tokens_details")
end

-- DELTAS: the stream events that carry newly generated text (one per engine step with
-- text, each of at least one token)
local DELTAS = {
    ["response.output_text.delta"] = true, ["response.reasoning_text.delta"] = true,
    ["response.function_call_arguments.delta"] = true,
}

-- sse_event(ctx, ev) -> ev: one event of vLLM's Responses stream ("event: <type>\ndata:
-- <json>"), passed unchanged. response.completed (vLLM sends it for an incomplete
-- response too, with status "incomplete"; response.incomplete and response.failed
-- are read the same way) carries the usage; error the stream's failure. Until then the
-- output so far is the text deltas seen: a lower bound, what a client that leaves is
-- billed without the engine records, which settle it exactly. A stored response's
-- replay (GET ...?stream=true) bills nothing.
function _M.sse_event(ctx, ev)
    if ctx.route ~= "responses" then
        return ev
    end
    local kind, nl = usage.named_event(ev)
    if not kind then
        return ev
    end
    if DELTAS[kind] then
        local n = (ctx.m_deltas or 0) + 1
        ctx.m_deltas = n
        if ctx.u_source ~= "final" then
            ctx.u_prompt = ctx.u_prompt or ctx.token_estimate or 0
            ctx.u_completion = n
            ctx.u_source = "running"
        end
        return ev
    end
    local final = kind == "response.completed" or kind == "response.incomplete"
        or kind == "response.failed"
    if not final and kind ~= "error" then
        return ev
    end
    local d = usage.event_data(ev, nl)
    if not d then
        return ev
    end
    if final then
        ctx.sse_done = true
        local r = d.response
        if type(r) == "table" then
            read_usage(ctx, r.usage)
            if kind == "response.failed" and not ctx.error then
                local e = r.error
                ctx.error = type(e) == "table" and type(e.code) == "string" and e.code
                    or "response_failed"
            end
        end
    else
        usage.stream_error(ctx, type(d.code) == "string" and d.code or "stream_error")
    end
    return ev
end

-- whole_usage(ctx, d): the usage of a whole (non-stream) answer, decoded; a stored
-- response's (GET, cancel) bills nothing.
function _M.whole_usage(ctx, d)
    if ctx.route == "responses" then
        read_usage(ctx, d.usage)
    end
end

-- upstream_error(ctx, err) -> err: vLLM's refusal of a forwarded request. Its 404 of a
-- response id that this key made (vLLM stored none: store false, or a replica that
-- restarted) is the edge's own 404 of an unknown id, so that both read the same.
function _M.upstream_error(ctx, err)
    if err.status ~= 404 then
        return err
    end
    if ctx.no_body then
        local _, e = not_found(ctx.model_id)
        return e
    end
    local pid = ctx.body and ctx.body.previous_response_id
    if ctx.history and type(pid) == "string" then
        local _, e = not_found(pid, "previous_response_id")
        return e
    end
    return err
end

-- (errors and limit headers: OpenAI's, the defaults)

return api.define(_M)
