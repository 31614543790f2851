-- tokengate.json: the strict decoder (what a client sent) and the encoder (what the edge
-- forwards). Every error is checked whole: message, byte offset, path and kind.

local t = ...
local json = require "tokengate.json"

local case, eq = t.case, t.eq
local decode, encode = json.decode, json.encode
local null = json.null
local KEYS = json.KEYS

-- shape(v) -> a plain Lua rendering of a decoded value, order and kinds included:
-- object {"object", k1, v1, ...}, array {"array", v1, ...}, literal box {"box", lit,
-- value}, null "null"; other scalars as they are
local function shape(v)
    if v == null then
        return "null"
    elseif json.is_object(v) then
        local out = { "object" }
        for _, k in ipairs(v[KEYS]) do
            out[#out + 1] = k
            out[#out + 1] = shape(v[k])
        end
        return out
    elseif json.is_array(v) then
        local out = { "array" }
        for i = 1, #v do
            out[i + 1] = shape(v[i])
        end
        return out
    elseif type(v) == "table" then
        return { "box", v.lit, v.value }
    end
    return v
end

-- refused(s, max_depth) -> the error decode gives s (it must give no value)
local function refused(s, max_depth)
    local v, err = decode(s, max_depth)
    eq(v, nil, "decoded value of " .. t.repr(s))
    return err
end

-- roundtrip(s): s is compact JSON that decode accepts and encode writes back unchanged
local function roundtrip(s)
    local v, err = decode(s)
    eq(err, nil, "error decoding " .. t.repr(s))
    eq(encode(v), s, "re-encoded " .. t.repr(s))
end

-- ------------------------------------------------------------ decode: values

case("decode: an object keeps its keys in document order", function()
    eq(shape(decode('{"b":1,"a":[true,false,null],"c":{}}')),
        { "object", "b", 1, "a", { "array", true, false, "null" }, "c", { "object" } })
end)

case("decode: whitespace around and between tokens is skipped", function()
    eq(shape(decode(' \t\r\n{ "a" :\n[ 1 , 2 ] }\n ')),
        { "object", "a", { "array", 1, 2 } })
end)

case("decode: top-level scalars", function()
    eq(decode("1"), 1)
    eq(decode('"s"'), "s")
    eq(decode("true"), true)
    eq(decode("false"), false)
    eq(decode("null"), null)
end)

case("decode: json.null is ngx.null", function()
    eq(json.null == ngx.null, true)
end)

case("decode: a plain integer of up to 15 digits is a Lua number", function()
    eq(decode("0"), 0)
    eq(decode("123456789012345"), 123456789012345)
    eq(decode("-123456789012345"), -123456789012345)
end)

case("decode: an integer of 16 digits or more keeps the client's literal", function()
    eq(shape(decode("1234567890123456")), { "box", "1234567890123456", 1234567890123456 })
    eq(shape(decode("-1234567890123456")), { "box", "-1234567890123456", -1234567890123456 })
end)

case("decode: 2^53 + 1 keeps its literal (no double holds it)", function()
    local v = decode("9007199254740993")
    eq(shape(v), { "box", "9007199254740993", 2 ^ 53 })
    eq(encode(v), "9007199254740993")
end)

case("decode: integers beyond 2^64 keep their literal", function()
    eq(encode(decode("[18446744073709551616,-99999999999999999999999]")),
        "[18446744073709551616,-99999999999999999999999]")
end)

case("decode: fractions and exponents keep their literal", function()
    eq(shape(decode("1.0")), { "box", "1.0", 1 })
    eq(shape(decode("1e5")), { "box", "1e5", 100000 })
    eq(shape(decode("1E+05")), { "box", "1E+05", 100000 })
    eq(shape(decode("-2.5e-3")), { "box", "-2.5e-3", -0.0025 })
    eq(shape(decode("0.1")), { "box", "0.1", 0.1 })
end)

case("decode: -0 keeps its literal and its sign", function()
    eq(shape(decode("-0")), { "box", "-0", -0.0 })
    eq(encode(decode("[-0,-0.0,0]")), "[-0,-0.0,0]")
end)

case("decode: 1e400 is a box of an infinity, re-encoded as sent", function()
    local v = decode("1e400")
    eq(shape(v), { "box", "1e400", math.huge })
    eq(encode(v), "1e400")
    eq(json.number(v), math.huge)
    eq(json.integer(v), nil)
    eq(shape(decode("-1e400")), { "box", "-1e400", -math.huge })
end)

case("decode: 1e-400 underflows to 0 inside its box", function()
    eq(shape(decode("1e-400")), { "box", "1e-400", 0 })
end)

case("number: plain and boxed numbers, nil for anything else", function()
    eq(json.number(decode("7")), 7)
    eq(json.number(decode("7.5")), 7.5)
    eq(json.number("7"), nil)
    eq(json.number(null), nil)
    eq(json.number(decode("[]")), nil)
end)

case("integer: integral values whatever the literal", function()
    eq(json.integer(decode("100")), 100)
    eq(json.integer(decode("100.0")), 100)
    eq(json.integer(decode("1e2")), 100)
    eq(json.integer(decode("-0")), -0.0)
    eq(json.integer(decode("1.5")), nil)
    eq(json.integer(decode("\"1\"")), nil)
    eq(json.integer(decode("12345678901234567890")), 12345678901234567890)
end)

-- ------------------------------------------------------------ decode: strings

case("decode: every simple escape", function()
    eq(decode('"\\"\\\\\\/\\b\\f\\n\\r\\t"'), '"\\/\b\f\n\r\t')
end)

case("decode: \\u escapes, BMP and surrogate pairs", function()
    eq(decode('"\\u0041\\u00e9\\u20AC"'), "A\195\169\226\130\172")
    eq(decode('"\\ud83d\\ude00"'), "\240\159\152\128")
    eq(decode('"\\uDBFF\\uDFFF"'), "\244\143\191\191") -- U+10FFFF
    eq(decode('"\\u0000"'), "\0")
end)

case("decode: raw UTF-8 of 2, 3 and 4 bytes", function()
    local s = "\195\169\226\130\172\240\159\152\128\244\143\191\191"
    eq(decode('"' .. s .. '"'), s)
end)

case("decode: the empty string and the empty key", function()
    eq(shape(decode('{"":""}')), { "object", "", "" })
end)

case("decode: a lone high surrogate escape is refused", function()
    eq(refused('"a\\ud800"'), { message = "lone surrogate escape \\ud800 (not a Unicode "
        .. "character)", offset = 2, kind = "surrogate" })
end)

case("decode: a high surrogate followed by no low surrogate is refused", function()
    eq(refused('"\\ud83d\\u0041"'), { message = "lone surrogate escape \\ud83d (not a "
        .. "Unicode character)", offset = 1, kind = "surrogate" })
end)

case("decode: a lone low surrogate escape is refused", function()
    eq(refused('"\\uDC00"'), { message = "lone surrogate escape \\udc00 (not a Unicode "
        .. "character)", offset = 1, kind = "surrogate" })
end)

case("decode: a short or non-hex \\u escape is refused", function()
    eq(refused('"\\u12"'), { message = "invalid \\u escape", offset = 1, kind = "syntax" })
    eq(refused('"\\u12G4"'), { message = "invalid \\u escape", offset = 1, kind = "syntax" })
end)

case("decode: an unknown escape is refused", function()
    eq(refused('"a\\x41"'), { message = "invalid escape in string", offset = 2,
                              kind = "syntax" })
    eq(refused('"\\\'"'), { message = "invalid escape in string", offset = 1,
                            kind = "syntax" })
end)

case("decode: raw control characters in a string are refused", function()
    eq(refused('"a\tb"'), { message = "unescaped control character 0x09 in string",
                            offset = 2, kind = "syntax" })
    eq(refused('"\1"'), { message = "unescaped control character 0x01 in string",
                          offset = 1, kind = "syntax" })
end)

case("decode: a NUL byte inside a string is refused, not taken as its end", function()
    eq(refused('"ab\0cd"'), { message = "unescaped control character 0x00 in string",
                              offset = 3, kind = "syntax" })
end)

case("decode: DEL (0x7F) in a string is allowed, as RFC 8259 says", function()
    eq(decode('"\127"'), "\127")
end)

case("decode: an unterminated string is refused at its opening quote", function()
    eq(refused('{"a":"abc'), { message = "unterminated string", offset = 5, path = "a",
                               kind = "syntax" })
end)

case("decode: invalid UTF-8 bytes are refused, with the byte named", function()
    local function utf8_error(bytes, offset_in, byte_name)
        eq(refused('"ab' .. bytes .. '"'), { message = "invalid UTF-8 byte " .. byte_name,
            offset = 3 + offset_in, kind = "utf8" }, "error of " .. t.repr(bytes))
    end
    utf8_error("\255", 0, "0xFF")                 -- never in UTF-8
    utf8_error("\128", 0, "0x80")                 -- a continuation byte first
    utf8_error("\192\175", 0, "0xC0")             -- overlong '/'
    utf8_error("\224\128\175", 0, "0xE0")         -- overlong, 3 bytes
    utf8_error("\237\160\128", 0, "0xED")         -- U+D800 encoded
    utf8_error("\244\144\128\128", 0, "0xF4")     -- above U+10FFFF
    utf8_error("\245\128\128\128", 0, "0xF5")
    utf8_error("\226\130", 0, "0xE2")             -- cut short before the quote
    utf8_error("\195\169\255", 2, "0xFF")         -- after a valid character
end)

case("decode: invalid UTF-8 in a key is refused", function()
    eq(refused('{"a":{"\255":1}}'), { message = "invalid UTF-8 byte 0xFF", offset = 7,
                                      path = "a", kind = "utf8" })
end)

case("decode: a UTF-8 byte order mark before the text is refused", function()
    eq(refused("\239\187\191{}"), { message = "byte order mark before the JSON text",
                                    offset = 0, kind = "syntax" })
end)

case("decode: bytes outside any token are named", function()
    eq(refused("\255"), { message = "invalid UTF-8 byte 0xFF", offset = 0, kind = "utf8" })
    eq(refused("\195\169"), { message = "unexpected byte 0xC3", offset = 0, kind = "syntax" })
    eq(refused("\12{}"), { message = "unexpected byte 0x0C", offset = 0, kind = "syntax" })
    eq(refused("'a'"), { message = "unexpected character '''", offset = 0, kind = "syntax" })
end)

-- ------------------------------------------------------------ decode: numbers refused

case("decode: numbers outside RFC 8259's grammar are refused", function()
    local function bad(s, message, offset)
        eq(refused(s), { message = message, offset = offset, kind = "syntax" },
            "error of " .. t.repr(s))
    end
    bad("01", "invalid number (leading zero)", 0)
    bad("-01", "invalid number (leading zero)", 0)
    bad("00", "invalid number (leading zero)", 0)
    bad("-", "invalid number", 0)
    bad("1.", "invalid number", 0)
    bad("1.e5", "invalid number", 0)
    bad("1e", "invalid number", 0)
    bad("1e+", "invalid number", 0)
    bad("-a", "invalid number", 0)
    bad("-Infinity", "invalid number", 0)
    bad(".5", "unexpected character '.'", 0)
    bad("+1", "unexpected character '+'", 0)
    bad("NaN", "unexpected character 'N'", 0)
    bad("Infinity", "unexpected character 'I'", 0)
    bad("0x10", "unexpected data after the JSON value", 1)
    bad("1 2", "unexpected data after the JSON value", 2)
end)

-- ------------------------------------------------------------ decode: structure refused

case("decode: empty input and whitespace only", function()
    eq(refused(""), { message = "unexpected end of input", offset = 0, kind = "syntax" })
    eq(refused(" \n"), { message = "unexpected end of input", offset = 2, kind = "syntax" })
end)

case("decode: data after the value is refused (a NUL too)", function()
    eq(refused("{} x"), { message = "unexpected data after the JSON value", offset = 3,
                          kind = "syntax" })
    eq(refused("{}\0"), { message = "unexpected data after the JSON value", offset = 2,
                          kind = "syntax" })
    eq(refused("truex"), { message = "unexpected data after the JSON value", offset = 4,
                           kind = "syntax" })
end)

case("decode: misspelt literals are refused", function()
    eq(refused("nul"), { message = "unexpected character 'n'", offset = 0, kind = "syntax" })
    eq(refused("[True]"), { message = "unexpected character 'T'", offset = 1,
                            path = "[0]", kind = "syntax" })
end)

case("decode: array punctuation errors name the element", function()
    eq(refused("[1,]"), { message = "unexpected character ']'", offset = 3, path = "[1]",
                          kind = "syntax" })
    eq(refused("[1 2]"), { message = "expected ',' or ']' in array", offset = 3,
                           path = "[0]", kind = "syntax" })
    eq(refused("[1"), { message = "expected ',' or ']' in array", offset = 2, path = "[0]",
                        kind = "syntax" })
    eq(refused("["), { message = "unexpected end of input", offset = 1, path = "[0]",
                       kind = "syntax" })
end)

case("decode: object punctuation errors name the member", function()
    eq(refused('{"a" 1}'), { message = "expected ':' after object key", offset = 5,
                             path = "a", kind = "syntax" })
    eq(refused('{"a":1,}'), { message = "expected a string key in object", offset = 7,
                              kind = "syntax" })
    eq(refused("{1:2}"), { message = "expected a string key in object", offset = 1,
                           kind = "syntax" })
    eq(refused('{"a":1 "b":2}'), { message = "expected ',' or '}' in object", offset = 7,
                                   path = "a", kind = "syntax" })
    eq(refused('{"a":}'), { message = "unexpected character '}'", offset = 5, path = "a",
                            kind = "syntax" })
end)

case("decode: error paths name nested members bottom-up", function()
    eq(refused('{"messages":[{"role":"user"},{"content":"\\ud800"}]}'), {
        message = "lone surrogate escape \\ud800 (not a Unicode character)", offset = 41,
        path = "messages[1].content", kind = "surrogate" })
end)

case("decode: a key that is no identifier is quoted in the path", function()
    eq(refused('{"a b":[01]}'), { message = "invalid number (leading zero)", offset = 8,
                                  path = '["a b"][0]', kind = "syntax" })
end)

-- ------------------------------------------------------------ decode: duplicates, depth

case("decode: a duplicate key is refused", function()
    eq(refused('{"a":1,"a":2}'), { message = 'duplicate key "a"', offset = 7, path = "a",
                                   kind = "duplicate" })
end)

case("decode: a duplicate key spelt with an escape is refused", function()
    eq(refused('{"model":"x","m\\u006fdel":"y"}'), { message = 'duplicate key "model"',
        offset = 13, path = "model", kind = "duplicate" })
end)

case("decode: a nested duplicate key is named by its path", function()
    eq(refused('{"m":[{"x":1,"x":2}]}'), { message = 'duplicate key "x"', offset = 13,
                                           path = "m[0].x", kind = "duplicate" })
end)

case("decode: the same key in two objects is no duplicate", function()
    eq(encode(decode('[{"a":1},{"a":2}]')), '[{"a":1},{"a":2}]')
end)

case("decode: nesting up to max_depth is accepted", function()
    local s = string.rep("[", 64) .. string.rep("]", 64)
    roundtrip(s)
    eq(encode(decode('{"a":{"b":1}}', 2)), '{"a":{"b":1}}')
end)

case("decode: nesting one level deeper than max_depth is refused", function()
    eq(refused(string.rep("[", 65) .. string.rep("]", 65)), {
        message = "JSON nesting deeper than 64 levels", offset = 64,
        path = string.rep("[0]", 64), kind = "depth" })
    eq(refused('{"a":{"b":{}}}', 2), { message = "JSON nesting deeper than 2 levels",
        offset = 10, path = "a.b", kind = "depth" })
    eq(refused("[]", 0), { message = "JSON nesting deeper than 0 levels", offset = 0,
                           kind = "depth" })
end)

case("decode: 100000 open brackets are refused at the depth limit", function()
    eq(refused(string.rep("[", 100000)), { message = "JSON nesting deeper than 64 levels",
        offset = 64, path = string.rep("[0]", 64), kind = "depth" })
    eq(refused(string.rep('{"a":', 100000)), { message = "JSON nesting deeper than 64 "
        .. "levels", offset = 64 * 5, path = string.rep(".a", 64):sub(2), kind = "depth" })
end)

-- ------------------------------------------------------------ encode

case("encode: a decoded body is written back byte for byte", function()
    roundtrip('{"model":"m","messages":[{"role":"user","content":"h\195\169 \\"x\\\\\\n"}],'
        .. '"temperature":0.70,"max_tokens":1e3,"seed":18446744073709551615,"n":1,'
        .. '"stop":null,"stream":false,"logit_bias":{"50256":-100}}')
end)

case("encode: decoded escapes are written as raw UTF-8 or the short escape", function()
    eq(encode(decode('"\\u00e9\\/\\u001f\\u007f\\u2028"')), '"\195\169/\\u001f\127'
        .. '\226\128\168"')
end)

case("encode: what a string must escape", function()
    eq(encode('"\\\b\f\n\r\t'), '"\\"\\\\\\b\\f\\n\\r\\t"')
    eq(encode("\0\1\31 ~"), '"\\u0000\\u0001\\u001f ~"')
    eq(encode("</script>"), '"</script>"')
    eq(encode(""), '""')
end)

case("encode: integers without exponent below 1e15", function()
    eq(encode(0), "0")
    eq(encode(-0.0), "0")
    eq(encode(999999999999999), "999999999999999")
    eq(encode(-999999999999999), "-999999999999999")
end)

case("encode: the shortest text that reads back as the double", function()
    eq(encode(0.1), "0.1")
    eq(encode(1 / 3), "0.3333333333333333")
    eq(encode(0.1 + 0.2), "0.30000000000000004")
    eq(encode(1.5), "1.5")
    eq(encode(1e-7), "1e-07")
    eq(encode(1e15), "1e+15")
    eq(encode(2 ^ 53), "9007199254740992")
    eq(encode(2 ^ 53 + 2), "9007199254740994")
    eq(encode(2 ^ 64), "1.8446744073709552e+19")
    eq(encode(1.7976931348623157e308), "1.7976931348623157e+308")
    eq(encode(5e-324), "4.9406564584125e-324")
end)

case("encode: NaN and infinities are null", function()
    eq(encode({ 0 / 0, math.huge, -math.huge }), "[null,null,null]")
end)

case("encode: plain tables, arrays by t[1], objects with sorted keys", function()
    eq(encode({ 1, "a", true }), '[1,"a",true]')
    eq(encode({ b = 1, a = { c = false }, [3] = "x" }), '{"a":{"c":false},"b":1}')
    eq(encode({}), "{}")
    eq(encode(json.array()), "[]")
    eq(encode(json.object()), "{}")
    eq(encode(null), "null")
    eq(encode(nil), "null")
end)

case("encode: an object's fields keep the order set() gave them", function()
    local o = json.object()
    json.set(o, "z", 1)
    json.set(o, "a", json.array({ 2 }))
    json.set(o, "z", 3)
    eq(encode(o), '{"z":3,"a":[2]}')
    eq(o[KEYS], { "z", "a" })
end)

case("encode: a field set to nil is left out", function()
    local o = decode('{"a":1,"b":2,"c":3}')
    json.set(o, "a", nil)
    o.c = nil
    eq(encode(o), '{"b":2}')
end)

case("encode: a field removed and set again is written once", function()
    local o = decode('{"a":1,"b":2}')
    json.set(o, "a", nil)
    json.set(o, "a", 3)
    local text = encode(o)
    t.ok(text == '{"b":2,"a":3}' or text == '{"a":3,"b":2}', "one field a in " .. text)
end)

case("utf8_char and utf8_len agree at the boundaries", function()
    for _, cp in ipairs({ 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000, 0x10FFFF }) do
        local s = json.utf8_char(cp)
        eq(json.utf8_len(s, 1), #s, "length of U+" .. string.format("%X", cp))
    end
    eq(json.utf8_char(0x7F), "\127")
    eq(json.utf8_len("\237\159\191", 1), 3) -- U+D7FF
    eq(json.utf8_len("\238\128\128", 1), 3) -- U+E000
    eq(json.utf8_len("\237\160\128", 1), nil) -- U+D800
end)
