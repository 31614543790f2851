-- The two protobuf messages of tokengate.v1.TokenCounter (proto/tokengate/v1/counter.proto),
-- encoded and decoded by hand: Debian ships no Lua protobuf library, and two fixed
-- messages need only varints and length-delimited fields. gRPC framing (1 flag byte,
-- 4-byte big-endian length) is here too.
--
-- Numbers stay below 2^53 (lengths, token counts), so plain Lua arithmetic is exact;
-- LuaJIT's bit ops are 32-bit and are not used.

local byte = string.byte
local char = string.char
local sub = string.sub
local concat = table.concat
local floor = math.floor
local type = type

local _M = {}

-- varint(n) -> protobuf base-128 varint bytes of n (0 <= n < 2^53)
local function varint(n)
    if n < 128 then
        return char(n)
    end
    local out, i = {}, 0
    while n >= 128 do
        i = i + 1
        out[i] = char(128 + n % 128)
        n = floor(n / 128)
    end
    out[i + 1] = char(n)
    return concat(out)
end

-- read_varint(s, i) -> value, next index | nil (truncated or longer than 10 bytes)
local function read_varint(s, i)
    local v, mul = 0, 1
    for k = 0, 9 do
        local b = byte(s, i + k)
        if not b then
            return nil
        end
        if b < 128 then
            return v + b * mul, i + k + 1
        end
        v = v + (b - 128) * mul
        mul = mul * 128
    end
    return nil
end

-- count_request(model, endpoint, body) -> serialized CountRequest.
-- model: served model name; endpoint: 1 chat, 2 completions; body: bytes.
function _M.count_request(model, endpoint, body)
    return "\10" .. varint(#model) .. model .. "\16" .. varint(endpoint)
        .. "\26" .. varint(#body) .. body
end

-- frame(msg) -> one uncompressed gRPC message frame.
function _M.frame(msg)
    local n = #msg
    return "\0" .. char(floor(n / 16777216) % 256, floor(n / 65536) % 256,
        floor(n / 256) % 256, n % 256) .. msg
end

-- unframe(data) -> the first message of a gRPC response body | nil, err.
function _M.unframe(data)
    if #data < 5 then
        return nil, "short gRPC frame"
    end
    local flag, b1, b2, b3, b4 = byte(data, 1, 5)
    if flag ~= 0 then
        return nil, "compressed gRPC frame"
    end
    local n = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
    if #data < 5 + n then
        return nil, "truncated gRPC frame"
    end
    return sub(data, 6, 5 + n)
end

-- fields(msg, into, names) -> into | nil, err. Decodes varint fields named by names
-- (field number -> name) and string fields into `into`; length-delimited fields whose
-- number maps to a function are decoded by that function. Unknown fields are skipped.
local function fields(msg, into, names)
    local i, n = 1, #msg
    while i <= n do
        local tag, ni = read_varint(msg, i)
        if not tag then
            return nil, "bad tag"
        end
        local num, wt = floor(tag / 8), tag % 8
        i = ni
        if wt == 0 then
            local v
            v, i = read_varint(msg, i)
            if not v then
                return nil, "bad varint"
            end
            local name = names[num]
            if type(name) == "string" then
                into[name] = v
            end
        elseif wt == 2 then
            local len
            len, i = read_varint(msg, i)
            if not len or i + len - 1 > n then
                return nil, "bad length"
            end
            local bytes = sub(msg, i, i + len - 1)
            i = i + len
            local name = names[num]
            if type(name) == "string" then
                into[name] = bytes
            elseif type(name) == "function" then
                local ok, err = name(into, bytes)
                if not ok then
                    return nil, err
                end
            end
        elseif wt == 1 then
            i = i + 8
        elseif wt == 5 then
            i = i + 4
        else
            return nil, "unsupported wire type " .. wt
        end
    end
    return into
end

local BREAKDOWN = { [1] = "system", [2] = "tools", [3] = "messages", [4] = "template_overhead" }

local REPLY = {
    [1] = "prompt_tokens", [2] = "max_model_len", [3] = "max_tokens_effective",
    [4] = "max_tokens_requested",
    [5] = function(into, bytes)
        local b, err = fields(bytes, { system = 0, tools = 0, messages = 0,
                                       template_overhead = 0 }, BREAKDOWN)
        into.breakdown = b
        return b, err
    end,
    [6] = "tokenizer_fingerprint", [7] = "tokenizer_backend", [8] = "prompt_count",
}

-- count_reply(msg) -> {prompt_tokens, max_model_len, max_tokens_effective,
-- max_tokens_requested, breakdown = {system, tools, messages, template_overhead},
-- tokenizer_fingerprint, tokenizer_backend, prompt_count} | nil, err.
-- Absent fields take proto3 defaults (0, "").
function _M.count_reply(msg)
    return fields(msg, {
        prompt_tokens = 0, max_model_len = 0, max_tokens_effective = 0,
        max_tokens_requested = 0, prompt_count = 0, tokenizer_fingerprint = "",
        tokenizer_backend = "",
        breakdown = { system = 0, tools = 0, messages = 0, template_overhead = 0 },
    }, REPLY)
end

return _M
