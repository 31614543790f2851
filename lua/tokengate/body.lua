-- The request body: content type and size limits, reading (memory or spooled file),
-- strict decoding (tokengate.json) and the shape checks the edge relies on. Deeper
-- validation of fields the edge does not touch is left to the counter and vLLM.
--
-- Every function returns value | nil, err (tokengate.errors: status 400 | 413 | 415,
-- message, param = "<field path>" | nil, code).

local ngx = ngx
local json = require "tokengate.json"
local errors = require "tokengate.errors"
local bounds = require "tokengate.bounds"
local models_mod = require "tokengate.models"

local ngx_req, ngx_var, ngx_sleep, spawn = ngx.req, ngx.var, ngx.sleep, ngx.thread.spawn
local wait, kill = ngx.thread.wait, ngx.thread.kill
local co_status = coroutine.status
local io_open = io.open
local type, tonumber = type, tonumber
local format, find, lower = string.format, string.find, string.lower
local sort = table.sort
local huge = math.huge
local concat = table.concat
local pairs = pairs
local is_array, is_object, json_integer = json.is_array, json.is_object, json.integer
local json_number, json_set, null, KEYS = json.number, json.set, json.null, json.KEYS
local clip, fail = errors.clip, errors.refuse

-- Private keys of a parsed body object (tables: never a client's key, never encoded):
-- its JSON text, and whether it was changed since that text was made.
local TEXT, CHANGED, ENCODED = {}, {}, {}

local _M = {}

-- The body's text. The edge forwards (and counts) the body it parsed and checked. Until
-- the edge changes it, that body's text is the client's own bytes: the strict decoder
-- (tokengate.json) refused everything two JSON readers could read differently, so the
-- bytes and any encoding of the parsed body read the same; once changed, its encoding,
-- made once, when the text is next needed (the count, the forward). Whatever changes a
-- parsed body (a validation that rewrites a number, the sanitizer, an API module's
-- adjust or placed, the completion budget) marks it with changed().

-- changed(body): body (a parsed request body) was changed: text() encodes it again.
function _M.changed(body)
    body[CHANGED] = true
end

-- text(body) -> JSON text of body, encoded: the client's bytes (encoded false) until
-- body was changed, then its encoding (encoded true), made once per change.
function _M.text(body)
    if body[CHANGED] then
        body[TEXT], body[CHANGED], body[ENCODED] = json.encode(body), nil, true
    end
    return body[TEXT], body[ENCODED] == true
end

-- check_headers(max_bytes) -> true | nil, err (415 or 413), from the request's headers.
-- Only application/json is accepted; a charset parameter, when present, must be utf-8
-- (JSON is UTF-8, RFC 8259 §8.1); a Content-Encoding other than identity is refused
-- (415). A repeated Content-Type: the first one counts; every Content-Encoding counts;
-- nginx refuses a repeated Content-Length itself. The headers are read as nginx
-- variables ($http_<name> is the first header of that name with nginx 1.22): the table
-- of all headers is built only when a Content-Encoding is there.
function _M.check_headers(max_bytes)
    local ct = ngx_var.http_content_type
    ct = ct and lower(ct) or ""
    if ct ~= "application/json" then -- the usual one passes without the patterns
        if not find(ct, "^%s*application/json%s*$")
                and not find(ct, "^%s*application/json%s*;") then
            return fail(415, format("Unsupported Content-Type %q: send the request body as "
                .. "application/json", clip(ct)), nil, "unsupported_media_type")
        end
        local charset = ct:match(";%s*charset%s*=%s*\"?([%w%-_]+)")
        if charset and charset ~= "utf-8" and charset ~= "utf8" then
            return fail(415, format("Unsupported charset %q: JSON request bodies must be "
                .. "UTF-8", clip(charset)), nil, "unsupported_media_type")
        end
    end
    -- A compressed body would be read as bytes that are not JSON (or, with a plain body
    -- under the header, forwarded with a header vLLM may act on): neither is accepted.
    local ce = ngx_var.http_content_encoding
    if ce then
        ce = ngx_req.get_headers(0)["content-encoding"]
    end
    if type(ce) == "table" then
        ce = concat(ce, ",")
    end
    if ce and not find(lower(ce), "^[%s,]*identity[%s,]*$") and not find(ce, "^%s*$") then
        return fail(415, format("Unsupported Content-Encoding %q: send the request body "
            .. "uncompressed", clip(ce)), nil, "unsupported_media_type")
    end
    local len = tonumber(ngx_var.http_content_length)
    if len and len > max_bytes then
        return fail(413, format("Request body is %d bytes; the limit is %d bytes", len,
            max_bytes), nil, "request_too_large")
    end
    return true
end

-- sleep(s): ngx.sleep as a Lua function (spawn() takes no C function)
local function sleep(s)
    ngx_sleep(s)
end

-- read_body() -> true: the reader thread's function, made once (a closure made per
-- request is bytecode FNEW, which LuaJIT cannot compile: every trace through the
-- access phase that met it was aborted)
local function read_body()
    ngx_req.read_body()
    return true
