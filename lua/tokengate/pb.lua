-- The protobuf messages the edge exchanges with its sidecars, encoded and decoded by hand:
-- tokengate.v1.TokenCounter (proto/tokengate/v1/counter.proto) and tokengate.v1.GlobalLimits
-- (proto/tokengate/v1/limits.proto: the windows and the budgets). Debian ships no Lua
-- protobuf library, and a few fixed messages need only varints and length-delimited
-- fields. gRPC framing (1 flag byte,
-- 4-byte big-endian length) is here too. Encoders omit fields equal to their proto3
-- default (0, false, ""), as the reference implementation does, so the bytes are the
-- same as Python's SerializeToString (tests/edge/test_edge_global.py checks them).
--
-- Numbers: varints are built with / and % by 128, exact for any integer-valued double,
-- so every integer a Lua number holds exactly (up to 2^53) is sent exactly, and so is
-- every double from 2^53 to 2^64 (all of them are integers); LuaJIT's bit ops are 32-bit
-- and are not used. The configuration bounds every limit and count to 1e12 and every
-- spend to 1e18 nano-units (tokengate.config, MAX_COUNT and MAX_AMOUNT), and
-- tokengate.budget caps a request's cost, so the integer fields receive 0 <= n < 2^64;
-- uint_field refuses anything else (NaN, an infinity, a fraction, a negative) with an
-- error naming the field, where string.char would fail on it ("bad argument #1 to
-- 'char'": an infinite cost_nano, from a price of .inf, reached varint once).

local byte, char, sub = string.byte, string.char, string.sub
local concat = table.concat
local floor = math.floor
local type, error, tostring = type, error, tostring

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

local TWO_49 = 2 ^ 49

-- read_varint(s, i) -> value, next index | nil (truncated or longer than 10 bytes).
-- value: the varint's integer exactly below 2^53, else the nearest double (ties to
-- even): the sum rounds once. Seven 7-bit groups (49 bits) add up exactly, and so do the
-- three groups above them (21 bits); low + high * 2^49 is one correctly rounded
-- addition, where summing every group in one double rounds the low 56 bits first.
local function read_varint(s, i)
    local v, mul = 0, 1
    for k = 0, 6 do
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
    -- 2^49 and above (8 to 10 bytes): spends in nano-units; counts (up to 1e12, below
    -- 2^40) end in the loop above
    local h, hmul = 0, 1
    for k = 7, 9 do
        local b = byte(s, i + k)
        if not b then
            return nil
        end
        if b < 128 then
            return v + (h + b * hmul) * TWO_49, i + k + 1
        end
        h = h + (b - 128) * hmul
        hmul = hmul * 128
    end
    return nil
end

