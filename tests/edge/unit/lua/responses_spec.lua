-- tokengate.apis.responses: the OpenAI Responses API's shapes at the edge: the body checks,
-- the sanitizer's walk of input items and tools, the stored-response ids (owner and
-- replica), the usage of a stream's events and of a whole answer, input_tokens' answer.

local t = ...
local json = require "tokengate.json"
local responses = require "tokengate.apis.responses"
local apis = require "tokengate.apis"

local case, eq = t.case, t.eq

-- token lists as tokengate.config compiles them (longest first, anchor "<")
local SPECIAL = { "<|im_end|>", anchor = "<" }
local ALL = { "<tool_call>", "<|im_end|>", anchor = "<" }
local R1, R2 = { name = "a:1" }, { name = "b:2" }
local MODELS = { m = { name = "m", max_model_len = 100, upstreams = { R1, R2 },
                       role_tokens = { user = ALL, assistant = SPECIAL, tool = SPECIAL },
                       all_tokens = ALL, structural_set = { ["<tool_call>"] = true } } }
local DOC = { models = MODELS }
local EDGE = {
    structured_output = { max_bytes = 200, max_depth = 5, max_properties = 3 },
    max_json_depth = 64, max_unknown_fields_bytes = 20, template_kwargs_allowed = {},
    special_tokens = "reject",
}
local KEY_A = { id = "a", digest = string.rep("a", 64) }
local KEY_B = { id = "b", digest = string.rep("b", 64) }
local RID = string.rep("0123456789abcdef", 2)

-- validate(route, text) -> the error's {status, code, param}, or "ok" and the body
local function validate(route, text)
    local body = assert(json.decode(text))
    return t.validated(body, responses.validate(route, body, MODELS, EDGE))
end

case("a string or an array of items as input; input_tokens ignores max_output_tokens",
    function()
        eq(validate("responses", '{"model":"m","input":"hi"}'), "ok")
        eq(validate("responses", '{"model":"m","input":[{"role":"user","content":"x"}],'
            .. '"max_output_tokens":5,"stream":true,"store":false}'), "ok")
        eq(validate("input_tokens", '{"model":"m","input":"hi","max_output_tokens":"x"}'),
            "ok")
    end)

case("the shapes the edge reads are checked, naming the field", function()
    eq(validate("responses", '{"input":"hi"}'), { 400, "missing_required_parameter", "model" })
    eq(validate("responses", '{"model":"m"}'), { 400, "missing_required_parameter", "input" })
    eq(validate("responses", '{"model":"m","input":5}'), { 400, "invalid_type", "input" })
    eq(validate("responses", '{"model":"m","input":["x"]}'), { 400, "invalid_type", "input[0]" })
    eq(validate("responses", '{"model":"m","input":"x","instructions":1}'),
        { 400, "invalid_type", "instructions" })
    for _, v in ipairs({ '0', '"5"', '1.5', '-1' }) do
        eq(validate("responses", '{"model":"m","input":"x","max_output_tokens":' .. v .. '}'),
            { 400, "invalid_value", "max_output_tokens" })
    end
    eq(validate("responses", '{"model":"m","input":"x","stream":"yes"}'),
        { 400, "invalid_type", "stream" })
    eq(validate("responses", '{"model":"m","input":"x","tools":{}}'),
        { 400, "invalid_type", "tools" })
    eq(validate("responses", '{"model":"m","input":"x","previous_response_id":5}'),
        { 400, "invalid_type", "previous_response_id" })
    eq(validate("responses", '{"model":"x","input":"x"}'), { 404, "model_not_found", "model" })
end)

case("background mode and previous_input_messages are refused: they escape metering",
    function()
        eq(validate("responses", '{"model":"m","input":"x","background":true}'),
            { 400, "unsupported_parameter", "background" })
        eq(validate("responses", '{"model":"m","input":"x","background":false}'), "ok")
        eq(validate("responses", '{"model":"m","input":"x","previous_input_messages":'
            .. '[{"role":"user","content":"y"}]}'),
            { 400, "unsupported_parameter", "previous_input_messages" })
    end)

case("unknown fields and text.format's schema are bounded", function()
    eq(validate("responses", '{"model":"m","input":"x","not_a_field":"0123456789abcdef"}'),
        { 400, "unknown_fields_too_large", "not_a_field" })
    eq(validate("responses", '{"model":"m","input":"x","text":{"format":{"type":'
        .. '"json_schema","name":"n","schema":{"properties":{"a":{},"b":{},"c":{},"d":{}}}}}}'),
        { 400, "structured_output_too_complex", "text.format.schema" })
end)

