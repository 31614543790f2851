-- OpenAI chat completions (POST /v1/chat/completions): what of it the edge reads, in
-- one place (the hooks: tokengate.api).
--
--   validate:   messages (a non-empty array of objects with a string role and string /
--               array / null content), tools, chat_template_kwargs, the fields chat and
--               completions share (tokengate.apis.openai), then the bounds
--   sanitize:   message content (string, text / refusal / thinking parts, bare string
--               parts), assistant reasoning, names and tool-call ids, tool calls (names;
--               arguments as vLLM decodes them), a developer message's tools, tools,
--               documents and the values of chat_template_kwargs; a system message that
--               exactly repeats an earlier one is dropped
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
local is_array, is_object, encode, null = json.is_array, json.is_object, json.encode, json.null
local fail = errors.refuse
-- chat's own boolean fields (vLLM 0.32's ChatCompletionRequest; tokengate.apis.openai
-- checks those it shares with completions)
local BOOLS = { "add_generation_prompt", "continue_final_message", "include_reasoning",
                "logprobs", "parallel_tool_calls", "return_prompt_text" }
-- those typed `bool`, not `bool | None` (echo: chat's only; completions' may be null)
local NOT_NULL = { add_generation_prompt = true, continue_final_message = true,
                   include_reasoning = true, echo = true }

local _M = {
    NAME = "chat",
    ROUTES = { ["/v1/chat/completions"] = "chat" },
    PATHS = { chat = "/v1/chat/completions" },
    ALLOW = { chat = "POST" },
    ENDPOINT = { chat = 1 }, -- tokengate.v1.ENDPOINT_CHAT
    FIELDS = { chat = openai.fields({
        "add_generation_prompt", "chat_template", "chat_template_kwargs",
        "continue_final_message", "documents", "include_reasoning", "max_completion_tokens",
        "media_io_kwargs", "messages", "mm_processor_kwargs", "parallel_tool_calls",
        "reasoning_effort", "return_prompt_text", "tool_choice", "tools", "top_logprobs",
    }) },
    -- vLLM's chat reads max_completion_tokens before max_tokens
    MAX_TOKENS = { "max_completion_tokens", "max_tokens" },
}

-- check(body, models, edge) -> model entry | nil, err (400/404).
-- Checks: model (configured), messages (non-empty array of objects with a string role and
-- string / array / null content), stream flags, token limits are positive integers,
-- chat_template_kwargs keys (edge.chat_template_kwargs_allowed).
local function check(body, models, edge)
    local msgs = body.messages
    if msgs == nil or msgs == null then
        return fail(400, "'messages' is a required property"
            .. body_mod.envelope_hint(body, "messages"), "messages", "missing_required_parameter")
    end
    if not is_array(msgs) then
        return fail(400, "'messages' must be an array", "messages", "invalid_type")
    end
    if #msgs == 0 then
        return fail(400, "'messages' must contain at least one message", "messages",
            "invalid_value")
    end
    for i = 1, #msgs do
        local m = msgs[i]
        local param = format("messages[%d]", i - 1)
        if not is_object(m) then
            return fail(400, param .. " must be an object", param, "invalid_type")
        end
        if type(m.role) ~= "string" then
            return fail(400, param .. ".role must be a string", param .. ".role",
                "invalid_type")
        end
        local c = m.content
        if c ~= nil and c ~= null and type(c) ~= "string" and not is_array(c) then
            return fail(400, param .. ".content must be a string or an array of content parts",
                param .. ".content", "invalid_type")
        end
    end
    local tools = body.tools
    if tools ~= nil and tools ~= null and not is_array(tools) then
        return fail(400, "'tools' must be an array", "tools", "invalid_type")
    end
    -- vLLM refuses a tool_choice other than "none" without tools (check_tool_usage in
    -- vllm/entrypoints/openai/chat_completion/protocol.py), after admission
    local tc = body.tool_choice
    if tc ~= nil and tc ~= null and tc ~= "none" and (tools == nil or tools == null) then
        return fail(400, "Invalid value for 'tool_choice': 'tool_choice' is only allowed "
            .. "when 'tools' are specified.", "tool_choice", "invalid_value")
    end
    local ok, err = body_mod.api_top_logprobs(body, "logprobs")
    if ok then
        ok, err = body_mod.check_template_kwargs(body.chat_template_kwargs,
            edge.template_kwargs_allowed)
    end
    if not ok then
        return nil, err
    end
    return openai.check_common(body, models, BOOLS, NOT_NULL)
end

-- validate(route, body, models, edge): check(), then the bounds (tokengate.apis.openai)
_M.validate = openai.validator(check, _M.FIELDS)

local ID, NAME = { "id" }, { "name" }

