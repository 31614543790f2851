-- OpenAI embeddings (POST /v1/embeddings) of a pooling model (vLLM --runner pooling,
-- models.<name>.runner: pooling): what of it the edge reads, in one place (the hooks:
-- tokengate.api):
--
--   runner:     pooling: the route takes only a pooling model, and a pooling model only
--               this route (tokengate.models.serves: 400 model_not_supported, never
--               forwarded)
--   validate:   the body's shape the edge relies on (vLLM's EmbeddingCompletionRequest,
--               vllm/entrypoints/pooling/embed/protocol.py; the counter checks the rest,
--               naming the field): input as a string, an array of strings, an array of
--               token ids or an array of token-id arrays (OpenAI's four shapes), at most
--               MAX_INPUTS of them; encoding_format, dimensions, user
--   sanitize:   input's strings lose invisible and control characters, as a completions
--               prompt does; special tokens are not checked (below)
--   GENERATES:  false: no completion: 0 completion tokens, nothing written into the
--               body, so the reservation is the prompt's tokens alone and a budget prices
--               them at the model's input price
--   usage:      the whole JSON answer's usage.prompt_tokens (OpenAI's usage object, the
--               default: vLLM's get_pooling_usage, vllm/entrypoints/pooling/utils.py,
--               the sum over the inputs); no completion, no cached tokens
--   errors:     OpenAI's shape; limit headers: OpenAI's x-ratelimit-*
--
-- Special tokens: an embedding input is raw text, not a conversation. vLLM tokenizes
-- it as a completions prompt is (a literal "<|im_end|>" becomes the special token), but
-- no chat template wraps it and nothing is generated from it, so there is no turn to
-- forge: like completions prompts, inputs are not checked for special or structural
-- tokens (edge.special_tokens does not apply), only cleaned of invisible characters.
--
-- Refused, because they escape the count: chat-style inputs (vLLM's embeddings also take
-- `messages`, or `input` as chat messages, rendered with the chat template:
-- EmbeddingChatRequest), and the binary encoding formats `bytes` / `bytes_only` (vLLM
-- answers application/octet-stream, with no JSON usage to settle from).

local json = require "tokengate.json"
local errors = require "tokengate.errors"
local api = require "tokengate.api"
local bounds = require "tokengate.bounds"
local body_mod = require "tokengate.body"
local sanitize = require "tokengate.sanitize"

local type = type
local format = string.format
local is_array, json_integer, json_number = json.is_array, json.integer, json.number
local null = json.null
local fail = errors.refuse

