-- tokengate.apis.messages: the Anthropic Messages API's shapes at the edge: the body checks,
-- the usage of a stream's events and of a whole answer, the error shape, count_tokens'
-- answer.

local t = ...
local json = require "tokengate.json"
local messages = require "tokengate.apis.messages"

local case, eq = t.case, t.eq

local MODELS = { m = { name = "m", max_model_len = 100 } }
local EDGE = {
    structured_output = { max_bytes = 200, max_depth = 5, max_properties = 3 },
    max_json_depth = 64, max_unknown_fields_bytes = 20, template_kwargs_allowed = {},
}

-- validate(route, text) -> the error's {status, code, param}, or "ok" and the body
local function validate(route, text)
    local body = assert(json.decode(text))
    return t.validated(body, messages.validate(route, body, MODELS, EDGE))
end

case("a minimal body passes; vLLM takes an empty messages list", function()
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[]}'), "ok")
    eq(validate("count_tokens", '{"model":"m","messages":[{"role":"user","content":"x"}]}'),
        "ok")
end)

case("max_tokens is required on /v1/messages only, an integer >= 1", function()
    eq(validate("messages", '{"model":"m","messages":[]}'),
        { 400, "missing_required_parameter", "max_tokens" })
    eq(validate("messages", '{"model":"m","max_tokens":"5","messages":[]}'),
        { 400, "invalid_value", "max_tokens" })
    eq(validate("messages", '{"model":"m","max_tokens":0,"messages":[]}'),
        { 400, "invalid_value", "max_tokens" })
    eq(validate("messages", '{"model":"m","max_tokens":1.5,"messages":[]}'),
        { 400, "invalid_value", "max_tokens" })
    local ok, body = validate("messages", '{"model":"m","max_tokens":5.0,"messages":[]}')
    eq({ ok, json.encode(body) }, { "ok", '{"model":"m","max_tokens":5,"messages":[]}' })
    eq(validate("count_tokens", '{"model":"m","max_tokens":"x","messages":[]}'), "ok")
end)

case("the shapes the edge reads are checked, naming the field", function()
    eq(validate("messages", '{"max_tokens":5,"messages":[]}'),
        { 400, "missing_required_parameter", "model" })
    eq(validate("messages", '{"model":null,"max_tokens":5,"messages":[]}'),
        { 400, "missing_required_parameter", "model" })
    -- present but not a string: a wrong type, not a missing field
    eq(validate("messages", '{"model":1,"max_tokens":5,"messages":[]}'),
        { 400, "invalid_type", "model" })
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":{}}'),
        { 400, "invalid_type", "messages" })
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[{"role":"user"}]}'),
        { 400, "invalid_type", "messages[0].content" })
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[{"content":"x"}]}'),
        { 400, "invalid_type", "messages[0]" })
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[],"stream":"yes"}'),
        { 400, "invalid_type", "stream" })
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[],"system":1}'),
        { 400, "invalid_type", "system" })
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[],"tools":{}}'),
        { 400, "invalid_type", "tools" })
    eq(validate("messages", '{"model":"x","max_tokens":5,"messages":[]}'),
        { 404, "model_not_found", "model" })
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[],'
        .. '"chat_template_kwargs":{"tools":[]}}'),
        { 400, "unsupported_parameter", "chat_template_kwargs.tools" })
end)

case("unknown fields and output_config's schema are bounded", function()
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[],'
        .. '"not_a_field":"0123456789abcdef"}'), { 400, "unknown_fields_too_large",
                                                   "not_a_field" })
    -- a field of /v1/messages counts as unknown on count_tokens
    eq(validate("count_tokens", '{"model":"m","messages":[],"stop_sequences":["abcdefgh"]}'),
        { 400, "unknown_fields_too_large", "stop_sequences" })
    eq(validate("messages", '{"model":"m","max_tokens":5,"messages":[],"output_config":'
        .. '{"format":{"type":"json_schema","json_schema":{"properties":{"a":{},"b":{},'
        .. '"c":{},"d":{}}}}}}'), { 400, "structured_output_too_complex",
                                    "output_config.format.json_schema" })
end)

-- events(list) -> ctx after sse_event saw each event text, and what it passed on
local function events(list)
    local ctx, out = {}, {}
    for i = 1, #list do
        out[i] = messages.sse_event(ctx, list[i])
    end
    return ctx, out
end

