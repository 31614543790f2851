-- Strict JSON for request bodies: decode what a client sent, encode what the edge forwards.
--
-- Why not cjson: it accepts duplicate keys (last wins), invalid UTF-8 and lone surrogate
-- escapes, and it loses key order and big integers when re-encoding. The edge forwards
-- the body it parsed, so the parser must refuse everything that two
-- JSON readers could read differently, and the encoder must keep what it did not touch.
-- (Over 600 lines: the decoder and the encoder share the representation and the byte
-- tables of their scanning loops, and each loop is written out for LuaJIT to compile.)
--
-- Representation of decoded values:
--   object  -> Lua table with metatable OBJECT; t[KEYS] is the array of its keys in
--              document order (KEYS is a private table, it can never clash with a string)
--   array   -> Lua table with metatable ARRAY, elements 1..n (null elements are json.null)
--   string  -> Lua string (valid UTF-8, escapes resolved)
--   number  -> Lua number when the literal is a plain integer of <= 15 digits; otherwise a
--              "literal box" {lit = "<the client's literal>", value = <number>} with
--              metatable NUMBER, re-encoded verbatim (1.0, 1e5, 2^63 stay as sent)
--   true/false -> booleans; null -> json.null (== ngx.null == cjson.null)

local ngx = ngx
local ffi = require "ffi"

local type = type
local byte, char, sub, find = string.byte, string.char, string.sub, string.find
local format, gsub = string.format, string.gsub
local concat, remove = table.concat, table.remove
local tonumber, setmetatable, getmetatable = tonumber, setmetatable, getmetatable
local floor, huge = math.floor, math.huge
local sort = table.sort
local pairs, tostring = pairs, tostring

local cast = ffi.cast
local u8p = ffi.typeof("const uint8_t *")

local _M = {}

-- Byte classes for the scanning loops. Scanning with a JIT-compiled loop over the bytes is
-- several times faster than string.find with a character class (which LuaJIT runs in its
-- interpreter), and strings are scanned on every request.
-- STR_STOP: bytes that end a run of plain string content: '"', '\', C0 controls (and
-- the NUL that terminates every Lua string, so a scan never runs past the end), and
-- bytes >= 0x80 (validated as UTF-8).
local STR_STOP = ffi.new("uint8_t[256]")
-- ESC_NEED: bytes the encoder must escape: '"', '\', C0 controls.
local ESC_NEED = ffi.new("uint8_t[256]")
for b = 0, 31 do
    STR_STOP[b], ESC_NEED[b] = 1, 1
end
for b = 128, 255 do
    STR_STOP[b] = 1
end
STR_STOP[34], STR_STOP[92], ESC_NEED[34], ESC_NEED[92] = 1, 1, 1, 1
-- WS: JSON's whitespace (RFC 8259: space, tab, CR, LF); DIGIT: '0'..'9'; HEX: the hex
-- digits' values + 1 (0: not a hex digit). string.find with a pattern would leave the
-- JIT-compiled trace for the interpreter on every call.
local WS = ffi.new("uint8_t[256]")
local DIGIT = ffi.new("uint8_t[256]")
local HEX = ffi.new("uint8_t[256]")
WS[32], WS[9], WS[13], WS[10] = 1, 1, 1, 1
for b = 48, 57 do
    DIGIT[b], HEX[b] = 1, b - 47
end
for b = 0, 5 do
    HEX[65 + b], HEX[97 + b] = 11 + b, 11 + b
end

-- P: bytes of the text being decoded (set by decode(); decoding never yields, so one
-- per worker is enough). The string stays referenced by decode()'s argument meanwhile.
local P

local OBJECT = { __name = "json.object" }
local ARRAY = { __name = "json.array" }
local NUMBER = { __name = "json.number" }
local KEYS = {}
local null = ngx and ngx.null or setmetatable({}, { __tostring = function() return "null" end })