local _M = {
    NAME = "embeddings",
    ROUTES = { ["/v1/embeddings"] = "embeddings" },
    PREFIX = "/v1/embeddings",
    PATHS = { embeddings = "/v1/embeddings" },
    ALLOW = { embeddings = "POST" },
    ENDPOINT = { embeddings = 6 }, -- tokengate.v1.ENDPOINT_EMBEDDINGS
    -- The fields (and aliases) of vLLM 0.32's EmbeddingCompletionRequest
    -- (vllm/entrypoints/pooling/embed/protocol.py; tests/edge/test_edge_costly_inputs.py
    -- compares them with vLLM's model): any other top-level field counts against
    -- edge.max_unknown_fields_bytes (tokengate.bounds).
    FIELDS = { embeddings = bounds.set({
        "add_special_tokens", "cache_salt", "dimensions", "embed_dtype", "encoding_format",
        "endianness", "input", "mm_processor_kwargs", "model", "padding", "priority",
        "request_id", "truncate_prompt_tokens", "truncation_side", "use_activation", "user",
    }) },
    -- the vLLM runner that serves this route (tokengate.models.serves)
    RUNNER = "pooling",
    GENERATES = false,
}

-- Most inputs one request may embed: OpenAI's limit ("The input must not exceed the max
-- input tokens for the model, cannot be an empty string, and any array must be 2048
-- dimensions or less", API reference, Create embeddings). vLLM runs one engine request
-- per input.
local MAX_INPUTS = 2048
-- OpenAI's encoding formats; vLLM's "bytes" and "bytes_only" are refused (module comment)
local FORMATS = { float = true, base64 = true }

local SHAPES = "a string, an array of strings, an array of token ids or an array of "
    .. "token-id arrays"

-- token_ids(body, list, param) -> true | nil, err (400): a non-empty array of integers
-- >= 0 (the counter checks them against the vocabulary). An integral JSON float (7.0,
-- 1e1) is the integer, as vLLM's lax int parsing reads it, and is rewritten as the plain
-- integer: what is counted and forwarded is one integer (tokengate.body's rule).
local function token_ids(body, list, param)
    if #list == 0 then
        return fail(400, param .. ": must not be empty", param, "invalid_value")
    end
    for j = 1, #list do
        local v = list[j]
        local id = json_integer(v)
        if not id or id < 0 then
            local p = format("%s[%d]", param, j - 1)
            return fail(400, p .. ": must be a token id (an integer >= 0)", p, "invalid_type")
        end
        if type(v) ~= "number" then
            list[j] = id
            body_mod.changed(body)
        end
    end
    return true
end

-- check_input(body) -> true | nil, err (400): body.input:: OpenAI's four input shapes, one kind of
-- element per array (vLLM's `list[int] | list[list[int]] | str | list[str]`), no empty
-- string (OpenAI refuses one; vLLM would embed an empty prompt), at most MAX_INPUTS.
local function check_input(body)
    local input = body.input
    if input == nil or input == null then
        return fail(400, "input: Field required (" .. SHAPES .. ")", "input",
            "missing_required_parameter")
    end
    if type(input) == "string" then
        if input == "" then
            return fail(400, "input: must not be an empty string", "input", "invalid_value")
        end
        return true
    end
    if not is_array(input) then
        return fail(400, "input: must be " .. SHAPES, "input", "invalid_type")
    end
    local n = #input
    if n == 0 then
        return fail(400, "input: must not be an empty array", "input", "invalid_value")
    end
    local first = input[1]
    if json_number(first) then
        -- one input of token ids (its length is the counter's max_model_len check)
        return token_ids(body, input, "input")
    end
    if n > MAX_INPUTS then
        return fail(400, format("input: %d inputs; at most %d per request", n, MAX_INPUTS),
            "input", "invalid_value")
    end
    local kind = type(first) == "string" and "string" or is_array(first) and "ids" or nil
    for i = 1, n do
        local e = input[i]
        local param = format("input[%d]", i - 1)
        if kind == "string" and type(e) == "string" then
            if e == "" then
                return fail(400, param .. ": must not be an empty string", param,
                    "invalid_value")
            end
        elseif kind == "ids" and is_array(e) then
            local ok, err = token_ids(body, e, param)
            if not ok then
                return nil, err
            end
        elseif type(e) == "table" and e ~= null and not is_array(e) then
            return fail(400, param .. ": chat messages as embedding input are not supported "
                .. "by this gateway; send input as " .. SHAPES, param, "unsupported_parameter")
        else
            return fail(400, format("%s: must be %s, as input[0] is (input is %s; one kind "
                .. "of element per array)", param, kind == "string" and "a string"
                or kind == "ids" and "an array of token ids" or "a string or an array",
                SHAPES), param, "invalid_type")
        end
    end
    return true
end

-- validate(route, body, models, edge) -> model entry | nil, err (400/404). Checks:
-- model (a string naming a configured model), input (check_input), encoding_format
-- ("float" or "base64"), dimensions (an integer >= 1), user (a string), no `messages`
-- (chat-style input), then the unknown fields (tokengate.bounds).
function _M.validate(route, body, models, edge)
    local ok, err = body_mod.api_model(body)
    if not ok then
        return nil, err
    end
    local msgs = body.messages
    if msgs ~= nil and msgs ~= null then
        return fail(400, "messages: chat-style embedding requests are not supported by this "
            .. "gateway; send input as " .. SHAPES, "messages", "unsupported_parameter")
    end
    ok, err = check_input(body)
    if not ok then
        return nil, err
    end
    local ef = body.encoding_format
    if ef ~= nil and ef ~= null and not (type(ef) == "string" and FORMATS[ef]) then
        return fail(400, "encoding_format: must be 'float' or 'base64'", "encoding_format",
            "invalid_value")
    end
    ok, err = body_mod.api_posint(body, "dimensions")
    if ok then
        ok, err = body_mod.api_string(body, "user")
    end
    if not ok then
        return nil, err
    end
    return body_mod.check_api(_M.FIELDS[route], body, models, edge, nil, nil)
end

-- sanitize(body, model, edge) -> counts | nil, err (tokengate.sanitize.verdict's
-- shape): input's strings cleaned of invisible and control characters; no token check
-- (module comment); token ids pass unchanged.
function _M.sanitize(body, model, edge)
    local st = sanitize.state(model, edge)
    local input = body.input
    if type(input) == "string" then
        body.input = sanitize.text(st, input, "input", nil)
    else
        for i = 1, #input do
            if type(input[i]) == "string" then
                input[i] = sanitize.text(st, input[i], format("input[%d]", i - 1), nil)
            end
        end
    end
    return sanitize.verdict(st)
end

-- adjust(ctx, body, model): top-level fields given as null are dropped (null means the
-- default; vLLM refuses encoding_format: null); nothing to cap, nothing streams (vLLM's
-- embeddings answer is one JSON object)
function _M.adjust(_ctx, body)
    if json.drop_nulls(body) > 0 then
        body_mod.changed(body)
    end
end

-- (usage, errors and limit headers: OpenAI's, the defaults)

return api.define(_M)
