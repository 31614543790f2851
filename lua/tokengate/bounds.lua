-- Bounds on what a request can make the backend do that its prompt tokens do not pay for:
-- structured-output constraints, which vLLM compiles into a token mask before the first
-- token (a 2,000-property schema: 92 s of a CPU server's work, billed 13 tokens), and
-- top-level fields that vLLM does not define (ignored there, yet read, checked and
-- forwarded here).
--
-- check() returns true | nil, err (tokengate.errors: 400, naming the field).

local json = require "tokengate.json"
local errors = require "tokengate.errors"

local type = type
local format = string.format
local is_array, is_object, encode = json.is_array, json.is_object, json.encode
local decode, null, KEYS = json.decode, json.null, json.KEYS
local clip, fail = errors.clip, errors.refuse

local _M = {}

-- set(names) -> {name = true}: an API module's FIELDS entry (tokengate.api)
local function set(names)
    local t = {}
    for i = 1, #names do
        t[names[i]] = true
    end
    return t
end
_M.set = set


-- The structured-output fields: vLLM 0.32 reads response_format and structured_outputs;
-- the guided_* fields were removed in vLLM 0.32 (ignored there: they also count as
-- unknown fields) but older servers still compile them.
local STRUCTURED = { "response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_grammar", "guided_choice" }
-- Strings that vLLM decodes as JSON before compiling them (StructuredOutputsParams.json
-- and .structural_tag, vllm/sampling_params.py; guided_json of older servers): measured
-- as the value they hold.
local JSON_TEXT = { ["structured_outputs.json"] = true,
                    ["structured_outputs.structural_tag"] = true,
                    guided_json = true }
-- Keys whose object value lists named properties (JSON Schema).
local PROPERTY_MAPS = { properties = true, patternProperties = true }
-- Keys whose object value maps names to schemas (JSON Schema): that object's keys are
-- names, not keywords, so a property (or a definition) named "properties" is no
-- property map itself; the schemas under the names are schemas again.
local NAME_MAPS = { properties = true, patternProperties = true, ["$defs"] = true,
                    definitions = true, dependentSchemas = true }

-- shape(v, path, depth, acc, max_json, names) -> true | nil, err: the deepest level and
-- the named properties of v, into acc = {depth, properties}; strings at JSON_TEXT paths
-- are decoded (strictly, as everything the edge reads) and measured in place. names: v
-- is a NAME_MAPS value, whose keys are names (none of them a keyword).
local function shape(v, path, depth, acc, max_json, names)
    if type(v) == "string" then
        if not JSON_TEXT[path] then
            return true
        end
        local inner, derr = decode(v, max_json)
        if inner == nil then
            return fail(400, format("'%s' must hold a JSON value: %s at byte %d", path,
                derr.message, derr.offset), path, "invalid_json")
        end
        return shape(inner, "", depth, acc, max_json)
    end
    if type(v) ~= "table" or v == null then
        return true
    end
    depth = depth + 1
    if depth > acc.depth then
        acc.depth = depth
    end
    if is_object(v) then
        local keys = v[KEYS]
        for i = 1, #keys do
            local k = keys[i]
            local x = v[k]
            local named = not names and NAME_MAPS[k] and is_object(x)
            if named and PROPERTY_MAPS[k] then
                acc.properties = acc.properties + #x[KEYS]
            end
            local ok, err = shape(x, depth == 1 and path .. "." .. k or "", depth, acc,
                max_json, named)
            if not ok then
                return nil, err
            end
        end
    elseif is_array(v) then
        for i = 1, #v do
            local ok, err = shape(v[i], "", depth, acc, max_json)
            if not ok then
                return nil, err
            end
        end
    end
    return true
end

-- check_structured(name, v, lim, max_json) -> true | nil, err (400
-- structured_output_too_complex): the field's JSON size, nesting and named properties
-- against edge.structured_output. Paths are kept for the field and its members only (the
-- places that may hold JSON text), so deeper nodes build no strings.
local function check_structured(name, v, lim, max_json)
    local bytes = #encode(v)
    if bytes > lim.max_bytes then
        return fail(400, format("'%s' is %d bytes of JSON; the limit is %d bytes (vLLM "
            .. "compiles it before generating, whatever the prompt costs)", name, bytes,
            lim.max_bytes), name, "structured_output_too_complex")
    end
    local acc = { depth = 0, properties = 0 }
    local ok, err = shape(v, name, 0, acc, max_json)
    if not ok then
        return nil, err
    end
    if acc.depth > lim.max_depth then
        return fail(400, format("'%s' is nested %d levels deep; the limit is %d levels",
            name, acc.depth, lim.max_depth), name, "structured_output_too_complex")
    end
    if acc.properties > lim.max_properties then
        return fail(400, format("'%s' names %d properties; the limit is %d (vLLM's grammar "
            .. "grows with each one, whatever the prompt costs)", name, acc.properties,
            lim.max_properties), name, "structured_output_too_complex")
    end
    return true
end

-- structured(name, v, edge) -> true | nil, err (400 structured_output_too_complex |
-- invalid_json): a structured-output value that is not a top-level field of chat or
-- completions (the Messages API's output_config.format.json_schema), named name, under
-- edge.structured_output.
function _M.structured(name, v, edge)
    return check_structured(name, v, edge.structured_output, edge.max_json_depth)
end

-- check(known, body, edge) -> true | nil, err (400). known: the fields vLLM's request
-- model of the route defines ({name -> true}, the API module's FIELDS[route]); edge:
-- the compiled edge settings (structured_output, max_unknown_fields_bytes,
-- max_json_depth).
--   structured_output_too_complex: a structured-output field above a bound, named;
--   invalid_json: a string that vLLM decodes as JSON (structured_outputs.json) is not;
--   unknown_fields_too_large: the fields vLLM does not define add up to more than
--   edge.max_unknown_fields_bytes (each counted as the JSON of its key and value);
--   the largest is named.
function _M.check(known, body, edge)
    local lim = edge.structured_output
    for i = 1, #STRUCTURED do
        local name = STRUCTURED[i]
        local v = body[name]
        if v ~= nil and v ~= null then
            local ok, err = check_structured(name, v, lim, edge.max_json_depth)
            if not ok then
                return nil, err
            end
        end
    end
    local keys = body[KEYS]
    local total, biggest, biggest_n = 0, nil, 0
    for i = 1, #keys do
        local k = keys[i]
        if not known[k] then
            local n = #k + 3 + #encode(body[k])
            total = total + n
            if n > biggest_n then
                biggest, biggest_n = k, n
            end
        end
    end
    if total > edge.max_unknown_fields_bytes then
        local param = clip(biggest)
        return fail(400, format("Request has %d bytes of fields that vLLM does not read; the "
            .. "limit is %d bytes. The largest is '%s' (%d bytes): remove it", total,
            edge.max_unknown_fields_bytes, param, biggest_n), param,
            "unknown_fields_too_large")
    end
    return true
end

return _M
