-- The Anthropic Messages API (POST /v1/messages, POST /v1/messages/count_tokens): what
-- of it the edge reads, in one place (the hooks: tokengate.api):
--
--   key:        x-api-key, or Authorization: Bearer (what the anthropic SDK sends)
--   validate:   the body's shape the edge relies on (vLLM's AnthropicMessagesRequest /
--               AnthropicCountTokensRequest, vllm/entrypoints/anthropic/protocol.py;
--               the counter checks the rest, naming the field)
--   sanitize:   every text the model reads: system, content blocks (text, thinking,
--               tool_use names and inputs, tool_result content), tools
--   adjust:     a stream noted; vLLM itself asks its chat path for stream usage
--   usage:      message_start (input tokens) and message_delta (output tokens) of a
--               stream, usage of a whole answer (vllm/entrypoints/anthropic/serving.py
--               _build_anthropic_usage: input_tokens excludes cache_read_input_tokens and
--               cache_creation_input_tokens, so the prompt is their sum)
--   errors:     {"type": "error", "error": {"type", "message"}} with Anthropic's types
--   rate:       anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}, reset in
--               RFC 3339 (docs.anthropic.com, "Rate limits": response headers)
--   session:    SESSION_FIELDS, the body's fields that name the agent session when no
--               header does (tokengate.session; default OpenAI's safety_identifier, user)
--
-- count_tokens is answered here, by the counter's count alone: nothing reaches vLLM.

local ngx = ngx
local json = require "tokengate.json"
local errors = require "tokengate.errors"
local api = require "tokengate.api"
local bounds = require "tokengate.bounds"
local body_mod = require "tokengate.body"
local sanitize = require "tokengate.sanitize"
local output = require "tokengate.output"
local usage = require "tokengate.usage"
local clock = require "tokengate.clock"

local type, tonumber = type, tonumber
local format, find = string.format, string.find
local ngx_now = ngx.now
local is_array, is_object, json_set, null = json.is_array, json.is_object, json.set, json.null
local fail = errors.refuse

local set = bounds.set

local _M = {
    NAME = "messages",
    ROUTES = { ["/v1/messages"] = "messages", ["/v1/messages/count_tokens"] = "count_tokens" },
    -- paths under it that are no route still get this API's key header and error shape
    PREFIX = "/v1/messages",
    PATHS = { messages = "/v1/messages" }, -- count_tokens is never forwarded
    ALLOW = { messages = "POST", count_tokens = "POST" },
    -- tokengate.v1.ENDPOINT_MESSAGES, ENDPOINT_MESSAGES_COUNT_TOKENS
    ENDPOINT = { messages = 3, count_tokens = 4 },
    -- The fields of vLLM 0.32's AnthropicMessagesRequest and AnthropicCountTokensRequest
    -- (vllm/entrypoints/anthropic/protocol.py; tests/edge/test_edge_costly_inputs.py
    -- compares them with vLLM's models): any other top-level field counts against
    -- edge.max_unknown_fields_bytes (tokengate.bounds).
    FIELDS = {
        messages = set({
            "cache_salt", "chat_template_kwargs", "ec_transfer_params", "kv_transfer_params",
            "max_tokens", "messages", "metadata", "mm_payload", "model", "output_config",
            "return_mm_kwargs", "stop_sequences", "stream", "system", "temperature",
            "thinking", "tool_choice", "tools", "top_k", "top_p", "vllm_xargs",
            "watermarking",
        }),
        count_tokens = set({
            "chat_template_kwargs", "messages", "model", "output_config", "system",
            "thinking", "tool_choice", "tools",
        }),
    },
    -- answered by the edge itself, after the count and the request limit
    LOCAL = { count_tokens = true },
    -- Anthropic's end-user id (metadata.user_id; Claude Code puts its session in it too)
    SESSION_FIELDS = { "metadata.user_id" },
    FINISH_FIELD = "stop_reason",
    -- the 401 of a request that presents no key
    MISSING = errors.new(401, "You didn't provide an API key. Send it as 'x-api-key: "
        .. "<key>' or 'Authorization: Bearer <key>'.", nil, "invalid_api_key"),
}

-- key(var) -> the key of the x-api-key header | nil (then Authorization: Bearer is
-- read, tokengate.auth). var: ngx.var.
function _M.key(var)
    local k = var.http_x_api_key
    if type(k) == "string" and k ~= "" then
        return k
    end
    return nil
end

-- validate(route, body, models, edge) -> model entry | nil, err (400/404). Checks:
-- model (a configured one), messages (an array, which vLLM takes empty too, of objects
-- with a string role and string or array content), max_tokens (an integer >= 1, required on /v1/messages;
-- count_tokens ignores one, as vLLM does), stream (a boolean), system (a string or an
-- array), tools (an array), chat_template_kwargs (edge.chat_template_kwargs_allowed),
-- then the bounds: unknown fields, and output_config.format.json_schema as a
-- structured-output schema (tokengate.bounds).
function _M.validate(route, body, models, edge)
    local ok, err = body_mod.api_model(body)
    if not ok then
        return nil, err
    end
    local msgs = body.messages
    if not is_array(msgs) then
        return fail(400, "messages: must be an array of messages", "messages", "invalid_type")
    end
    for i = 1, #msgs do
        local m = msgs[i]
        local param = format("messages[%d]", i - 1)
        if not is_object(m) or type(m.role) ~= "string" then
            return fail(400, param .. ": must be an object with a string role", param,
                "invalid_type")
        end
        local c = m.content
        if type(c) ~= "string" and not is_array(c) then
            return fail(400, param .. ".content: must be a string or an array of content "
                .. "blocks", param .. ".content", "invalid_type")
        end
    end
    if route == "messages" then
        ok, err = body_mod.api_posint(body, "max_tokens", true)
        if ok then
            ok, err = body_mod.api_bool(body, "stream")
        end
        if not ok then
            return nil, err
        end
    end
    local sys = body.system
    if sys ~= nil and sys ~= null and type(sys) ~= "string" and not is_array(sys) then
        return fail(400, "system: must be a string or an array of text blocks", "system",
            "invalid_type")
    end
    local oc = body.output_config
    local schema = is_object(oc) and is_object(oc.format) and oc.format.json_schema
    return body_mod.check_api(_M.FIELDS[route], body, models, edge,
        "output_config.format.json_schema", schema)
end

-- blocks(st, content, param, tokens): one message's content blocks (or a system's):
-- text and thinking read as text, a tool_use's name and input (vLLM writes the input
-- as the tool call's JSON arguments), a tool_result's content (a string or blocks).
-- a block's name (tool_use) and the identifiers that tie a tool result to its call
local NAME, BLOCK_IDS = { "name" }, { "id", "tool_use_id" }

local function blocks(st, content, param, tokens)
    if type(content) == "string" then
        return sanitize.text(st, content, param, tokens)
    end
    if not is_array(content) then
        return content
    end
    sanitize.content(st, content, param, tokens)
    for j = 1, #content do
        local b = content[j]
        if is_object(b) then
            local bparam = format("%s[%d]", param, j - 1)
            sanitize.strings(st, b, bparam, tokens, sanitize.text, NAME)
            sanitize.strings(st, b, bparam, tokens, sanitize.check, BLOCK_IDS)
            if is_object(b.input) then
                sanitize.value(st, b.input, bparam .. ".input", tokens, true)
            end
            if b.content ~= nil then
                b.content = blocks(st, b.content, bparam .. ".content", tokens)
            end
        end
    end
    return content
end

-- tool(st, t, param): a tool's name, description and input_schema (tokengate.sanitize.tool)
local function tool(st, t, param)
    sanitize.tool(st, t, param, "input_schema")
end

-- sanitize(body, model, edge) -> counts | nil, err (tokengate.sanitize.verdict's shape):
-- system (the system role's tokens), each message's content (its role's), tools'
-- names, descriptions and input schemas and chat_template_kwargs (every special and
-- structural token: the template renders them into the system turn).
function _M.sanitize(body, model, edge)
    local st = sanitize.state(model, edge)
    if body.system ~= nil then
        body.system = blocks(st, body.system, "system", st.by_role.system)
    end
    local msgs = body.messages
    for i = 1, #msgs do
        local m = msgs[i]
        m.content = blocks(st, m.content, format("messages[%d].content", i - 1),
            st.by_role[m.role])
    end
    sanitize.objects(st, body.tools, "tools", tool)
    return sanitize.finish(st, body)
end

-- adjust(ctx, body, model): a stream sets ctx.stream (vLLM's Anthropic serving asks its
-- chat path for the usage of every chunk itself: nothing to add, nothing to take out);
-- the body is not changed. max_tokens stays as sent: tokengate.output.budget applies
-- the gateway's cap.
function _M.adjust(ctx, body)
    if body.stream == true then
        ctx.stream = true
    end
end

-- count_answer(model, prompt) -> JSON text of vLLM's count_tokens answer
-- ({"input_tokens": n, "context_management": {"original_input_tokens": n}},
-- AnthropicCountTokensResponse) | nil, err (400) for a prompt above the context window,
-- which vLLM's renderer refuses (vllm/renderers/params.py _token_len_check).
function _M.count_answer(model, prompt)
    local _, err = output.above_context(model, prompt, "This model's maximum context length "
        .. "is %d tokens. However, your prompt contains %d input tokens, which exceeds this "
        .. "limit even without any output tokens. Please reduce the length of the input "
        .. "prompt.", "messages")
    if err then
        return nil, err
    end
    return format('{"input_tokens":%d,"context_management":{"original_input_tokens":%d}}',
        prompt, prompt)
end

-- read_usage(ctx, u, final): an Anthropic usage object into ctx's usage fields
-- (tokengate.usage): prompt = input + cache read + cache creation tokens, cached = the
-- cache read ones; final marks the message's last usage.
local function read_usage(ctx, u, final)
    if type(u) ~= "table" then
        return
    end
    local read = tonumber(u.cache_read_input_tokens) or 0
    local input = tonumber(u.input_tokens)
    if input then
        ctx.u_prompt = input + read + (tonumber(u.cache_creation_input_tokens) or 0)
        ctx.u_cached = read
    end
    ctx.u_prompt = ctx.u_prompt or 0
    ctx.u_completion = tonumber(u.output_tokens) or ctx.u_completion or 0
    ctx.u_source = final and "final" or "running"
end

-- vLLM 0.32's Messages stream converts the chat stream's events; when vLLM refuses the
-- request at its engine (after the 200), the chat stream's first event is the refusal,
-- which the converter fails to read as a chunk and passes on as an internal_error
-- whose message is pydantic's complaint about it, the reason cut off
-- (vllm/entrypoints/anthropic/serving.py message_stream_converter; measured: a thinking
-- budget on an engine without --reasoning-parser).
local HIDDEN = " for ChatCompletionStreamResponse"

-- hidden_refusal(body) -> the error event (its text, without the blank line that ends
-- it) that replaces such an internal_error: an invalid_request_error (the client's
-- request was refused; internal_error is no type of Anthropic's API and reads as a
-- server fault to retry) saying what is known.
local function hidden_refusal(body)
    local thinking = is_object(body) and is_object(body.thinking) and body.thinking
    local why = thinking and thinking.type == "enabled"
        and "A thinking budget needs a vLLM started with --reasoning-parser: send the "
            .. "request without thinking, or ask the operator to add the model's parser."
        or "The same request without stream shows vLLM's reason."
    return "event: error\ndata: " .. _M.error_body({ status = 400, message =
        "The model server refused this request before generating (its Messages stream "
        .. "does not pass on why). " .. why })
end

-- sse_event(ctx, ev) -> ev: one event of vLLM's Anthropic stream ("event: <type>\ndata:
-- <json>", without the blank line), passed unchanged but for vLLM's hidden refusal
-- (above). message_start carries the input tokens, message_delta (the last one, after
-- the content) the output tokens, error the stream's failure, message_stop its end.
-- Only those are decoded: the content_block_delta of every token is passed on after a
-- look at its first line, and counted: until message_delta, the output so far is the
-- deltas seen (vLLM writes one per engine step with text, each of at least one token: a
-- lower bound, what a client that leaves is billed without the engine records, which
-- settle it exactly).
function _M.sse_event(ctx, ev)
    local kind, nl = usage.named_event(ev)
    if not kind then
        return ev
    end
    if kind == "content_block_delta" then
        local n = (ctx.m_deltas or 0) + 1
        ctx.m_deltas = n
        if ctx.u_source == "running" then
            ctx.u_completion = n
        end
        return ev
    end
    if kind == "message_stop" then
        ctx.sse_done = true
        return ev
    end
    if kind ~= "message_start" and kind ~= "message_delta" and kind ~= "error" then
        return ev
    end
    local d = usage.event_data(ev, nl)
    if not d then
        return ev
    end
    if kind == "message_start" then
        read_usage(ctx, type(d.message) == "table" and d.message.usage, false)
    elseif kind == "message_delta" then
        read_usage(ctx, d.usage, true)
    else
        local e = d.error
        usage.stream_error(ctx, type(e) == "table" and type(e.type) == "string" and e.type
            or "stream_error")
        if ctx.refused_in_stream and type(e) == "table" and e.type == "internal_error"
                and type(e.message) == "string" and find(e.message, HIDDEN, 1, true) then
            return hidden_refusal(ctx.body)
        end
    end
    return ev
end

-- whole_usage(ctx, d): the usage of a whole (non-stream) answer, decoded.
function _M.whole_usage(ctx, d)
    read_usage(ctx, d.usage, true)
end

-- Anthropic's error types by status (docs.anthropic.com, "Errors"); the edge's own
-- 503s of a full fleet are overloaded_error (Anthropic answers 529 for it; the SDK
-- retries both).
local TYPES = {
    [400] = "invalid_request_error", [401] = "authentication_error",
    [402] = "billing_error", [403] = "permission_error", [404] = "not_found_error",
    [408] = "timeout_error", [413] = "request_too_large", [429] = "rate_limit_error",
    [504] = "timeout_error",
    [529] = "overloaded_error",
}
local OVERLOADED = { overloaded = true, model_waking = true }

-- error_body(err) -> JSON text of err (tokengate.errors.new's shape) in Anthropic's
-- shape: {"type": "error", "error": {"type": <by status>, "message": <message>}}.
-- The edge's code (rate_limit_exceeded, insufficient_quota ...) stays in the usage
-- event and the metrics.
function _M.error_body(err)
    local status = err.status or 500
    local t = TYPES[status]
    if not t then
        if OVERLOADED[err.code] then
            t = "overloaded_error"
        else
            t = status >= 500 and "api_error" or "invalid_request_error"
        end
    end
    local e = json.object()
    json_set(e, "type", t)
    json_set(e, "message", errors.cap(err.message or ""))
    local doc = json.object()
    json_set(doc, "type", "error")
    json_set(doc, "error", e)
    return json.encode(doc)
end

-- rate_headers(h, st): the request and token limits in Anthropic's headers, from
-- tokengate.limits' state {rpm, tpm, remaining_requests, remaining_tokens,
-- reset_requests (s), reset_tokens (s)}; a reset is the RFC 3339 time the window
-- has room again.
function _M.rate_headers(h, st)
    local now = ngx_now()
    h["anthropic-ratelimit-requests-limit"] = st.rpm
    h["anthropic-ratelimit-requests-remaining"] = st.remaining_requests
    h["anthropic-ratelimit-requests-reset"] = clock.rfc3339_ms(now + st.reset_requests)
    h["anthropic-ratelimit-tokens-limit"] = st.tpm
    h["anthropic-ratelimit-tokens-remaining"] = st.remaining_tokens
    h["anthropic-ratelimit-tokens-reset"] = clock.rfc3339_ms(now + st.reset_tokens)
end

return api.define(_M)
