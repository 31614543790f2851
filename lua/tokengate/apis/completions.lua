-- OpenAI completions (POST /v1/completions): what of it the edge reads, in one place
-- (the hooks: tokengate.api).
--
--   validate:   prompt (a string, an array of strings, of token ids or of token-id
--               arrays), the fields chat and completions share (tokengate.apis.openai),
--               then the bounds
--   sanitize:   the prompt's strings lose invisible and control characters; special
--               tokens are not checked (raw text: no turns to forge)
--   budget:     without max_tokens vLLM generates 16 tokens (OpenAI's default)
--   placed:     the stream options the usage watch needs (tokengate.apis.openai)
--   the rest:   OpenAI's, the defaults (usage, errors, x-ratelimit-* headers)

local json = require "tokengate.json"
local errors = require "tokengate.errors"
local api = require "tokengate.api"
local body_mod = require "tokengate.body"
local sanitize = require "tokengate.sanitize"
local openai = require "tokengate.apis.openai"

local type = type
local format = string.format
local is_array, json_integer, null = json.is_array, json.integer, json.null
local fail = errors.refuse
local NO_BOOLS = {} -- completions has no boolean field of its own (nor one whose null
                     -- only it refuses)

local _M = {
    NAME = "completions",
    ROUTES = { ["/v1/completions"] = "completions" },
    PATHS = { completions = "/v1/completions" },
    ALLOW = { completions = "POST" },
    ENDPOINT = { completions = 2 }, -- tokengate.v1.ENDPOINT_COMPLETIONS
    FIELDS = { completions = openai.fields({ "prompt", "prompt_embeds", "suffix" }) },
    DEFAULT_MAX_TOKENS = 16,
    PROMPT_NAME = "prompt",
}

-- check(body, models) -> model entry | nil, err (400/404).
-- prompt: string, array of strings, array of token ids or array of token-id arrays.
local function check(body, models)
    local p = body.prompt
    if p == nil or p == null then
        return fail(400, "'prompt' is a required property"
            .. body_mod.envelope_hint(body, "prompt"), "prompt", "missing_required_parameter")
    end
    if type(p) ~= "string" then
        if not is_array(p) or #p == 0 then
            return fail(400, "'prompt' must be a string or a non-empty array", "prompt",
                "invalid_type")
        end
        for i = 1, #p do
            local e = p[i]
            if type(e) ~= "string" and not json_integer(e) and not is_array(e) then
                local param = format("prompt[%d]", i - 1)
                return fail(400, param .. " must be a string, a token id or an array of token ids",
                    param, "invalid_type")
            end
        end
    end
    -- completions' logprobs is a count (vLLM 0.32's CompletionRequest: int | None),
    -- chat's a boolean
    local lp = body.logprobs
    if lp ~= nil and lp ~= null then
        local n = json_integer(lp)
        if not n or n < 0 or n > body_mod.MAX_LOGPROBS then
            return fail(400, format("'logprobs' must be an integer in [0, %d] (how many of "
                .. "the likeliest tokens to return)", body_mod.MAX_LOGPROBS), "logprobs",
                n and "invalid_value" or "invalid_type")
        end
    end
    return openai.check_common(body, models, NO_BOOLS, NO_BOOLS)
end

-- validate(route, body, models, edge): check(), then the bounds (tokengate.apis.openai)
_M.validate = openai.validator(check, _M.FIELDS)

-- sanitize(body, model, edge) -> counts (tokengate.sanitize.verdict). Sanitizes the
-- prompt (string or array of strings; token-id prompts are numbers and pass unchanged).
-- Completions prompts are raw text by definition (no turns to forge), so tokens are not
-- checked there.
function _M.sanitize(body, model, edge)
    local st = sanitize.state(model, edge)
    local p = body.prompt
    if type(p) == "string" then
        body.prompt = sanitize.text(st, p, "prompt", nil)
    elseif is_array(p) then
        for i = 1, #p do
            if type(p[i]) == "string" then
                p[i] = sanitize.text(st, p[i], format("prompt[%d]", i - 1), nil)
            end
        end
    end
    return sanitize.verdict(st)
end

_M.placed = openai.stream_options

return api.define(_M)
