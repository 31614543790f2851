-- tokengate.bounds: structured-output constraints (JSON size, nesting, named properties)
-- and the fields vLLM does not read, each against the edge's bounds.

local t = ...
local json = require "tokengate.json"
local bounds = require "tokengate.bounds"
local apis = require "tokengate.apis"

local case, eq = t.case, t.eq

local EDGE = {
    structured_output = { max_bytes = 200, max_depth = 5, max_properties = 3 },
    max_json_depth = 64, max_unknown_fields_bytes = 20,
}

-- check(route, text, edge) -> bounds.check's answer for the body in text, with the
-- route's known fields (its API module's FIELDS), as a list
local function check(route, text, edge)
    return { bounds.check(apis.api(route).FIELDS[route], assert(json.decode(text)),
        edge or EDGE) }
end

-- refused(message, param, code) -> bounds.check's answer for a refusal
local function refused(message, param, code)
    return { nil, { status = 400, message = message, param = param, code = code,
                    type = "invalid_request_error" } }
end

local TOO_COMPLEX = "structured_output_too_complex"

case("a body of known fields only passes", function()
    eq(check("chat", '{"model":"m","messages":[],"max_completion_tokens":5,'
        .. '"chat_template_kwargs":{"enable_thinking":false},"top_k":2}'), { true })
    eq(check("completions", '{"model":"m","prompt":"p","suffix":"s","echo":true}'), { true })
end)

case("the known fields are vLLM's, per route", function()
    local chat, completions = apis.api("chat").FIELDS.chat,
        apis.api("completions").FIELDS.completions
    eq(chat.messages, true)
    eq(chat.prompt, nil)
    eq(completions.prompt, true)
    eq(completions.messages, nil)
    eq(completions.max_tokens, true)
end)

case("unknown fields up to the limit pass (key + 3 + value's JSON bytes)", function()
    -- "abcdefgh":"12345678" is 8 + 3 + 10 = 21 bytes; "a":"b" 1 + 3 + 3 = 7
    eq(check("chat", '{"messages":[],"a":"b","c":"d"}'), { true })           -- 14
    eq(check("chat", '{"messages":[],"abcdef":"123456"}'), { true })        -- 6+3+8 = 17
    eq(check("chat", '{"messages":[],"abcdefghi":[1,2,3]}'), { true })      -- 9+3+7 = 19
    eq(check("chat", '{"messages":[],"abcdefghij":[1,2,3]}'), { true })     -- 20
end)

case("unknown fields over the limit are refused, naming the largest", function()
    eq(check("chat", '{"messages":[],"a":"b","abcdefghij":[1, 2, 3, 4]}'), refused(
        "Request has 29 bytes of fields that vLLM does not read; the limit is 20 bytes. The "
        .. "largest is 'abcdefghij' (22 bytes): remove it", "abcdefghij",
        "unknown_fields_too_large"))
end)

case("a field of the other route counts as unknown", function()
    eq(check("chat", '{"messages":[],"prompt":"0123456789abc"}'), refused(
        "Request has 24 bytes of fields that vLLM does not read; the limit is 20 bytes. The "
        .. "largest is 'prompt' (24 bytes): remove it", "prompt", "unknown_fields_too_large"))
end)

case("the largest unknown field's name is cut to 64 characters", function()
    local name = string.rep("\195\169", 70) -- 70 characters, 140 bytes
    local answer = check("chat", '{"messages":[],"' .. name .. '":1}')
    local clipped = string.rep("\195\169", 64) .. "\226\128\166"
    eq(answer, refused("Request has 144 bytes of fields that vLLM does not read; the limit "
        .. "is 20 bytes. The largest is '" .. clipped .. "' (144 bytes): remove it", clipped,
        "unknown_fields_too_large"))
end)

case("a response_format within the bounds passes", function()
    eq(check("chat", '{"messages":[],"response_format":{"type":"json_schema","json_schema":'
        .. '{"name":"x","schema":{"type":"object","properties":{"a":{},"b":{},"c":{}}}}}}'),
        { true })
end)

case("a structured-output field is measured as JSON bytes", function()
    local edge = { structured_output = { max_bytes = 30, max_depth = 9, max_properties = 9 },
                   max_json_depth = 64, max_unknown_fields_bytes = 100 }
    -- {"type":"json_object","x":"12"} is 31 bytes
    eq(check("chat", '{"messages":[],"response_format":{"type":"json_object","x":"12"}}',
        edge), refused("'response_format' is 31 bytes of JSON; the limit is 30 bytes (vLLM "
        .. "compiles it before generating, whatever the prompt costs)", "response_format",
        TOO_COMPLEX))
    eq(check("chat", '{"messages":[],"response_format":{"type":"json_object","x":"1"}}',
        edge), { true })
end)