end

-- read_within(deadline_s) -> true | nil, err (408): nginx reads the body, within
-- deadline_s in all. nginx's client_body_timeout is per read, so a client that sends a
-- byte now and then would hold the request (and its worker connection) for ever: the
-- read runs in a light thread that a sleeping one outlives at the deadline. Killing the
-- reader leaves nginx's body reading unfinished, so nginx closes the connection after
-- the answer instead of keeping it alive (verified with Debian's nginx 1.22 + lua
-- 0.10.23, HTTP/1.1 with Content-Length and chunked). A body that arrived with the
-- headers is read before spawn() returns (the reader is dead, its result kept for
-- wait()): no sleeper then.
local function read_within(deadline_s)
    local reader = spawn(read_body)
    local ok, read
    if co_status(reader) == "dead" then
        ok, read = wait(reader)
    else
        local sleeper = spawn(sleep, deadline_s)
        ok, read = wait(reader, sleeper)
        if ok and read == true then
            kill(sleeper)
        end
    end
    if ok and read == true then
        return true
    end
    kill(reader)
    return fail(408, format("The request body did not arrive within %d s (edge.body_deadline_s)",
        deadline_s), nil, "request_timeout")
end

-- read(max_bytes, deadline_s) -> body text | nil, err. Reads the client body whether
-- nginx kept it in memory or spooled it to a temporary file (bodies larger than
-- client_body_buffer_size): a gateway that reads only get_body_data() would see nil and
-- forward the file unchecked. deadline_s: the whole body's deadline, s (408 after it).
function _M.read(max_bytes, deadline_s)
    local ok, err = read_within(deadline_s)
    if not ok then
        return nil, err
    end
    local data = ngx_req.get_body_data()
    if not data then
        local path = ngx_req.get_body_file()
        if path then
            local f, err = io_open(path, "rb")
            if not f then
                return fail(500, "cannot read the spooled request body: " .. (err or ""), nil,
                    "internal_error")
            end
            data = f:read("*a")
            f:close()
        end
    end
    if not data or data == "" then
        return fail(400, "Request body is empty: send a JSON object", nil, "invalid_json")
    end
    if #data > max_bytes then
        return fail(413, format("Request body is %d bytes; the limit is %d bytes", #data,
            max_bytes), nil, "request_too_large")
    end
    return data
end

local KIND_TEXT = {
    utf8 = { "Request body is not valid UTF-8: %s at byte %d", "invalid_utf8" },
    surrogate = { "Request body is not valid Unicode: %s at byte %d", "invalid_unicode" },
    duplicate = { "Request body has a %s at byte %d; keys must be unique", "duplicate_key" },
    depth = { "Request body has %s at byte %d", "json_too_deep" },
    syntax = { "Request body is not valid JSON: %s at byte %d", "invalid_json" },
}

-- decode(text, max_depth) -> JSON object (tokengate.json representation) | nil, err (400).
function _M.decode(text, max_depth)
    local v, derr = json.decode(text, max_depth)
    if v == nil then
        local t = KIND_TEXT[derr.kind] or KIND_TEXT.syntax
        return fail(400, format(t[1], derr.message, derr.offset), derr.path, t[2])
    end
    if not is_object(v) then
        return fail(400, "Request body must be a JSON object", nil, "invalid_json")
    end
    return v
end

-- envelope_hint(body, field) -> " (found it inside ...)" when a top-level object value
-- holds `field` (the request was wrapped in an envelope), else "": for the message of a
-- missing required field.
function _M.envelope_hint(body, field)
    local keys = body[KEYS]
    for i = 1, #keys do
        local v = body[keys[i]]
        if is_object(v) and v[field] ~= nil then
            return format(" (found it inside %q: send the request object itself, not "
                .. "wrapped in an envelope)", clip(keys[i]))
        end
    end
    return ""