-- visit_calls(st, calls, i, tokens): the tool calls of messages[i] (name, id, arguments).
local function visit_calls(st, calls, i, tokens)
    for j = 1, #calls do
        local call = calls[j]
        local fn = is_object(call) and call["function"]
        if is_object(fn) then
            local param = format("messages[%d].tool_calls[%d]", i - 1, j - 1)
            sanitize.strings(st, call, param, tokens, sanitize.check, ID)
            -- the template writes the name into the assistant turn verbatim
            sanitize.strings(st, fn, param .. ".function", tokens, sanitize.text, NAME)
            sanitize.arguments(st, fn, param .. ".function.arguments", tokens)
        end
    end
end

-- A message's string fields beyond its content, in the order they are visited, and
-- how: an assistant's reasoning is text (cleaned and checked); the identifiers vLLM
-- hands to the template as they are are checked, never cleaned.
local MESSAGE_STRINGS = {
    { "reasoning_content", sanitize.text }, { "reasoning", sanitize.text },
    { "name", sanitize.check }, { "tool_call_id", sanitize.check },
}

-- chat_tool(st, t, param): a chat tool's function: its name, description and parameters
-- ("tools[i].function.name" ...) (tokengate.sanitize.tool).
local function chat_tool(st, t, param)
    local fn = t["function"]
    if is_object(fn) then
        sanitize.tool(st, fn, param .. ".function", "parameters")
    end
end

-- walk(body, model, edge) -> state {removed, stripped, escaped, collapsed, bad}
-- Sanitizes a validated chat body in place: message content (string, text / refusal /
-- thinking parts, bare string parts), assistant reasoning, names and tool-call ids, tool
-- calls (names; arguments as vLLM decodes them), a developer message's tools, tools,
-- documents and the values of chat_template_kwargs. Checks the special tokens in the
-- messages of edge.special_token_roles, the structural tokens in those of
-- edge.structural_token_roles, both everywhere else listed (policy edge.special_tokens:
-- "escape" | "reject" | "strip" | "allow"); then removes each system message that exactly
-- repeats an earlier one (same JSON after sanitizing).
-- state.bad = {param = "messages[i].content", token = "<|im_end|>", ...} when refused
-- (indices are the client's, before collapsing).
local function walk(body, model, edge)
    local st = sanitize.state(model, edge)
    local messages = body.messages
    for i = 1, #messages do
        local m = messages[i]
        local tokens = st.by_role[m.role]
        if m.content ~= nil then
            m.content = sanitize.content(st, m.content, format("messages[%d].content", i - 1),
                tokens)
        end
        for r = 1, #MESSAGE_STRINGS do
            local f, visit = MESSAGE_STRINGS[r][1], MESSAGE_STRINGS[r][2]
            if type(m[f]) == "string" then
                m[f] = visit(st, m[f], format("messages[%d].%s", i - 1, f), tokens)
            end
        end
        if is_array(m.tool_calls) then
            visit_calls(st, m.tool_calls, i, tokens)
        end
        if m.role == "developer" then
            -- vLLM passes a developer message's tools to the template (message.tools)
            sanitize.objects(st, m.tools, format("messages[%d].tools", i - 1), chat_tool)
        end
    end
    sanitize.objects(st, body.tools, "tools", chat_tool)
    if body.documents ~= nil then
        sanitize.value(st, body.documents, "documents", st.all, false)
    end

    -- A client that rebuilds its history often prepends the same system prompt again;
    -- exact repeats carry no information and cost tokens on every turn.
    local seen, kept, n = nil, nil, 0
    for i = 1, #messages do
        local m = messages[i]
        local drop = false
        if m.role == "system" then
            local sig = encode(m)
            seen = seen or {}
            if seen[sig] then
                drop = true
            else
                seen[sig] = true
            end
        end
        if drop then
            if not kept then
                kept = json.array()
                for j = 1, i - 1 do
                    kept[j] = messages[j]
                end
                n = i - 1
            end
            st.collapsed = st.collapsed + 1
        elseif kept then
            n = n + 1
            kept[n] = m
        end
    end
    if kept then
        body.messages = kept
    end
    return st
end

-- sanitize(body, model, edge) -> counts | nil, err (tokengate.sanitize.verdict):
-- walk() under edge.special_tokens. Checks the special tokens in the messages of
-- edge.special_token_roles, the structural tokens in those of
-- edge.structural_token_roles, both everywhere else listed (policy edge.special_tokens:
-- "escape" | "reject" | "strip" | "allow"). A refusal names the field with the
-- client's indices (before repeated system messages were dropped).
function _M.sanitize(body, model, edge)
    return sanitize.finish(walk(body, model, edge), body)
end

_M.placed = openai.stream_options

return api.define(_M)