case("nesting deeper than max_depth is refused", function()
    eq(check("chat", '{"messages":[],"response_format":{"a":{"b":{"c":[{"d":[]}]}}}}'),
        refused("'response_format' is nested 6 levels deep; the limit is 5 levels",
            "response_format", TOO_COMPLEX))
    eq(check("chat", '{"messages":[],"response_format":{"a":{"b":{"c":[{"d":1}]}}}}'),
        { true })
end)

case("named properties are summed over properties and patternProperties", function()
    local edge = { structured_output = { max_bytes = 200, max_depth = 9, max_properties = 3 },
                   max_json_depth = 64, max_unknown_fields_bytes = 20 }
    eq(check("chat", '{"messages":[],"structured_outputs":{"json":{"properties":{"a":{'
        .. '"properties":{"b":{}}}},"patternProperties":{"^x":{},"^y":{}}}}}', edge), refused(
        "'structured_outputs' names 4 properties; the limit is 3 (vLLM's grammar grows with "
        .. "each one, whatever the prompt costs)", "structured_outputs", TOO_COMPLEX))
end)

case("structured_outputs.json given as JSON text is measured as what it holds", function()
    -- the text's depth counts from the field's own level: 1 + 5
    eq(check("chat", '{"messages":[],"structured_outputs":{"json":"{\\"a\\":{\\"b\\":'
        .. '{\\"c\\":{\\"d\\":[]}}}}"}}'), refused("'structured_outputs' is nested 6 levels "
        .. "deep; the limit is 5 levels", "structured_outputs", TOO_COMPLEX))
    eq(check("chat", '{"messages":[],"structured_outputs":{"json":"{\\"properties\\":{'
        .. '\\"a\\":{},\\"b\\":{}}}"}}'), { true })
end)

case("guided_json text counts from the top level", function()
    -- the text of the case above, 5 levels: within the bound here
    eq(check("chat", '{"messages":[],"guided_json":"{\\"a\\":{\\"b\\":{\\"c\\":'
        .. '{\\"d\\":[]}}}}"}',
        { structured_output = EDGE.structured_output, max_json_depth = 64,
          max_unknown_fields_bytes = 1000 }), { true })
end)

case("JSON text that is not JSON is refused as invalid_json", function()
    eq(check("chat", '{"messages":[],"structured_outputs":{"json":"{\\"a\\":"}}'), refused(
        "'structured_outputs.json' must hold a JSON value: unexpected end of input at byte 5",
        "structured_outputs.json", "invalid_json"))
    eq(check("chat", '{"messages":[],"structured_outputs":{"structural_tag":"[01]"}}'),
        refused("'structured_outputs.structural_tag' must hold a JSON value: invalid number "
            .. "(leading zero) at byte 1", "structured_outputs.structural_tag",
            "invalid_json"))
end)

case("JSON text nested beyond max_json_depth is refused as invalid_json", function()
    local edge = { structured_output = EDGE.structured_output, max_json_depth = 3,
                   max_unknown_fields_bytes = 1000 }
    eq(check("chat", '{"messages":[],"guided_json":"[[[[]]]]"}', edge), refused(
        "'guided_json' must hold a JSON value: JSON nesting deeper than 3 levels at byte 3",
        "guided_json", "invalid_json"))
end)

case("strings elsewhere are not read as JSON", function()
    eq(check("chat", '{"messages":[],"response_format":{"type":"json_schema","json":"{"}}'),
        { true })
    eq(check("chat", '{"messages":[],"structured_outputs":{"regex":"[a-z]+{"}}'), { true })
end)

case("null structured-output fields are skipped", function()
    eq(check("chat", '{"messages":[],"response_format":null,"structured_outputs":null}'),
        { true })
end)

case("a property named 'properties' counts once", function()
    local edge = { structured_output = { max_bytes = 1000, max_depth = 9, max_properties = 0 },
                   max_json_depth = 64, max_unknown_fields_bytes = 1000 }
    eq(check("chat", '{"messages":[],"response_format":{"type":"json_schema","json_schema":'
        .. '{"schema":{"type":"object","properties":{"properties":{"type":"string",'
        .. '"description":"d"}}}}}}', edge), refused("'response_format' names 1 properties; "
        .. "the limit is 0 (vLLM's grammar grows with each one, whatever the prompt costs)",
        "response_format", TOO_COMPLEX))
end)

case("a definition named 'properties' is no property map", function()
    local edge = { structured_output = { max_bytes = 1000, max_depth = 9, max_properties = 1 },
                   max_json_depth = 64, max_unknown_fields_bytes = 1000 }
    eq(check("chat", '{"messages":[],"structured_outputs":{"json":{"$defs":{"properties":'
        .. '{"type":"object","properties":{"a":{}}}},"definitions":{"properties":'
        .. '{"type":"string"}},"$ref":"#/$defs/properties"}}}', edge), { true })
end)