-- count_request(model, endpoint, body) -> serialized CountRequest, in pieces: a list of
-- two strings whose concatenation is the message (fields 1 and 2 and the key and length
-- of field 3; then body itself, not copied: a cosocket sends a list of strings as they
-- are). model: served model name; endpoint: 1 chat, 2 completions; body: bytes.
function _M.count_request(model, endpoint, body)
    return { "\10" .. varint(#model) .. model .. "\16" .. varint(endpoint)
        .. "\26" .. varint(#body), body }
end

-- key_byte(num, wt) -> the field key (num * 8 + wire type): one byte, as every field
-- number here is below 16.
local function key_byte(num, wt)
    return char(num * 8 + wt)
end

-- str_field(num, s) -> length-delimited field bytes, "" for an empty string (default)
local function str_field(num, s)
    if s == "" then
        return ""
    end
    return key_byte(num, 2) .. varint(#s) .. s
end

local TWO_64 = 2 ^ 64

-- uint_field(num, n) -> varint field bytes, "" for 0 (default); n an integer,
-- 0 <= n < 2^64 (a uint64). Raises an error naming the field for any other value: a
-- caller's bug, never the request's (see the numbers note at the top).
local function uint_field(num, n)
    if n == 0 then
        return ""
    end
    -- false for NaN too (every comparison with it is)
    if not (type(n) == "number" and n > 0 and n < TWO_64 and floor(n) == n) then
        error("tokengate.pb: field " .. num .. ": " .. tostring(n)
            .. " is not an integer in 0..2^64-1", 2)
    end
    return key_byte(num, 0) .. varint(n)
end

-- bool_field(num, b) -> varint field bytes, "" for false (default)
local function bool_field(num, b)
    if not b then
        return ""
    end
    return key_byte(num, 0) .. "\1"
end

-- level_fields(num, levels, with_limits) -> the repeated LevelWindow field num of the
-- levels {id, rpm, tpm} (tokengate.limits: a key's team and organization with a
-- window; nil: none); with_limits false: their ids alone (a settlement's)
local function level_fields(num, levels, with_limits)
    if not levels then
        return ""
    end
    local out = {}
    for i = 1, #levels do
        local lv = levels[i]
        local m = str_field(1, lv.id)
        if with_limits then
            m = m .. uint_field(2, lv.rpm) .. uint_field(3, lv.tpm)
        end
        out[i] = key_byte(num, 2) .. varint(#m) .. m
    end
    return concat(out)
end

-- reserve_request(key_id, model, per_model, rpm, tpm, tokens, request_id, levels) ->
-- serialized tokengate.v1.ReserveRequest. key_id, model, request_id: strings;
-- per_model: boolean; rpm, tpm: limits per minute (>= 1); tokens: the reservation,
-- tokens; levels: the windows of the key's team and organization ({id, rpm, tpm}).
function _M.reserve_request(key_id, model, per_model, rpm, tpm, tokens, request_id, levels)
    return str_field(1, key_id) .. str_field(2, model) .. bool_field(3, per_model)
        .. uint_field(4, rpm) .. uint_field(5, tpm) .. uint_field(6, tokens)
        .. str_field(7, request_id) .. level_fields(8, levels, true)
end

-- settle_request(key_id, model, per_model, request_id, actual_tokens, levels) ->
-- serialized tokengate.v1.SettleRequest. actual_tokens: prompt + completion tokens
-- (>= 0); levels: as reserve_request's (their ids are sent).
function _M.settle_request(key_id, model, per_model, request_id, actual_tokens, levels)
    return str_field(1, key_id) .. str_field(2, model) .. bool_field(3, per_model)
        .. str_field(4, request_id) .. uint_field(5, actual_tokens)
        .. level_fields(6, levels, false)
end

-- budget_request(key_id, request_id, counters, cost_nano, tokens) -> serialized
-- tokengate.v1.BudgetReserveRequest, or BudgetSettleRequest (the same fields).
-- counters: list of {counter (name), spend_limit_nano, token_limit (0: none), ttl_s};
-- cost_nano: nano-units of the currency; tokens: tokens.
function _M.budget_request(key_id, request_id, counters, cost_nano, tokens)
    local out = { str_field(1, key_id), str_field(2, request_id) }
    for i = 1, #counters do
        local c = counters[i]
        local m = str_field(1, c.counter) .. uint_field(2, c.spend_limit_nano)
            .. uint_field(3, c.token_limit) .. uint_field(4, c.ttl_s)
        out[#out + 1] = key_byte(3, 2) .. varint(#m) .. m
    end
    out[#out + 1] = uint_field(4, cost_nano) .. uint_field(5, tokens)
    return concat(out)
end

-- frame(msg) -> frame, size: one uncompressed gRPC message frame as a list of pieces for
-- a cosocket's send (the 5-byte header, then msg: nothing is copied), and its size in
-- bytes. msg: the message bytes, a string or a list of strings (count_request's pieces).
function _M.frame(msg)
    local n
    if type(msg) == "table" then
        n = 0
        for i = 1, #msg do
            n = n + #msg[i]
        end
    else
        n = #msg
    end
    return { "\0" .. char(floor(n / 16777216) % 256, floor(n / 65536) % 256,
        floor(n / 256) % 256, n % 256), msg }, 5 + n
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
            if i > n + 1 then
                return nil, "bad fixed64"
            end
        elseif wt == 5 then
            i = i + 4
            if i > n + 1 then
                return nil, "bad fixed32"
            end
        else
            return nil, "unsupported wire type " .. wt
        end
    end
    return into
end

local BREAKDOWN = { [1] = "system", [2] = "tools", [3] = "messages", [4] = "template_overhead" }
local PREFIX_HIT = { [1] = "upstream", [2] = "cached_tokens" }

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
    [9] = "block_hashes", [10] = "block_size",
    [11] = function(into, bytes) -- repeated PrefixHit: one entry per occurrence
        local h, err = fields(bytes, { upstream = "", cached_tokens = 0 }, PREFIX_HIT)
        local hits = into.prefix_hits
        hits[#hits + 1] = h
        return h, err
    end,
}

-- count_reply(msg) -> {prompt_tokens, max_model_len, max_tokens_effective,
-- max_tokens_requested, breakdown = {system, tools, messages, template_overhead},
-- tokenizer_fingerprint, tokenizer_backend, prompt_count, block_hashes (bytes: 8 per
-- full block, prompt order), block_size (tokens), prefix_hits = {{upstream ("host:port"),
-- cached_tokens (tokens)}, ...} (in the reply's order)} | nil, err.
-- Absent fields take proto3 defaults (0, "", an empty list).
function _M.count_reply(msg)
    return fields(msg, {
        prompt_tokens = 0, max_model_len = 0, max_tokens_effective = 0,
        max_tokens_requested = 0, prompt_count = 0, tokenizer_fingerprint = "",
        tokenizer_backend = "", block_hashes = "", block_size = 0, prefix_hits = {},
        breakdown = { system = 0, tools = 0, messages = 0, template_overhead = 0 },
    }, REPLY)
end

local RESERVE_REPLY = {
    [1] = "admitted", [2] = "limited_by", [3] = "never_fits", [4] = "remaining_requests",
    [5] = "remaining_tokens", [6] = "reset_requests_ms", [7] = "reset_tokens_ms",
    [8] = "retry_after_ms", [9] = "level",
}

-- reserve_reply(msg) -> {admitted (bool), limited_by (0 none, 1 requests, 2 tokens),
-- never_fits (bool), remaining_requests, remaining_tokens (tokens), reset_requests_ms,
-- reset_tokens_ms, retry_after_ms (ms), level (0: the key's window, i: levels[i])} |
-- nil, err. Absent fields take proto3 defaults.
function _M.reserve_reply(msg)
    local r, err = fields(msg, {
        admitted = 0, limited_by = 0, never_fits = 0, remaining_requests = 0,
        remaining_tokens = 0, reset_requests_ms = 0, reset_tokens_ms = 0, retry_after_ms = 0,
        level = 0,
    }, RESERVE_REPLY)
    if not r then
        return nil, err
    end
    r.admitted, r.never_fits = r.admitted ~= 0, r.never_fits ~= 0
    return r
end

local SETTLE_REPLY = { [1] = "found", [2] = "delta", [3] = "window_tokens" }

-- settle_reply(msg) -> {found (bool), delta (tokens, signed: sint64 zigzag decoded),
-- window_tokens (tokens)} | nil, err.
function _M.settle_reply(msg)
    local r, err = fields(msg, { found = 0, delta = 0, window_tokens = 0 }, SETTLE_REPLY)
    if not r then
        return nil, err
    end
    -- zigzag: 2n for n >= 0, -2n - 1 for n < 0 (exact: |delta| stays far below 2^52)
    local z = r.delta
    if z % 2 == 0 then
        r.delta = z / 2
    else
        r.delta = -(z + 1) / 2
    end
    r.found = r.found ~= 0
    return r
end

local BUDGET_USAGE = { [1] = "spent_nano", [2] = "tokens" }

local BUDGET_RESERVE_REPLY = {
    [1] = "admitted", [2] = "refused", [3] = "limited_by",
    [4] = function(into, bytes)
        local u, err = fields(bytes, { spent_nano = 0, tokens = 0 }, BUDGET_USAGE)
        into.usage[#into.usage + 1] = u
        return u, err
    end,
}

-- budget_reserve_reply(msg) -> {admitted (bool), refused (1-based counter index, 0
-- admitted), limited_by (0 none, 1 spend, 2 tokens), usage = {{spent_nano, tokens},
-- ...} (one per counter)} | nil, err.
function _M.budget_reserve_reply(msg)
    local r, err = fields(msg, { admitted = 0, refused = 0, limited_by = 0, usage = {} },
        BUDGET_RESERVE_REPLY)
    if not r then
        return nil, err
    end
    r.admitted = r.admitted ~= 0
    return r
end

-- quota_request(key_id, levels, counters) -> serialized tokengate.v1.QuotaRequest.
-- levels: the key's team's and organization's windows ({id}); counters: {counter}
-- (names as budget_request sends them).
function _M.quota_request(key_id, levels, counters)
    local out = { str_field(1, key_id), level_fields(2, levels, false) }
    for i = 1, #counters do
        local m = str_field(1, counters[i].counter)
        out[#out + 1] = key_byte(3, 2) .. varint(#m) .. m
    end
    return concat(out)
end

local WINDOW_USAGE = { [1] = "requests", [2] = "tokens", [3] = "reset_ms" }
local COUNTER_USAGE = { [1] = "spent_nano", [2] = "tokens", [3] = "reserved_nano",
                        [4] = "reserved_tokens" }
local QUOTA_REPLY = {
    [1] = function(into, bytes)
        local w, err = fields(bytes, { requests = 0, tokens = 0, reset_ms = 0 },
            WINDOW_USAGE)
        into.windows[#into.windows + 1] = w
        return w, err
    end,
    [2] = function(into, bytes)
        local c, err = fields(bytes, { spent_nano = 0, tokens = 0, reserved_nano = 0,
                                       reserved_tokens = 0 }, COUNTER_USAGE)
        into.counters[#into.counters + 1] = c
        return c, err
    end,
}

-- quota_reply(msg) -> {windows = {{requests, tokens, reset_ms}, ...} (the key's, then
-- each level's), counters = {{spent_nano, tokens, reserved_nano, reserved_tokens},
-- ...}} | nil, err.
function _M.quota_reply(msg)
    return fields(msg, { windows = {}, counters = {} }, QUOTA_REPLY)
end

local BUDGET_SETTLE_REPLY = { [1] = "applied", [2] = "reserved" }

-- budget_settle_reply(msg) -> {applied (bool), reserved (bool)} | nil, err.
function _M.budget_settle_reply(msg)
    local r, err = fields(msg, { applied = 0, reserved = 0 }, BUDGET_SETTLE_REPLY)
    if not r then
        return nil, err
    end
    r.applied, r.reserved = r.applied ~= 0, r.reserved ~= 0
    return r
end

return _M