end

-- check_template_kwargs(kwargs, allowed) -> true | nil, err (400). vLLM merges
-- chat_template_kwargs into the template's arguments (vllm/renderers/hf.py), where a key
-- such as "tools" replaces what the request's own, checked, fields set: only the keys of
-- edge.chat_template_kwargs_allowed pass (the counter applies the same list).
function _M.check_template_kwargs(kwargs, allowed)
    if kwargs == nil or kwargs == null then
        return true
    end
    if not is_object(kwargs) then
        return fail(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs",
            "invalid_type")
    end
    local keys = kwargs[KEYS]
    for i = 1, #keys do
        local k = keys[i]
        if not allowed[k] then
            local names = {}
            for name in pairs(allowed) do
                names[#names + 1] = name
            end
            sort(names)
            local param = "chat_template_kwargs." .. clip(k)
            return fail(400, format("Unsupported parameter: '%s' is not an allowed chat "
                .. "template argument (allowed: %s)", param,
                #names > 0 and concat(names, ", ") or "none"), param, "unsupported_parameter")
        end
    end
    return true
end

-- The checks of one field that every API module's validate makes, in the API's
-- wording: words is API_WORDS (the default: "field: must be ...", as vLLM's own
-- messages read) or OPENAI_WORDS ("'field' must be ...", OpenAI's chat and
-- completions).
--   api_model(body) -> true | nil, err (400): the model is a string (missing or null:
--     missing_required_parameter; another type: invalid_type, as pydantic words it);
--   api_bool(body, name, words, not_null) -> true | nil, err (400): body[name] is a
--     boolean or absent, or null unless not_null (a field vLLM types `bool`, not
--     `bool | None`: pydantic refuses its null after admission);
--   api_string(body, name) -> true | nil, err (400): body[name] is a string, null or
--     absent;
--   api_posint(body, name, required, words) -> true | nil, err (400): body[name] is an
--     integer >= 1 (or null or absent, unless required). An integral JSON float (100.0,
--     1e2) is the integer, as vLLM's lax int parsing reads it, and is rewritten as the
--     plain integer (the body is then changed): what is counted, capped and forwarded
--     is one integer, whatever the client's literal.
--   api_sampling(known, body, words) -> true | nil, err (400 invalid_type or
--     invalid_value): the sampling fields among `known` (the route's fields; nil: all of
--     them) that vLLM's request models type as numbers (temperature, top_p, min_p and
--     the penalties: float) or integers (top_k, seed, min_tokens: int;
--     vllm/entrypoints/openai/chat_completion/protocol.py, .../anthropic/protocol.py,
--     .../responses/protocol.py) hold a JSON number (an integral one for the
--     integers), null or nothing, within the range vLLM's SamplingParams._verify_args
--     allows (vllm/sampling_params.py); stop / stop_sequences a string or an array of
--     at most 4 strings, user a string. A string such as "0.5" is refused as OpenAI refuses it
--     (vLLM's lax parsing would take it; "hot" or -3 would fail there after the request
--     was admitted and forwarded).
_M.API_WORDS = {
    bool = "%s: must be a boolean", int = "%s: must be an integer >= 1",
    int_code = "invalid_value", small = "%s: must be an integer >= 1",
    number = "%s: must be a number", integer = "%s: must be an integer",
}
_M.OPENAI_WORDS = {
    bool = "'%s' must be a boolean", int = "'%s' must be an integer",
    int_code = "invalid_type", small = "'%s' must be at least 1, got %.17g",
    number = "Invalid type for '%s': expected a decimal, but got %s instead.",
    integer = "Invalid type for '%s': expected an integer, but got %s instead.",
}
-- name -> {kind, lowest, highest, lowest excluded}: vLLM 0.32's SamplingParams checks
local INT64 = 2 ^ 63
local SAMPLING = {
    temperature = { "number", 0, 2 }, top_p = { "number", 0, 1, true },
    min_p = { "number", 0, 1 }, frequency_penalty = { "number", -2, 2 },
    presence_penalty = { "number", -2, 2 }, repetition_penalty = { "number", 0, huge, true },
    length_penalty = { "number", -huge, huge }, top_k = { "integer", -1, huge },
    seed = { "integer", -INT64, INT64 - 1 }, min_tokens = { "integer", 0, huge },
}
-- stop (chat, completions, Responses' vLLM extension: a string or strings) and
-- stop_sequences (Messages: strings)
local STOPS = { stop = "a string or an array of strings",
                stop_sequences = "an array of strings" }
-- vLLM's StopParam and Messages' stop_sequences: at most VLLM_MAX_STOP_STRINGS (4 unless
-- the engine's environment says otherwise; vllm/envs.py), OpenAI's documented limit too
local MAX_STOPS = 4
local SAMPLING_NAMES = {}
for name in pairs(SAMPLING) do
    SAMPLING_NAMES[#SAMPLING_NAMES + 1] = name
end
sort(SAMPLING_NAMES)

function _M.api_model(body)
    local model = body.model
    if model == nil or model == null then
        return fail(400, "model: Field required (a string)", "model",
            "missing_required_parameter")
    end
    if type(model) ~= "string" then
        return fail(400, "model: Input should be a valid string", "model", "invalid_type")
    end
    return true
end

function _M.api_bool(body, name, words, not_null)
    local v = body[name]
    if v ~= nil and v ~= true and v ~= false and (v ~= null or not_null) then
        return fail(400, format((words or _M.API_WORDS).bool, name), name, "invalid_type")
    end
    return true
end

-- json_kind(v) -> "a string" | "a boolean" | "an array" | "an object" | "a decimal" |
-- "null": what a JSON value is, in OpenAI's words
local function json_kind(v)
    if v == null then
        return "null"
    end
    local t = type(v)
    if t == "string" or t == "boolean" then
        return "a " .. t
    end
    if json_integer(v) then
        return "an integer"
    end
    if json_number(v) then
        return "a decimal"
    end
    return is_array(v) and "an array" or "an object"
end
_M.json_kind = json_kind

-- MAX_LOGPROBS: the most likely tokens a request may ask for at each position (chat's
-- and Responses' top_logprobs, completions' logprobs): vLLM's default --max-logprobs
-- (vllm/config/model.py) and OpenAI's documented bound for top_logprobs
_M.MAX_LOGPROBS = 20

-- api_top_logprobs(body, flag) -> true | nil, err (400): top_logprobs is null, absent or
-- an integer in [0, MAX_LOGPROBS] (OpenAI's words); with `flag` (chat's "logprobs"),
-- one above 0 needs body[flag] true, as vLLM's chat requires
function _M.api_top_logprobs(body, flag)
    local top = body.top_logprobs
    if top == nil or top == null then
        return true
    end
    local n = json_integer(top)
    if not n then
        return fail(400, format(_M.OPENAI_WORDS.integer, "top_logprobs", json_kind(top)),
            "top_logprobs", "invalid_type")
    end
    if n < 0 or n > _M.MAX_LOGPROBS then
        return fail(400, format("'top_logprobs' must be in [0, %d], got %.15g",
            _M.MAX_LOGPROBS, n), "top_logprobs", "invalid_value")
    end
    if flag and n > 0 and body[flag] ~= true then
        return fail(400, format("'%s' must be true when 'top_logprobs' is set", flag),
            "top_logprobs", "invalid_value")
    end
    return true
end

-- strings(v) -> whether v is a string or an array of strings
local function strings(v)
    if type(v) == "string" then
        return true
    end
    if not is_array(v) then
        return false
    end
    for i = 1, #v do
        if type(v[i]) ~= "string" then
            return false
        end
    end
    return true
end

function _M.api_sampling(known, body, words)
    words = words or _M.API_WORDS
    for i = 1, #SAMPLING_NAMES do
        local name = SAMPLING_NAMES[i]
        local v = body[name]
        if v ~= nil and v ~= null and (not known or known[name]) then
            local rule = SAMPLING[name]
            local kind, lo, hi, open = rule[1], rule[2], rule[3], rule[4]
            local n = json_number(v)
            if not n or kind == "integer" and not json_integer(v) then
                return fail(400, format(words[kind], name, json_kind(v)), name,
                    "invalid_type")
            end
            if n < lo or open and n == lo or n > hi or n ~= n then
                return fail(400, format("%s must be in %s%.15g, %.15g], got %.15g", name,
                    open and "(" or "[", lo, hi, n), name, "invalid_value")
            end
        end
    end
    for name, want in pairs(STOPS) do
        local v = body[name]
        if v ~= nil and v ~= null and (not known or known[name])
                and (not strings(v) or name == "stop_sequences" and type(v) == "string") then
            local got = json_kind(v)
            if is_array(v) then -- the first item that is no string
                for i = 1, #v do
                    if type(v[i]) ~= "string" then
                        got = format("%s at [%d]", json_kind(v[i]), i - 1)
                        break
                    end
                end
            end
            return fail(400, format("%s must be %s, got %s", name, want, got), name,
                "invalid_type")
        end
        if type(v) == "table" and #v > MAX_STOPS and (not known or known[name]) then
            return fail(400, format("%s: at most %d sequences, got %d", name, MAX_STOPS, #v),
                name, "array_above_max_length")
        end
    end
    if not known or known.user then
        return _M.api_string(body, "user")
    end
    return true
end

function _M.api_string(body, name)
    local v = body[name]
    if v ~= nil and v ~= null and type(v) ~= "string" then
        return fail(400, name .. ": must be a string", name, "invalid_type")
    end
    return true
end

function _M.api_posint(body, name, required, words)
    local v = body[name]
    if v == nil or v == null then
        if required then
            return fail(400, name .. ": Field required (an integer >= 1)", name,
                "missing_required_parameter")
        end
        return true
    end
    words = words or _M.API_WORDS
    local n = json_integer(v)
    if not n then
        return fail(400, format(words.int, name), name, words.int_code)
    end
    if n < 1 then
        return fail(400, format(words.small, name, n), name, "invalid_value")
    end
    if type(v) ~= "number" then
        json_set(body, name, n)
        _M.changed(body)
    end
    return true
end

-- check_api(known, body, models, edge, schema_param, schema) -> model entry | nil, err
-- (400/404): what an API module's validate checks last, the fields every API shares:
-- tools (an array, or absent), the model (a configured one), chat_template_kwargs
-- (edge.template_kwargs_allowed), the API's structured-output schema (schema, found
-- at schema_param; nil when the body has none) and the unknown fields (tokengate.bounds;
-- known: the route's fields, the module's FIELDS[route]).
function _M.check_api(known, body, models, edge, schema_param, schema)
    local ok, err = _M.api_sampling(known, body)
    if not ok then
        return nil, err
    end
    local tools = body.tools
    if tools ~= nil and tools ~= null and not is_array(tools) then
        return fail(400, "tools: must be an array", "tools", "invalid_type")
    end
    local entry = models[body.model]
    if not entry then
        return models_mod.not_found(body.model)
    end
    ok, err = _M.check_template_kwargs(body.chat_template_kwargs,
        edge.template_kwargs_allowed)
    if not ok then
        return nil, err
    end
    if schema ~= nil and schema ~= false and schema ~= null then
        ok, err = bounds.structured(schema_param, schema, edge)
        if not ok then
            return nil, err
        end
    end
    ok, err = bounds.check(known, body, edge)
    if not ok then
        return nil, err
    end
    return entry
end

-- parse(route, models, edge, api) -> body (tokengate.json object) | nil, err
-- The whole body stage of an API request: headers (415/413), read (memory or file),
-- strict decoding (400), then the route's API module's validate(route, body, models,
-- edge): shape and model (400/404), the bounds on costly inputs (400,
-- tokengate.bounds); body.model then names a configured model, and the body's text
-- (text()) is the client's bytes. edge: the compiled edge settings (max_body_bytes,
-- body_deadline_s, max_json_depth, template_kwargs_allowed, structured_output,
-- max_unknown_fields_bytes). err.model: the body's "model" when it names a configured
-- model (for the usage event; a client's unknown name is never passed on: it can be
-- any size).
function _M.parse(route, models, edge, api)
    local ok, err = _M.check_headers(edge.max_body_bytes)
    if not ok then
        return nil, err
    end
    local raw
    raw, err = _M.read(edge.max_body_bytes, edge.body_deadline_s)
    if not raw then
        return nil, err
    end
    local body
    body, err = _M.decode(raw, edge.max_json_depth)
    if not body then
        return nil, err
    end
    ok, err = api.validate(route, body, models, edge)
    if not ok then
        local name = body.model
        err.model = type(name) == "string" and models[name] and name or nil
        err.stream = body.stream == true
        return nil, err
    end
    body[TEXT] = raw
    return body
end

return _M
