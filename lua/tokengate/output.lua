-- The completion budget: how many tokens a request may generate, from the body's
-- completion limit (the API module's MAX_TOKENS fields), the gateway's caps
-- (models.<m>.max_tokens_cap, keys.<k>.max_tokens_cap), the model's default_max_tokens
-- and the room the prompt leaves in the context, as vLLM 0.32 works it out. Where the
-- gateway's limit applies, it is written into the body (which is then changed:
-- tokengate.body.changed). An API that generates nothing (GENERATES false) has none.
-- Errors use the errors.new shape.

local json = require "tokengate.json"
local errors = require "tokengate.errors"
local body_mod = require "tokengate.body"

local format = string.format
local min, max = math.min, math.max
local json_integer, json_set = json.integer, json.set

local _M = {}

-- requested_tokens(api, body) -> the completion limit the client asked for, and its
-- field, or nil: the first field of api.MAX_TOKENS that is an integer (vLLM's chat reads
-- max_completion_tokens before max_tokens)
local function requested_tokens(api, body)
    local fields = api.MAX_TOKENS
    for i = 1, #fields do
        local v = json_integer(body[fields[i]])
        if v then
            return v, fields[i]
        end
    end
    return nil
end

-- check(api, route, body, model) -> true | nil, err (400): a completion limit above the
-- model's context is refused before anything is counted, in vLLM 0.32's words and with
-- the client's own numbers (vllm/renderers/params.py, TokenizeParams.__post_init__:
-- "max_tokens=N cannot be greater than max_model_len=M. Please request fewer output
-- tokens.", param the field; the Messages API converts max_tokens to chat's
-- max_completion_tokens and the client's name for it is kept). Routes that generate
-- nothing (an API's LOCAL routes: count_tokens, input_tokens; GENERATES false:
-- embeddings) are not checked.
function _M.check(api, route, body, model)
    if not api.GENERATES or api.LOCAL[route] then
        return true
    end
    local v, field = requested_tokens(api, body)
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

-- lower(api, body, cap): every completion-limit field of body above cap becomes cap
local function lower(api, body, cap)
    local fields = api.MAX_TOKENS
    for i = 1, #fields do
        local v = json_integer(body[fields[i]])
        if v and v > cap then
            json_set(body, fields[i], cap)
        end
    end
end

-- lowered(api, body, out, cap) -> out, changed: the client's limit out, or cap (written
-- into the body's limit fields) when cap is tighter
local function lowered(api, body, out, cap)
    if cap and cap < out then
        lower(api, body, cap)
        return cap, true
    end
    return out, false
end

-- defaulted(api, body, model, cap, room) -> the limit of a request without one, true |
-- nil: the model's default_max_tokens (at most cap; cap without a default) clipped to
-- room and written into the body's last limit field; nil with neither (nothing written)
local function defaulted(api, body, model, cap, room)
    local limit = model.default_max_tokens
    if cap then
        limit = limit and min(limit, cap) or cap
    end
    if not limit then
        return nil
    end
    local out = min(limit, room)
    local fields = api.MAX_TOKENS
    json_set(body, fields[#fields], out)
    return out, true
end

-- no_room(api, model, prompt) -> the 400 of a prompt that leaves no room for a
-- completion (vLLM refuses it too: its sampling max_tokens would be 0)
local function no_room(api, model, prompt)
    local what = api.PROMPT_NAME
    return errors.new(400, format("This model's maximum context length is %d tokens. "
        .. "However, your %s resulted in %d tokens, which leaves no room for the "
        .. "completion. Please reduce the length of the %s.", model.max_model_len,
        what, prompt, what), what, "context_length_exceeded")
end

-- counted_budget(api, model, body, reply, cap) -> completion tokens the request may
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
local function counted_budget(api, model, body, reply, cap)
    local prompt = reply.prompt_tokens
    if reply.max_tokens_requested > 0 then
        local out = reply.max_tokens_effective
        if out < 1 then
            return nil, no_room(api, model, prompt)
        end
        return lowered(api, body, out, cap)
    end
    local room = model.max_model_len - prompt
    if room < 1 then
        return nil, no_room(api, model, prompt)
    end
    local out, changed = defaulted(api, body, model, cap, room)
    if out then
        return out, changed
    end
    return room, false
end

-- estimated_budget(api, body, model, prompt, cap) -> the most completion tokens the
-- request may generate when the counter could not answer, body_changed: the explicit
-- max_completion_tokens / max_tokens, lowered to the cap (vLLM may fit it lower still:
-- the room is not known); without one, the default or cap, clipped to the room the
-- estimated prompt (tokens, an over-count) leaves, at least 1, and written into the body
-- as in counted_budget; a request without the field gets the API's DEFAULT_MAX_TOKENS
-- when it has one (completions: vLLM's 16 tokens);
-- with neither a default nor a cap, the whole context (vLLM may generate to its end).
-- Budgets reserve this worst case; the TPM window takes at most output_reserve of it
-- (tokengate.limits.reservation).
local function estimated_budget(api, body, model, prompt, cap)
    local given = requested_tokens(api, body)
    if given then
        return lowered(api, body, given, cap)
    end
    local fields = api.MAX_TOKENS
    if api.DEFAULT_MAX_TOKENS and body[fields[#fields]] == nil then
        return api.DEFAULT_MAX_TOKENS, false
    end
    local out, changed = defaulted(api, body, model, cap,
        max(1, model.max_model_len - prompt))
    if out then
        return out, changed
    end
    return model.max_model_len, false
end

-- above_context(model, prompt, message, param) -> nil, err (400 context_length_exceeded)
-- when prompt (tokens) is above the model's context, else nil: a LOCAL route's answer
-- (count_answer) refuses what vLLM would. message: the API's wording, a format of
-- (max_model_len, prompt); param: the API's name of the prompt.
function _M.above_context(model, prompt, message, param)
    if prompt > model.max_model_len then
        return errors.refuse(400, format(message, model.max_model_len, prompt), param,
            "context_length_exceeded")
    end
    return nil
end

-- budget(api, model, body, counted, key) -> completion tokens the request may generate
-- | nil, err. api: the route's API module (its MAX_TOKENS, DEFAULT_MAX_TOKENS,
-- PROMPT_NAME, GENERATES); counted: tokengate.count's result; with the counter's reply
-- the exact rules of counted_budget apply, with an estimate those of estimated_budget;
-- key: the compiled key (its max_tokens_cap, cap_of). Marks body changed
-- (tokengate.body.changed) when a limit was written into it; sets counted.requested (the
-- client's completion limit, nil without one) and, when the gateway's cap lowered it,
-- counted.capped_by ("model" | "key"). An API that generates nothing: 0, nothing
-- written into the body.
function _M.budget(api, model, body, counted, key)
    if not api.GENERATES then
        return 0
    end
    local requested = requested_tokens(api, body)
    local cap, whose = _M.cap_of(model, key)
    local out, changed
    if counted.reply then
        out, changed = counted_budget(api, model, body, counted.reply, cap)
    else
        out, changed = estimated_budget(api, body, model, counted.prompt, cap)
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