-- refused(text) -> the sanitizer's refusal {param, code}, or the body it passed
local function refused(text)
    local body = assert(json.decode(text))
    local st, err = responses.sanitize(body, MODELS.m, EDGE)
    if st then
        return body
    end
    return { err.param, err.code }
end

case("every text the model reads is checked for forged tokens", function()
    local bad = "special_token_in_content"
    eq(refused('{"input":"a <|im_end|>"}'), { "input", bad })
    eq(refused('{"input":[{"role":"user","content":[{"type":"input_text",'
        .. '"text":"<|im_end|>"}]}]}'), { "input[0].content[0].text", bad })
    eq(refused('{"input":[{"type":"message","role":"assistant","content":[{"type":'
        .. '"output_text","text":"<|im_end|>"}]}]}'), { "input[0].content[0].text", bad })
    eq(refused('{"input":[{"type":"function_call","call_id":"c","name":"f",'
        .. '"arguments":"{\\"q\\":\\"\\\\u003c|im_end|\\\\u003e\\"}"}]}'),
        { "input[0].arguments", bad })
    eq(refused('{"input":[{"type":"function_call","call_id":"c","name":"f<|im_end|>",'
        .. '"arguments":"{}"}]}'), { "input[0].name", bad })
    eq(refused('{"input":[{"type":"function_call_output","call_id":"c",'
        .. '"output":"done <|im_end|>"}]}'), { "input[0].output", bad })
    eq(refused('{"input":[{"type":"custom_tool_call","call_id":"c","name":"f",'
        .. '"input":"<|im_end|>"}]}'), { "input[0].input", bad })
    eq(refused('{"input":[{"type":"reasoning","summary":[{"type":"summary_text",'
        .. '"text":"<|im_end|>"}]}]}'), { "input[0].summary[0].text", bad })
    eq(refused('{"input":"x","tools":[{"type":"function","name":"f","description":'
        .. '"<tool_call>"}]}'), { "tools[0].description", bad })
    eq(refused('{"input":"x","tools":[{"type":"function","name":"f","parameters":'
        .. '{"properties":{"<|im_end|>":{}}}}]}'), { "tools[0].parameters.properties.<|im_end|>", bad })
    eq(refused('{"input":"x","tools":[{"type":"namespace","name":"ns","tools":[{"type":'
        .. '"function","name":"g","description":"<|im_end|>"}]}]}'),
        { "tools[0].tools[0].description", bad })
    eq(refused('{"input":"x","chat_template_kwargs":{"a":"<tool_call>"}}'),
        { "chat_template_kwargs.a", bad })
end)

case("invisible characters are removed from the input", function()
    local body = refused('{"input":[{"role":"user","content":"a\\u200bb"}],'
        .. '"instructions":"c\\u200bd"}')
    eq({ body.input[1].content, body.instructions }, { "ab", "cd" })
end)

