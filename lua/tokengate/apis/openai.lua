-- What OpenAI's chat and completions APIs share (tokengate.apis.chat,
-- tokengate.apis.completions): the request fields vLLM defines for both, the checks of
-- the fields both take (model, stream, stream_options, the completion limits, n), and
-- the stream options the usage watch needs. Not an API module itself.

local json = require "tokengate.json"
local errors = require "tokengate.errors"
local bounds = require "tokengate.bounds"
local body_mod = require "tokengate.body"
local models_mod = require "tokengate.models"

local type = type
local format, find, sub = string.format, string.find, string.sub
local is_object, json_integer, json_number, json_set =
    json.is_object, json.integer, json.number, json.set
local null = json.null
local fail = errors.refuse

local STREAM_FLAGS = { "include_usage", "continuous_usage_stats" }
local POSITIVE_INTS = { "max_tokens", "max_completion_tokens", "n" }
-- the fields both requests type as booleans (vLLM 0.32's ChatCompletionRequest and
-- CompletionRequest): pydantic's lax mode would read "yes" or 1 as true after the
-- request was admitted and forwarded; OpenAI refuses them
local BOOLS = {
    "add_special_tokens", "echo", "ignore_eos", "include_stop_str_in_output",
    "return_mm_kwargs", "return_token_ids", "return_token_offsets",
    "return_tokens_as_token_ids", "skip_special_tokens", "spaces_between_special_tokens",
    "use_beam_search", "watermarking",
}
-- of those, the ones both type `bool`, not `bool | None`: null is refused there too
-- (pydantic's dump, after admission)
local NOT_NULL = { add_special_tokens = true, ignore_eos = true,
                   include_stop_str_in_output = true, skip_special_tokens = true,
                   spaces_between_special_tokens = true, use_beam_search = true }
-- response_format.type values vLLM 0.32 takes (AnyResponseFormat,
-- vllm/entrypoints/generate/base/protocol.py)
local RESPONSE_FORMATS = { text = true, json_object = true, json_schema = true,
                           structural_tag = true }
-- the fields' refusals in OpenAI's wording (tokengate.body)
local WORDS = body_mod.OPENAI_WORDS

local _M = {}

-- fields(only) -> {name -> true}: the fields (and aliases) of vLLM 0.32's
-- ChatCompletionRequest (vllm/entrypoints/openai/chat_completion/protocol.py) or
-- CompletionRequest (.../completion/protocol.py): those both define, and `only` (the
-- route's own); tests/edge/test_edge_costly_inputs.py compares them with vLLM's own
-- models. Any other top-level field is ignored by vLLM
-- (vllm/entrypoints/serve/engine/protocol.py, OpenAIBaseModel: extra="allow").
local SHARED = {
    "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt",
    "ec_transfer_params", "echo", "frequency_penalty", "ignore_eos",
    "include_stop_str_in_output", "kv_transfer_params", "length_penalty", "logit_bias",
    "logprob_token_ids", "logprobs", "max_tokens", "min_p", "min_tokens", "mm_payload",
    "model", "n", "presence_penalty", "priority", "prompt_logprobs", "repetition_detection",
    "repetition_penalty", "request_id", "response_format", "return_mm_kwargs",
    "return_token_ids", "return_token_offsets", "return_tokens_as_token_ids",
    "routed_experts_prompt_start", "seed", "session_id", "skip_special_tokens",
    "spaces_between_special_tokens", "stop", "stop_token_ids", "stream", "stream_interval",
    "stream_options", "structured_outputs", "temperature", "thinking_token_budget", "top_k",
    "top_p", "truncate_prompt_tokens", "truncation_side", "use_beam_search", "user",
    "vllm_xargs", "watermarking",
}

function _M.fields(only)
    local known = bounds.set(SHARED)
    for i = 1, #only do
        known[only[i]] = true
    end
    return known
end

-- booleans(body, names, not_null) -> true | nil, err (400 invalid_type): each of `names`
-- (an array) is a boolean or absent in body, or null unless NOT_NULL or not_null (a set:
-- the route's own) names it
local function booleans(body, names, not_null)
    for i = 1, #names do
        local name = names[i]
        local ok, err = body_mod.api_bool(body, name, WORDS, NOT_NULL[name] or not_null[name])
        if not ok then
            return nil, err
        end
    end
    return true
end

-- logit_bias(body) -> true | nil, err (400): logit_bias is null, absent or an object
-- whose keys are token ids (decimal integers; whether the vocabulary has them is vLLM's
-- to check) and whose values are numbers in [-100, 100] (OpenAI's documented range;
-- vLLM takes any float)
local function logit_bias(body)
    local lb = body.logit_bias
    if lb == nil or lb == null then
        return true
    end
    if not is_object(lb) then
        return fail(400, "'logit_bias' must be an object mapping token ids to numbers",
            "logit_bias", "invalid_type")
    end
    local keys = lb[json.KEYS]
    for i = 1, #keys do
        local k = keys[i]
        local v = lb[k]
        if v ~= nil then
            local param = "logit_bias." .. sub(k, 1, 64)
            if not find(k, "^%d+$") then
                return fail(400, format("Invalid key in '%s': a key must be a token id "
                    .. "(a decimal integer)", "logit_bias"), param, "invalid_value")
            end
            local n = json_number(v)
            if not n then
                return fail(400, format("Invalid type for '%s': expected a number", param),
                    param, "invalid_type")
            end
            if not (n >= -100 and n <= 100) then
                return fail(400, format("'%s' must be in [-100, 100], got %.15g", param, n),
                    param, "invalid_value")
            end
        end
    end
    return true
end

-- response_format(body) -> true | nil, err (400): response_format is null, absent or an
-- object whose type vLLM knows (RESPONSE_FORMATS), json_schema with its json_schema
-- object, whose name is a string and whose schema an object: vLLM 0.32 refuses a
-- missing name with a pydantic dump of every format it tried, a missing or null schema
-- with a dump of its structured-output settings (JsonSchemaResponseFormat,
-- vllm/entrypoints/generate/base/protocol.py; measured)
local function response_format(body)
    local rf = body.response_format
    if rf == nil or rf == null then
        return true
    end
    local t = is_object(rf) and rf.type
    if type(t) ~= "string" then
        return fail(400, "'response_format' must be an object with a string 'type'",
            "response_format", "invalid_type")
    end
    if not RESPONSE_FORMATS[t] then
        return fail(400, "Invalid value for 'response_format.type': expected one of 'text', "
            .. "'json_object', 'json_schema' or 'structural_tag'", "response_format.type",
            "invalid_value")
    end
    if t ~= "json_schema" then
        return true
    end
    local js = rf.json_schema
    if not is_object(js) then
        return fail(400, "'response_format.json_schema' must be an object when "
            .. "'response_format.type' is 'json_schema'", "response_format.json_schema",
            "invalid_type")
    end
    if type(js.name) ~= "string" then
        return fail(400, "'response_format.json_schema.name' must be a string",
            "response_format.json_schema.name", "invalid_type")
    end
    if not is_object(js.schema) then
        return fail(400, "'response_format.json_schema.schema' must be an object (the JSON "
            .. "schema the answer follows)", "response_format.json_schema.schema",
            "invalid_type")
    end
    return true
end

-- check_common(body, models, bools, not_null) -> model entry | nil, err (400/404): the
-- fields chat and completions share (model, stream, stream_options, max_tokens,
-- max_completion_tokens, n, the boolean fields (BOOLS and the route's own `bools`, an
-- array of names; `not_null`: a set of those, shared or its own, whose null the route's
-- vLLM request refuses), logit_bias, response_format an object, the sampling fields' types:
-- tokengate.body api_sampling), in OpenAI's wording.
function _M.check_common(body, models, bools, not_null)
    local model = body.model
    if model == nil or model == null then
        return fail(400, "you must provide a model parameter"
            .. body_mod.envelope_hint(body, "model"), "model", "missing_required_parameter")
    end
    if type(model) ~= "string" then
        return fail(400, "'model' must be a string", "model", "invalid_type")
    end
    local ok, err = body_mod.api_bool(body, "stream", WORDS)
    if not ok then
        return nil, err
    end
    local so = body.stream_options
    if so ~= nil and so ~= null then
        if not is_object(so) then
            return fail(400, "'stream_options' must be an object", "stream_options",
                "invalid_type")
        end
        for i = 1, #STREAM_FLAGS do
            local f = STREAM_FLAGS[i]
            ok, err = body_mod.api_bool(so, f, WORDS)
            if not ok then
                err.param = "stream_options." .. f
                return nil, err
            end
        end
    end
    for i = 1, #POSITIVE_INTS do
        ok, err = body_mod.api_posint(body, POSITIVE_INTS[i], false, WORDS)
        if not ok then
            return nil, err
        end
    end
    ok, err = booleans(body, BOOLS, not_null)
    if ok then
        ok, err = booleans(body, bools, not_null)
    end
    if ok then
        ok, err = logit_bias(body)
    end
    if ok then
        ok, err = response_format(body)
    end
    if ok then
        ok, err = body_mod.api_sampling(nil, body, WORDS)
    end
    if not ok then
        return nil, err
    end
    local m = models[model]
    if not m then
        return models_mod.not_found(model)
    end
    -- n completions cost n times the output: bounded per model (max_n, default 8)
    local n = json_integer(body.n)
    if n and n > m.max_n then
        return fail(400, format("'n' must be at most %d for model %s, got %.17g", m.max_n,
            m.name, n), "n", "invalid_value")
    end
    return m
end

-- validator(check, fields) -> validate(route, body, models, edge) -> model entry | nil,
-- err (400/404): check(body, models, edge), the API's own checks, then the bounds
-- (tokengate.bounds: structured outputs, and the fields that fields[route], the API
-- module's FIELDS, does not name). The validate of chat and completions.
function _M.validator(check, fields)
    return function(route, body, models, edge)
        local model, err = check(body, models, edge)
        if not model then
            return nil, err
        end
        local ok
        ok, err = bounds.check(fields[route], body, edge)
        if not ok then
            return nil, err
        end
        return model
    end
end

-- stream_options(ctx, body): placed() of chat and completions: stream: true gets
-- stream_options {include_usage, continuous_usage_stats} = true (every chunk then
-- carries the cumulative usage, tokengate.usage); what the client asked for is kept in
-- ctx.want_usage / ctx.want_continuous so the body filter can take out what it did not
-- ask for. Made after the count: the counter does not read stream_options.
function _M.stream_options(ctx, body)
    if body.stream ~= true then
        return
    end
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

return _M