case("a stream's usage: input from message_start, output from the last delta", function()
    local list = {
        'event: message_start\ndata: {"type":"message_start","message":{"id":"x",'
            .. '"usage":{"input_tokens":7,"output_tokens":0,"cache_read_input_tokens":16}}}',
        'event: content_block_delta\ndata: {"type":"content_block_delta","delta":'
            .. '{"type":"text_delta","text":"\\"usage\\":{\\"output_tokens\\":99}"}}',
    }
    local ctx, out = events(list)
    eq(out, list)
    -- (the delta's text is no usage: it is one delta, one token so far)
    eq({ ctx.u_prompt, ctx.u_completion, ctx.u_cached, ctx.u_source },
        { 23, 1, 16, "running" })
    ctx = events({ list[1], list[2],
        'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
            .. '"max_tokens"},"usage":{"input_tokens":7,"output_tokens":5,'
            .. '"cache_read_input_tokens":16,"cache_creation_input_tokens":2}}',
        'event: message_stop\ndata: {"type":"message_stop"}' })
    eq({ ctx.u_prompt, ctx.u_completion, ctx.u_cached, ctx.u_source, ctx.sse_done },
        { 25, 5, 16, "final", true })
end)

case("a stream's error event names the error; broken events are passed on", function()
    local ctx, out = events({
        'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
            .. '"message":"m"}}',
        "event: message_start\ndata: {not json",
        "data: [DONE]", "event: ping" })
    eq(ctx.error, "overloaded_error")
    eq(ctx.u_source, nil)
    eq(#out, 4)
end)

case("a whole answer's usage", function()
    local ctx = {}
    messages.whole_usage(ctx, { usage = { input_tokens = 3, output_tokens = 4 } })
    eq({ ctx.u_prompt, ctx.u_completion, ctx.u_cached, ctx.u_source }, { 3, 4, 0, "final" })
    ctx = {}
    messages.whole_usage(ctx, { type = "error" })
    eq(ctx.u_source, nil)
end)

case("errors in Anthropic's shape, typed by status", function()
    local function typed(status, code)
        local d = assert(json.decode(messages.error_body({ status = status, code = code,
                                                           message = "why" })))
        eq({ d.type, d.error.message, #d[json.KEYS], #d.error[json.KEYS] },
            { "error", "why", 2, 2 })
        return d.error.type
    end
    eq({ typed(400), typed(401), typed(403), typed(404), typed(405), typed(413),
         typed(415), typed(429), typed(500), typed(502), typed(503, "overloaded"),
         typed(503, "model_waking"), typed(503, "counter_unavailable"), typed(504) },
        { "invalid_request_error", "authentication_error", "permission_error",
          "not_found_error", "invalid_request_error", "request_too_large",
          "invalid_request_error", "rate_limit_error", "api_error", "api_error",
          "overloaded_error", "overloaded_error", "api_error", "timeout_error" })
end)

case("count_tokens answers vLLM's body; a prompt above the context is refused", function()
    eq(messages.count_answer(MODELS.m, 12),
        '{"input_tokens":12,"context_management":{"original_input_tokens":12}}')
    eq(messages.count_answer(MODELS.m, 100),
        '{"input_tokens":100,"context_management":{"original_input_tokens":100}}')
    local text, err = messages.count_answer(MODELS.m, 101)
    eq({ text, err.status, err.code }, { nil, 400, "context_length_exceeded" })
end)

case("until message_delta, a stream's output is the text deltas seen", function()
    local delta = 'event: content_block_delta\ndata: {"type":"content_block_delta"}'
    local ctx = events({ delta, -- before message_start: nothing to bill yet
        'event: message_start\ndata: {"message":{"usage":{"input_tokens":7}}}',
        delta, delta, delta })
    eq({ ctx.u_prompt, ctx.u_completion, ctx.u_source }, { 7, 4, "running" })
    ctx = events({ 'event: message_start\ndata: {"message":{"usage":{"input_tokens":7}}}',
        delta, 'event: message_delta\ndata: {"usage":{"input_tokens":7,"output_tokens":3}}',
        delta })
    eq({ ctx.u_completion, ctx.u_source }, { 3, "final" })
end)

case("a path under /v1/messages that is no route still speaks this API", function()
    local apis = require "tokengate.apis"
    local base = require("tokengate.api").BASE
    eq(apis.api(apis.route("/v1/messages")), messages)
    eq(apis.api(nil, "/v1/messages/batches"), messages)
    eq(apis.api(nil, "/v1/messages/"), messages)
    eq(apis.api(nil, "/v1/message"), base)
    eq(apis.api(nil, "/v1/chat/completions/x"), base)
    eq(apis.api(apis.route("/v1/chat/completions")), require "tokengate.apis.chat")
end)