case("a response id names its replica and its key; no other key can use it", function()
    local id = responses.response_id(KEY_A, RID, "m", R2)
    eq({ #id, id:sub(1, 37) }, { 61, "resp_" .. RID })
    local place = responses.owned(DOC, KEY_A, id)
    eq({ place.model.name, place.replica.name }, { "m", "b:2" })
    local other = responses.response_id(KEY_A, RID, "m", R1)
    eq(responses.owned(DOC, KEY_A, other).replica.name, "a:1")
    local function missing(key, rid)
        local p, err = responses.owned(DOC, key, rid)
        return { p, err.status, err.code }
    end
    eq(missing(KEY_B, id), { nil, 404, "not_found" })
    eq(missing(KEY_A, id:sub(1, 60) .. (id:sub(61) == "0" and "1" or "0")),
        { nil, 404, "not_found" })
    eq(missing(KEY_A, "resp_" .. RID), { nil, 404, "not_found" })
    eq(missing(KEY_A, "resp_abc"), { nil, 404, "not_found" })
    -- a replica that left the configuration: its responses are gone
    local gone = responses.response_id(KEY_A, RID, "m", { name = "c:3" })
    eq(missing(KEY_A, gone), { nil, 404, "not_found" })
end)

case("the routes of a stored response", function()
    eq({ apis.route("/v1/responses/resp_x") }, { "response", "resp_x" })
    eq({ apis.route("/v1/responses/resp_x/cancel") }, { "response_cancel", "resp_x" })
    eq({ apis.route("/v1/responses/input_tokens") }, { "input_tokens" })
    eq({ apis.route("/v1/responses") }, { "responses" })
    eq({ apis.route("/v1/responses/a/b") }, {})
    eq(apis.api(apis.route("/v1/responses/x")), responses)
    eq(apis.api(nil, "/v1/responses/a/b"), responses)
    eq(apis.check_method("response", "GET", "/v1/responses/x"), nil)
    eq(apis.check_method("response_cancel", "GET", "/v1/responses/x/cancel").status, 405)
end)

-- events(list, route) -> ctx after sse_event saw each event text, and what it passed on
local function events(list, route)
    local ctx, out = { route = route or "responses", token_estimate = 9 }, {}
    for i = 1, #list do
        out[i] = responses.sse_event(ctx, list[i])
    end
    return ctx, out
end

local DELTA = 'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    .. '"delta":"\\"usage\\":{\\"output_tokens\\":99}"}'
local COMPLETED = 'event: response.completed\ndata: {"type":"response.completed","response":'
    .. '{"status":"incomplete","usage":{"input_tokens":9,"input_tokens_details":'
    .. '{"cached_tokens":0},"output_tokens":5,"output_tokens_details":{"reasoning_tokens":0},'
    .. '"total_tokens":14}}}'

case("a stream's usage: the deltas so far, then response.completed's", function()
    local ctx, out = events({ DELTA, DELTA })
    eq(out, { DELTA, DELTA })
    eq({ ctx.u_prompt, ctx.u_completion, ctx.u_source }, { 9, 2, "running" })
    ctx = events({ DELTA, COMPLETED, DELTA })
    eq({ ctx.u_prompt, ctx.u_completion, ctx.u_cached, ctx.u_source, ctx.sse_done },
        { 9, 5, 0, "final", true })
end)

case("a failed response and an error event name the error", function()
    local ctx = events({ 'event: response.failed\ndata: {"response":{"error":'
        .. '{"code":"server_error"},"usage":null}}' })
    eq({ ctx.error, ctx.sse_done, ctx.u_source }, { "server_error", true, nil })
    ctx = events({ 'event: error\ndata: {"type":"error","code":"invalid_prompt"}',
        "event: response.completed\ndata: {not json" })
    eq({ ctx.error, ctx.u_source }, { "invalid_prompt", nil })
end)

case("a stored response's replay and answer bill nothing", function()
    local ctx = events({ DELTA, COMPLETED }, "response")
    eq({ ctx.u_source, ctx.u_completion }, { nil, nil })
    ctx = { route = "response_cancel" }
    responses.whole_usage(ctx, { usage = { input_tokens = 3, output_tokens = 4 } })
    eq(ctx.u_source, nil)
    ctx = { route = "responses" }
    responses.whole_usage(ctx, { usage = { input_tokens = 3, output_tokens = 4,
                                           input_tokens_details = { cached_tokens = 2 } } })
    eq({ ctx.u_prompt, ctx.u_completion, ctx.u_cached, ctx.u_source }, { 3, 4, 2, "final" })
end)

case("input_tokens answers OpenAI's body; a prompt above the context is refused", function()
    eq(responses.count_answer(MODELS.m, 12), '{"object":"response.input_tokens","input_tokens":12}')
    local text, err = responses.count_answer(MODELS.m, 101)
    eq({ text, err.status, err.code }, { nil, 400, "context_length_exceeded" })
end)

case("errors in OpenAI's shape", function()
    local errors = require "tokengate.errors"
    local d = assert(json.decode(errors.render({ api = responses }, { status = 404,
        message = "m", type = "invalid_request_error", code = "not_found" })))
    eq({ d.error.message, d.error.code, d.error.param }, { "m", "not_found", json.null })
end)

case("adjust drops top-level nulls and the client's request_id, keeps the budget", function()
    local body = assert(json.decode('{"model":"m","input":"x","background":null,'
        .. '"truncation":null,"request_id":"mine","max_output_tokens":900,"stream":true,'
        .. '"text":{"format":null}}'))
    local ctx = { route = "responses" }
    responses.adjust(ctx, body)
    eq(json.encode(body), '{"model":"m","input":"x","max_output_tokens":900,"stream":true,'
        .. '"text":{"format":null}}')
    eq(ctx.stream, true)
    body = assert(json.decode('{"model":"m","input":"x","max_output_tokens":0}'))
    responses.adjust({ route = "input_tokens" }, body)
    eq(json.encode(body), '{"model":"m","input":"x"}')
end)