_M.null = null
_M.OBJECT = OBJECT
_M.ARRAY = ARRAY
_M.KEYS = KEYS

-- ---------------------------------------------------------------- constructors

-- object() -> empty JSON object; fields added with json.set keep their order.
function _M.object()
    return setmetatable({ [KEYS] = {} }, OBJECT)
end

-- array(t?) -> t (or {}) marked as a JSON array.
function _M.array(t)
    return setmetatable(t or {}, ARRAY)
end

-- is_object(v) / is_array(v) -> boolean
function _M.is_object(v)
    return type(v) == "table" and getmetatable(v) == OBJECT
end

-- is_array(v) -> boolean
function _M.is_array(v)
    return type(v) == "table" and getmetatable(v) == ARRAY
end

-- set(obj, key, value): sets a field of an object, appending the key when it is new;
-- value nil removes the field and its key, so a field set again later is written once,
-- last. (A field cleared with obj[key] = nil keeps its key, which the encoder skips
-- while the value is nil: clear with set to set the field again.)
function _M.set(obj, key, value)
    if obj[key] == nil then
        if value ~= nil then
            local keys = obj[KEYS]
            keys[#keys + 1] = key
        end
    elseif value == nil then
        -- removing is rare: the scan leaves the common case, a new key, one append
        local keys = obj[KEYS]
        for i = 1, #keys do
            if keys[i] == key then
                remove(keys, i)
                break
            end
        end
    end
    obj[key] = value
end

-- drop_nulls(obj) -> how many members were dropped: obj's members whose value is null
-- removed (its own members only).
function _M.drop_nulls(obj)
    local keys = obj[KEYS]
    local n = 0
    for i = #keys, 1, -1 do
        if obj[keys[i]] == _M.null then
            _M.set(obj, keys[i], nil)
            n = n + 1
        end
    end
    return n
end

-- number(v) -> Lua number of a decoded number (plain or literal box), else nil.
function _M.number(v)
    local tv = type(v)
    if tv == "number" then
        return v
    end
    if tv == "table" and getmetatable(v) == NUMBER then
        return v.value
    end
    return nil
end

-- integer(v) -> the integer value of a decoded JSON number that is integral
-- (100 and 100.0 both give 100), else nil.
function _M.integer(v)
    local n = _M.number(v)
    if n and n == floor(n) and n > -huge and n < huge then
        return n
    end
    return nil
end

-- ---------------------------------------------------------------- decoder

-- Errors are returned as (nil, message, byte offset (0-based), path) where path names the
-- JSON location bottom-up ("messages[2].content"). The success path builds no paths.

local decode_value -- forward

local ESCAPES = {
    [34] = '"', [92] = "\\", [47] = "/", [98] = "\b", [102] = "\f",
    [110] = "\n", [114] = "\r", [116] = "\t",
}

-- utf8_char(cp) -> UTF-8 bytes of code point cp (0..0x10FFFF, no surrogates)
local function utf8_char(cp)
    if cp < 0x80 then
        return char(cp)
    elseif cp < 0x800 then
        return char(0xC0 + floor(cp / 0x40), 0x80 + cp % 0x40)
    elseif cp < 0x10000 then
        return char(0xE0 + floor(cp / 0x1000), 0x80 + floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
    end
    return char(0xF0 + floor(cp / 0x40000), 0x80 + floor(cp / 0x1000) % 0x40,
        0x80 + floor(cp / 0x40) % 0x40, 0x80 + cp % 0x40)
end
_M.utf8_char = utf8_char

-- utf8_len(s, i) -> length of the valid UTF-8 sequence starting at s[i] (2..4), or nil.
-- Rejects overlong forms, UTF-16 surrogates (U+D800..U+DFFF) and code points > U+10FFFF.
local function utf8_len(s, i)
    local b = byte(s, i)
    if b < 0xC2 or b > 0xF4 then
        return nil
    end
    local b2 = byte(s, i + 1)
    if not b2 or b2 < 0x80 or b2 > 0xBF then
        return nil
    end
    if b < 0xE0 then
        return 2
    end
    if (b == 0xE0 and b2 < 0xA0) or (b == 0xED and b2 > 0x9F) then
        return nil
    end
    local b3 = byte(s, i + 2)
    if not b3 or b3 < 0x80 or b3 > 0xBF then
        return nil
    end
    if b < 0xF0 then
        return 3
    end
    if (b == 0xF0 and b2 < 0x90) or (b == 0xF4 and b2 > 0x8F) then
        return nil
    end
    local b4 = byte(s, i + 3)
    if not b4 or b4 < 0x80 or b4 > 0xBF then
        return nil
    end
    return 4
end
_M.utf8_len = utf8_len

-- hex4(i) -> value of the 4 hex digits at the text's (1-based) i..i+3, or nil. The
-- NUL after the text is no hex digit, so a short text stops the scan.
local function hex4(i)
    local v = 0
    for k = i - 1, i + 2 do
        local h = HEX[P[k]]
        if h == 0 then
            return nil
        end
        v = v * 16 + h - 1
    end
    return v
end

-- decode_string(s, i) -> string, next index | nil, err, offset
-- i is the index just after the opening quote.
local function decode_string(s, i)
    local parts, np = nil, 0
    local start = i
    local n = #s
    while true do
        local j = i - 1 -- 0-based
        while STR_STOP[P[j]] == 0 do
            j = j + 1
        end
        j = j + 1
        if j > n then
            return nil, "unterminated string", start - 2
        end
        local b = P[j - 1]
        if b == 34 then -- closing quote
            if parts then
                np = np + 1
                parts[np] = sub(s, start, j - 1)
                return concat(parts, "", 1, np), j + 1
            end
            return sub(s, start, j - 1), j + 1
        elseif b >= 0x80 then
            -- validate this and any following multi-byte characters inline
            local k = j
            while true do
                local n = utf8_len(s, k)
                if not n then
                    return nil, format("invalid UTF-8 byte 0x%02X", byte(s, k)), k - 1, "utf8"
                end
                k = k + n
                local nb = byte(s, k)
                if not nb or nb < 0x80 then
                    break
                end
            end
            i = k
        elseif b == 92 then -- backslash
            parts = parts or {}
            np = np + 1
            parts[np] = sub(s, start, j - 1)
            local e = byte(s, j + 1)
            local simple = e and ESCAPES[e]
            if simple then
                np = np + 1
                parts[np] = simple
                i = j + 2
            elseif e == 117 then -- \uXXXX
                local cp = hex4(j + 2)
                if not cp then
                    return nil, "invalid \\u escape", j - 1
                end
                i = j + 6
                if cp >= 0xD800 and cp <= 0xDBFF then
                    local lo = byte(s, i) == 92 and byte(s, i + 1) == 117 and hex4(i + 2)
                    if not lo or lo < 0xDC00 or lo > 0xDFFF then
                        return nil, format("lone surrogate escape \\u%04x (not a Unicode character)",
                            cp), j - 1, "surrogate"
                    end
                    cp = 0x10000 + (cp - 0xD800) * 0x400 + (lo - 0xDC00)
                    i = i + 6
                elseif cp >= 0xDC00 and cp <= 0xDFFF then
                    return nil, format("lone surrogate escape \\u%04x (not a Unicode character)", cp),
                        j - 1, "surrogate"
                end
                np = np + 1
                parts[np] = utf8_char(cp)
            else
                return nil, "invalid escape in string", j - 1
            end
            start = i
        else
            return nil, format("unescaped control character 0x%02X in string", b), j - 1
        end
    end
end

-- skip_ws(i) -> index of the first non-whitespace byte of the text (P) at or after i
-- (#s + 1 at its end: the NUL after it is no whitespace)
local function skip_ws(i)
    while WS[P[i - 1]] ~= 0 do
        i = i + 1
    end
    return i
end

-- digits_end(i) -> the last index of the run of ASCII digits starting at i; i - 1 when
-- there is none
local function digits_end(i)
    while DIGIT[P[i - 1]] ~= 0 do
        i = i + 1
    end
    return i - 1
end

-- decode_number(s, i) -> number or literal box, next index | nil, err, offset
-- (RFC 8259 grammar: no leading zeros, no "1.", no "+1")
local function decode_number(s, i)
    local int_start = P[i - 1] == 45 and i + 1 or i
    local e = digits_end(int_start)
    if e < int_start then
        return nil, "invalid number", i - 1
    end
    if P[int_start - 1] == 48 and e > int_start then
        return nil, "invalid number (leading zero)", i - 1
    end
    local plain = true
    if P[e] == 46 then -- '.': at least one digit must follow
        local e2 = digits_end(e + 2)
        if e2 < e + 2 then
            return nil, "invalid number", i - 1
        end
        e, plain = e2, false
    end
    local c = P[e]
    if c == 101 or c == 69 then -- 'e', 'E', an optional sign, at least one digit
        local k = e + 2
        c = P[k - 1]
        if c == 45 or c == 43 then
            k = k + 1
        end
        local e2 = digits_end(k)
        if e2 < k then
            return nil, "invalid number", i - 1
        end
        e, plain = e2, false
    end
    local lit = sub(s, i, e)
    local v = tonumber(lit)
    if plain and e - int_start < 15 and lit ~= "-0" then
        return v, e + 1
    end
    return setmetatable({ lit = lit, value = v }, NUMBER), e + 1
end

-- decode_array(s, i, depth, max_depth) -> array, next index
--   | nil, message, offset, path, kind (i is just after "[")
local function decode_array(s, i, depth, max_depth)
    local t = setmetatable({}, ARRAY)
    local n = 0
    i = skip_ws(i)
    if byte(s, i) == 93 then
        return t, i + 1
    end
    while true do
        local v, ni, err_off, path, kind = decode_value(s, skip_ws(i), depth, max_depth)
        if v == nil then
            return nil, ni, err_off, "[" .. n .. "]" .. (path or ""), kind
        end
        n = n + 1
        t[n] = v
        i = skip_ws(ni)
        local c = byte(s, i)
        if c == 44 then
            i = i + 1
        elseif c == 93 then
            return t, i + 1
        else
            return nil, "expected ',' or ']' in array", i - 1, "[" .. (n - 1) .. "]"
        end
    end
end

-- key_path(k) -> ".k" for identifier-like keys, else '["k"]' (error paths)
local function key_path(k)
    if find(k, "^[%a_][%w_]*$") then
        return "." .. k
    end
    return "[" .. format("%q", k) .. "]"
end

-- decode_object(s, i, depth, max_depth) -> object, next index
--   | nil, message, offset, path, kind (i is just after "{"); duplicate keys are errors
local function decode_object(s, i, depth, max_depth)
    local keys = {}
    local t = setmetatable({ [KEYS] = keys }, OBJECT)
    local n = 0
    i = skip_ws(i)
    if byte(s, i) == 125 then
        return t, i + 1
    end
    while true do
        if byte(s, i) ~= 34 then
            return nil, "expected a string key in object", i - 1
        end
        local k, ni, err_off, kind = decode_string(s, i + 1)
        if k == nil then
            return nil, ni, err_off, nil, kind
        end
        if t[k] ~= nil then
            return nil, format("duplicate key %q", k), i - 1, key_path(k), "duplicate"
        end
        i = skip_ws(ni)
        if byte(s, i) ~= 58 then
            return nil, "expected ':' after object key", i - 1, key_path(k)
        end
        local v, vi, verr_off, path, vkind = decode_value(s, skip_ws(i + 1), depth, max_depth)
        if v == nil then
            return nil, vi, verr_off, key_path(k) .. (path or ""), vkind
        end
        n = n + 1
        keys[n] = k
        t[k] = v
        i = skip_ws(vi)
        local c = byte(s, i)
        if c == 44 then
            i = skip_ws(i + 1)
        elseif c == 125 then
            return t, i + 1
        else
            return nil, "expected ',' or '}' in object", i - 1, key_path(k)
        end
    end
end

-- decode_value(s, i, depth, max_depth) -> value, next index
--   | nil, message, offset, path, kind
decode_value = function(s, i, depth, max_depth)
    local c = byte(s, i)
    if c == 123 or c == 91 then
        if depth >= max_depth then
            return nil, format("JSON nesting deeper than %d levels", max_depth), i - 1, nil, "depth"
        end
        if c == 123 then
            return decode_object(s, i + 1, depth + 1, max_depth)
        end
        return decode_array(s, i + 1, depth + 1, max_depth)
    elseif c == 34 then
        local v, ni, off, kind = decode_string(s, i + 1)
        if v == nil then
            return nil, ni, off, nil, kind
        end
        return v, ni
    elseif c == 45 or (c and c >= 48 and c <= 57) then
        return decode_number(s, i)
    elseif c == 116 and sub(s, i, i + 3) == "true" then
        return true, i + 4
    elseif c == 102 and sub(s, i, i + 4) == "false" then
        return false, i + 5
    elseif c == 110 and sub(s, i, i + 3) == "null" then
        return null, i + 4
    elseif c == nil then
        return nil, "unexpected end of input", i - 1
    end
    if c >= 0x80 and not utf8_len(s, i) then
        return nil, format("invalid UTF-8 byte 0x%02X", c), i - 1, nil, "utf8"
    end
    if c == 0xEF and i == 1 and sub(s, 1, 3) == "\239\187\191" then
        return nil, "byte order mark before the JSON text", 0
    end
    if c < 0x21 or c > 0x7E then
        return nil, format("unexpected byte 0x%02X", c), i - 1
    end
    return nil, "unexpected character '" .. char(c) .. "'", i - 1
end

-- decode(s, max_depth) -> value
--   | nil, err where err = {message = "...", offset = <0-based byte>, path = "a.b[1]" or nil,
--                           kind = "syntax" | "utf8" | "surrogate" | "duplicate" | "depth"}
-- Accepts exactly RFC 8259 JSON text in UTF-8: no BOM, no trailing data.
function _M.decode(s, max_depth)
    P = cast(u8p, s)
    local v, ni, off, path, kind = decode_value(s, skip_ws(1), 0, max_depth or 64)
    if v ~= nil then
        ni = skip_ws(ni)
    end
    P = nil
    if v == nil then
        if path and byte(path, 1) == 46 then
            path = sub(path, 2)
        end
        return nil, { message = ni, offset = off, path = path, kind = kind or "syntax" }
    end
    if ni <= #s then
        return nil, { message = "unexpected data after the JSON value", offset = ni - 1,
                      kind = "syntax" }
    end
    return v
end

-- ---------------------------------------------------------------- encoder

local ESC_OUT = {
    ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f",
    ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t",
}
for c = 0, 31 do
    local ch = char(c)
    if not ESC_OUT[ch] then
        ESC_OUT[ch] = format("\\u%04x", c)
    end
end

-- escape(s) -> the inside of the JSON string literal of s (s is valid UTF-8): s itself
-- when nothing in it needs escaping
local function escape(s)
    local p = cast(u8p, s)
    for i = 0, #s - 1 do
        if ESC_NEED[p[i]] ~= 0 then
            return (gsub(s, '[%z\1-\31"\\]', ESC_OUT))
        end
    end
    return s
end

-- encode_number(v) -> shortest text that reads back as v; integers without exponent;
-- NaN and infinities (never produced by decode) as null
local function encode_number(v)
    if v ~= v or v == huge or v == -huge then
        return "null"
    end
    if v == floor(v) and v > -1e15 and v < 1e15 then
        return format("%d", v)
    end
    for p = 14, 17 do
        local s = format("%." .. p .. "g", v)
        if tonumber(s) == v then
            return s
        end
    end
    return format("%.17g", v)
end

local encode_into -- forward

-- sorted_keys(t) -> sorted string keys of a plain Lua table (deterministic output)
local function sorted_keys(t)
    local keys = {}
    for k in pairs(t) do
        if type(k) == "string" then
            keys[#keys + 1] = k
        end
    end
    sort(keys)
    return keys
end

-- encode_scalar(v, tv, buf, n) -> new n: appends the JSON text of v, which is no array
-- or object (tv = type(v)), to buf[n+1..]
local function encode_scalar(v, tv, buf, n)
    if tv == "string" then
        -- the quotes as pieces of their own: a prompt is not copied once more to quote it
        buf[n + 1], buf[n + 2], buf[n + 3] = '"', escape(v), '"'
        return n + 3
    elseif tv == "number" then
        buf[n + 1] = encode_number(v)
    elseif tv == "boolean" then
        buf[n + 1] = v and "true" or "false"
    elseif v == null or v == nil then
        buf[n + 1] = "null"
    elseif tv == "table" then -- a literal box
        buf[n + 1] = v.lit
    else
        buf[n + 1], buf[n + 2], buf[n + 3] = '"', escape(tostring(v)), '"'
        return n + 3
    end
    return n + 1
end

-- composite(v, tv) -> true when v is an array or an object (a table that is neither null
-- nor a literal box), which encode_into recurses into
local function composite(v, tv)
    return tv == "table" and v ~= null and getmetatable(v) ~= NUMBER
end

-- encode_into(v, buf, n) -> new n: appends the JSON text of v to buf[n+1..]. Scalars in
-- arrays and objects are written in the loop, without a recursive call: LuaJIT does not
-- compile a loop whose body recurses, and most values are scalars.
encode_into = function(v, buf, n)
    local tv = type(v)
    if not composite(v, tv) then
        return encode_scalar(v, tv, buf, n)
    end
    local mt = getmetatable(v)
    if mt == ARRAY or (mt == nil and v[1] ~= nil) then
        n = n + 1
        buf[n] = "["
        for i = 1, #v do
            if i > 1 then
                n = n + 1
                buf[n] = ","
            end
            local e = v[i]
            local te = type(e)
            if composite(e, te) then
                n = encode_into(e, buf, n)
            else
                n = encode_scalar(e, te, buf, n)
            end
        end
        n = n + 1
        buf[n] = "]"
        return n
    end
    local keys = v[KEYS] or sorted_keys(v)
    n = n + 1
    buf[n] = "{"
    local first = true
    for i = 1, #keys do
        local k = keys[i]
        local fv = v[k]
        if fv ~= nil then
            if not first then
                n = n + 1
                buf[n] = ","
            end
            first = false
            buf[n + 1], buf[n + 2], buf[n + 3] = '"', escape(k), '":'
            n = n + 3
            local tf = type(fv)
            if composite(fv, tf) then
                n = encode_into(fv, buf, n)
            else
                n = encode_scalar(fv, tf, buf, n)
            end
        end
    end
    n = n + 1
    buf[n] = "}"
    return n
end

-- append(v, buf, n) -> new n: the JSON text of v (as encode writes it) appended to
-- buf[n+1..] in pieces, for a caller that writes a text around it (tokengate.usage.line)
-- and joins the pieces once.
_M.append = function(v, buf, n)
    return encode_into(v, buf, n)
end

-- encode(v) -> compact JSON text. Objects keep their key order (KEYS), plain Lua tables
-- are encoded as arrays when t[1] is set, else as objects with sorted keys. Strings are
-- written as raw UTF-8 with only '"', '\' and C0 controls escaped.
function _M.encode(v)
    local buf = {}
    local n = encode_into(v, buf, 0)
    return concat(buf, "", 1, n)
end

return _M
