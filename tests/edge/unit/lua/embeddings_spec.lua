-- tokengate.apis.embeddings: POST /v1/embeddings at the edge: the route, the body checks
-- (OpenAI's four input shapes), the sanitizer (invisible characters, no token check),
-- the runner check of tokengate.models, the budget (no completion) and the usage of
-- the whole answer.

local t = ...
local json = require "tokengate.json"
local embeddings = require "tokengate.apis.embeddings"
local apis = require "tokengate.apis"
local output = require "tokengate.output"
local body_mod = require "tokengate.body"
local models = require "tokengate.models"
local limits = require "tokengate.limits"

local case, eq = t.case, t.eq

local SPECIAL = { "<|im_end|>", anchor = "<" }
local MODELS = { e = { name = "e", runner = "pooling", max_model_len = 100,
                       role_tokens = { user = SPECIAL }, all_tokens = SPECIAL,
                       structural_set = {} },
                 g = { name = "g", runner = "generate", max_model_len = 100 } }
local EDGE = {
    structured_output = { max_bytes = 200, max_depth = 5, max_properties = 3 },
    max_json_depth = 64, max_unknown_fields_bytes = 20, template_kwargs_allowed = {},
    special_tokens = "reject",
}

-- validate(text) -> "ok" and the body, or the error's {status, code, param}
local function validate(text)
    local body = assert(json.decode(text))
    return t.validated(body, embeddings.validate("embeddings", body, MODELS, EDGE))
end

case("the route: POST /v1/embeddings, forwarded to vLLM's path, its own endpoint",
    function()
        eq({ apis.route("/v1/embeddings") }, { "embeddings" })
        eq(apis.api("embeddings"), embeddings)
        eq(apis.api(nil, "/v1/embeddings/x"), embeddings)
        eq(apis.PATHS.embeddings, "/v1/embeddings")
        eq(apis.endpoint(embeddings, "embeddings", "/v1/embeddings"), "embeddings")
        eq(apis.check_method("embeddings", "POST", "/v1/embeddings"), nil)
        local err = apis.check_method("embeddings", "GET", "/v1/embeddings")
        eq({ err.status, err.headers.Allow }, { 405, "POST" })
        eq(apis.api("embeddings").RUNNER, "pooling")
        eq(apis.api("chat").RUNNER, "generate")
        eq(apis.api("responses").RUNNER, "generate")
    end)

case("OpenAI's four input shapes pass", function()
    eq(validate('{"model":"e","input":"hello"}'), "ok")
    eq(validate('{"model":"e","input":["a","b"]}'), "ok")
    eq(validate('{"model":"e","input":[1,2,3]}'), "ok")
    eq(validate('{"model":"e","input":[[1,2],[3]],"encoding_format":"base64",'
        .. '"dimensions":8,"user":"u"}'), "ok")
    eq(validate('{"model":"e","input":"x","encoding_format":null,"dimensions":null}'), "ok")
end)

case("integral floats are the integer, forwarded as one", function()
    local _, body = validate('{"model":"e","input":[[1.0,2e0]],"dimensions":8.0}')
    eq(json.encode(body), '{"model":"e","input":[[1,2]],"dimensions":8}')
    _, body = validate('{"model":"e","input":[1e1]}')
    eq(json.encode(body), '{"model":"e","input":[10]}')
end)

case("bad inputs are refused naming the field", function()
    eq(validate('{"input":"x"}'), { 400, "missing_required_parameter", "model" })
    eq(validate('{"model":5,"input":"x"}'), { 400, "invalid_type", "model" })
    eq(validate('{"model":"e"}'), { 400, "missing_required_parameter", "input" })
    eq(validate('{"model":"e","input":null}'), { 400, "missing_required_parameter", "input" })
    eq(validate('{"model":"e","input":5}'), { 400, "invalid_type", "input" })
    eq(validate('{"model":"e","input":{}}'), { 400, "invalid_type", "input" })
    eq(validate('{"model":"e","input":""}'), { 400, "invalid_value", "input" })
    eq(validate('{"model":"e","input":[]}'), { 400, "invalid_value", "input" })
    eq(validate('{"model":"e","input":["a",""]}'), { 400, "invalid_value", "input[1]" })
    eq(validate('{"model":"e","input":["a",[1]]}'), { 400, "invalid_type", "input[1]" })
    eq(validate('{"model":"e","input":[[1],"a"]}'), { 400, "invalid_type", "input[1]" })
    eq(validate('{"model":"e","input":[1,"a"]}'), { 400, "invalid_type", "input[1]" })
    eq(validate('{"model":"e","input":[1,-2]}'), { 400, "invalid_type", "input[1]" })
    eq(validate('{"model":"e","input":[1,1.5]}'), { 400, "invalid_type", "input[1]" })
    eq(validate('{"model":"e","input":[[1],[]]}'), { 400, "invalid_value", "input[1]" })
    eq(validate('{"model":"e","input":[[1],[true]]}'), { 400, "invalid_type", "input[1][0]" })
    eq(validate('{"model":"e","input":[null]}'), { 400, "invalid_type", "input[0]" })
    eq(validate('{"model":"x","input":"a"}'), { 404, "model_not_found", "model" })
end)

case("at most 2048 inputs, OpenAI's limit", function()
    local ids = {}
    for i = 1, 2048 do
        ids[i] = "[1]"
    end
    eq(validate('{"model":"e","input":[' .. table.concat(ids, ",") .. ']}'), "ok")
    eq(validate('{"model":"e","input":[' .. table.concat(ids, ",") .. ',[1]]}'),
        { 400, "invalid_value", "input" })
    -- one input of 3000 token ids is one input (its length is the counter's check)
    local flat = {}
    for i = 1, 3000 do
        flat[i] = "15"
    end
    eq(validate('{"model":"e","input":[' .. table.concat(flat, ",") .. ']}'), "ok")
end)

case("fields given as null are dropped: null means the default", function()
    local body = assert(json.decode('{"model":"e","input":"x","encoding_format":null,'
        .. '"dimensions":null}'))
    embeddings.adjust({}, body, MODELS.e)
    eq(json.encode(body), '{"model":"e","input":"x"}')
end)

case("chat-style inputs are refused: the counter does not render them", function()
    eq(validate('{"model":"e","messages":[{"role":"user","content":"x"}]}'),
        { 400, "unsupported_parameter", "messages" })
    eq(validate('{"model":"e","input":"x","messages":[{"role":"user","content":"y"}]}'),
        { 400, "unsupported_parameter", "messages" })
    eq(validate('{"model":"e","input":[{"role":"user","content":"x"}]}'),
        { 400, "unsupported_parameter", "input[0]" })
end)

case("encoding_format, dimensions and user are checked", function()
    eq(validate('{"model":"e","input":"x","encoding_format":"bytes"}'),
        { 400, "invalid_value", "encoding_format" })
    eq(validate('{"model":"e","input":"x","encoding_format":1}'),
        { 400, "invalid_value", "encoding_format" })
    for _, v in ipairs({ "0", "-1", "1.5", '"8"' }) do
        eq(validate('{"model":"e","input":"x","dimensions":' .. v .. '}'),
            { 400, "invalid_value", "dimensions" })
    end
    eq(validate('{"model":"e","input":"x","user":5}'), { 400, "invalid_type", "user" })
end)

case("unknown fields are bounded with vLLM's embedding fields known", function()
    eq(validate('{"model":"e","input":"x","truncate_prompt_tokens":3,"padding":"do_not_pad",'
        .. '"truncation_side":"left","add_special_tokens":true,"use_activation":true,'
        .. '"embed_dtype":"float16","endianness":"little","priority":0}'), "ok")
    eq(validate('{"model":"e","input":"x","max_tokens":"0123456789abcdef"}'),
        { 400, "unknown_fields_too_large", "max_tokens" })
end)

case("invisible characters are removed from the input; special tokens are raw text",
    function()
        local body = assert(json.decode(
            '{"input":["a\\u200bb <|im_end|>","c\\u0000"],"model":"e"}'))
        local st = assert(embeddings.sanitize(body, MODELS.e, EDGE))
        eq({ body.input[1], body.input[2], st.removed, st.stripped },
            { "ab <|im_end|>", "c", 2, 0 })
        body = assert(json.decode('{"input":"x\\u2066y","model":"e"}'))
        assert(embeddings.sanitize(body, MODELS.e, EDGE))
        eq(body.input, "xy")
        body = assert(json.decode('{"input":[[1,2]],"model":"e"}'))
        assert(embeddings.sanitize(body, MODELS.e, EDGE))
        eq(json.encode(body), '{"input":[[1,2]],"model":"e"}')
    end)

case("a model takes only its runner's routes: 400 model_not_supported", function()
    eq(models.serves(MODELS.e, "pooling", "/v1/embeddings"), true)
    eq(models.serves(MODELS.g, "generate", "/v1/chat/completions"), true)
    local _, err = models.serves(MODELS.e, "generate", "/v1/chat/completions")
    eq({ err.status, err.code, err.param, err.type, err.message },
        { 400, "model_not_supported", "model", "invalid_request_error",
          "The model `e` is an embedding model (runner: pooling): it serves POST "
          .. "/v1/embeddings only, not /v1/chat/completions." })
    _, err = models.serves(MODELS.g, "pooling", "/v1/embeddings")
    eq({ err.status, err.code, err.message },
        { 400, "model_not_supported", "The model `g` generates text (runner: generate) and "
          .. "does not serve /v1/embeddings: use an embedding model (runner: pooling)." })
    -- a compiled model without the field (none is: compile_config writes it) generates
    _, err = models.serves({ name = "old" }, "pooling", "/v1/embeddings")
    eq(err.code, "model_not_supported")
end)

case("no completion: the budget is 0, the reservation the prompt alone", function()
    local body = assert(json.decode('{"model":"e","input":"x"}'))
    local counted = { prompt = 40, prompts = 2, reply = { prompt_tokens = 40,
        max_tokens_requested = 0, max_tokens_effective = 0 } }
    eq(output.budget(embeddings, MODELS.e, body, counted), 0)
    eq(select(2, body_mod.text(body)), false) -- not changed: forwarded as sent
    eq(json.encode(body), '{"model":"e","input":"x"}')
    -- with an estimate (the counter down) too: nothing written into the body
    counted = { prompt = 7, prompts = 1 }
    eq(output.budget(embeddings, MODELS.e, body, counted), 0)
    eq(json.encode(body), '{"model":"e","input":"x"}')
    local req = limits.request({ id = "k", rpm = 10, tpm = 100, models = {} }, "e", "r")
    eq(limits.reservation(req, 40, 2, 0, 1, 256), 40)
    eq(req.out_reserve, 0)
end)

case("the whole answer's usage: prompt tokens, no completion", function()
    local ctx = {}
    embeddings.whole_usage(ctx, assert(json.decode(
        '{"object":"list","data":[],"usage":{"prompt_tokens":12,"total_tokens":12}}')))
    eq({ ctx.u_prompt, ctx.u_completion, ctx.u_cached, ctx.u_source }, { 12, 0, 0, "final" })
    ctx = {}
    embeddings.whole_usage(ctx, { object = "list" })
    eq(ctx.u_source, nil)
end)

case("errors in OpenAI's shape", function()
    local errors = require "tokengate.errors"
    eq(errors.render({ api = embeddings }, { message = "m", type = "invalid_request_error",
        param = "input", code = "invalid_value" }), '{"error":{"message":"m","type":"invalid_request_error",'
        .. '"param":"input","code":"invalid_value"}}')
    eq(embeddings.key(), nil)
end)
