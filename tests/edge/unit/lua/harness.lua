-- The runner of the edge's Lua unit tests, inside nginx's own LuaJIT (init_by_lua of one
-- nginx process, started by tests/edge/unit/lua_runner.py; nothing of the stack runs).
--
-- A spec file is a chunk called with the harness table t; it declares its cases in order:
--     local t = ...
--     t.case("decode keeps the key order", function() t.eq(got, want) end)
--     t.case("...", fn, { xfail = "the bug, precisely" })   -- pytest: strict xfail
-- Every case starts with the test shared dicts empty. After a spec's cases, one more case
-- of its own checks that loading and running it wrote no global variable.
-- Results: one JSON array in the result file, one object per case, in order:
--     {spec, name, status = "pass" | "fail", message, xfail (reason or null), ms}
-- Messages are ASCII: every byte outside printable ASCII is written as \xNN.

local cjson = require "cjson" -- not tokengate.json: the harness must not use what it tests

local type = type
local pairs = pairs
local tostring = tostring
local getmetatable = getmetatable
local format = string.format
local byte = string.byte
local gsub = string.gsub
local find = string.find
local concat = table.concat
local sort = table.sort
local huge = math.huge
local floor = math.floor
local debug_getinfo = debug.getinfo
local traceback = debug.traceback

local t = {}

-- repr(v) -> a one-line, ASCII, deterministic rendering of v: strings quoted with every
-- byte outside printable ASCII as \xNN, numbers as the shortest text that reads back
-- (integers whole, "-0", "nan", "inf"), tables as name{k=v, ...} with keys sorted and the
-- metatable's __name in front.
local repr

local function repr_number(v)
    if v ~= v then
        return "nan"
    elseif v == huge then
        return "inf"
    elseif v == -huge then
        return "-inf"
    elseif v == 0 and 1 / v < 0 then
        return "-0"
    elseif v == floor(v) and v > -2 ^ 63 and v < 2 ^ 63 then
        return format("%.0f", v)
    end
    for p = 15, 17 do
        local s = format("%." .. p .. "g", v)
        if tonumber(s) == v then
            return s
        end
    end
    return format("%.17g", v)
end

local ESCAPED = { ['"'] = '\\"', ["\\"] = "\\\\" }

local function repr_string(s)
    return '"' .. gsub(s, '[%z\1-\31"\\\127-\255]', function(c)
        return ESCAPED[c] or format("\\x%02X", byte(c))
    end) .. '"'
end

repr = function(v, seen)
    local tv = type(v)
    if tv == "string" then
        return repr_string(v)
    elseif tv == "number" then
        return repr_number(v)
    elseif tv ~= "table" then
        return tostring(v)
    end
    seen = seen or {}
    if seen[v] then
        return "<cycle>"
    end
    seen[v] = true
    local mt = getmetatable(v)
    local name = type(mt) == "table" and type(mt.__name) == "string" and mt.__name or ""
    local parts = {}
    for k, x in pairs(v) do
        local rk = type(k) == "string" and find(k, "^[%a_][%w_]*$") and k
            or "[" .. repr(k, seen) .. "]"
        parts[#parts + 1] = rk .. "=" .. repr(x, seen)
    end
    sort(parts)
    seen[v] = nil
    return name .. "{" .. concat(parts, ", ") .. "}"
end
t.repr = repr

-- same(a, b) -> true when a and b are equal values: numbers equal, with NaN equal to NaN
-- and -0 apart from 0; strings byte for byte; tables with the same metatable and the same
-- pairs, compared deeply (keys that are tables compared by identity).
local function same(a, b)
    local ta = type(a)
    if ta ~= type(b) then
        return false
    end
    if ta == "number" then
        if a ~= a then
            return b ~= b
        end
        return a == b and (a ~= 0 or 1 / a == 1 / b)
    end
    if ta ~= "table" or a == b then
        return a == b
    end
    if getmetatable(a) ~= getmetatable(b) then
        return false
    end
    for k, x in pairs(a) do
        if not same(x, b[k]) then
            return false
        end
    end
    for k in pairs(b) do
        if a[k] == nil then
            return false
        end
    end
    return true
end
t.same = same

-- where() -> "json_spec.lua:12 < json_spec.lua:40": the spec lines on the stack, innermost
-- first (a failing assertion inside a spec's helper names both lines)
local function where()
    local lines = {}
    for level = 3, 40 do
        local info = debug_getinfo(level, "Sl")
        if not info then
            break
        end
        if find(info.short_src, "_spec%.lua$") then
            lines[#lines + 1] = info.short_src .. ":" .. info.currentline
        end
    end
    return concat(lines, " < ")
end

-- fail(msg): ends the case as failed with msg (and where it failed)
local function fail(msg)
    error({ assertion = true, message = where() .. ": " .. msg }, 0)
end
t.fail = fail

-- eq(got, want, what): got must be the same value as want (see same)
function t.eq(got, want, what)
    if not same(got, want) then
        fail(format("%s\n  got:  %s\n  want: %s", what or "value", repr(got), repr(want)))
    end
end

-- ok(cond, what): cond must be true (exactly true: a value that is merely truthy fails)
function t.ok(cond, what)
    if cond ~= true then
        fail(format("%s: got %s, want true", what or "condition", repr(cond)))
    end
end

-- raises(fn, want): fn() must raise an error whose text, from its first occurrence of
-- the start of want on (file and line prefixes cut), is exactly want
function t.raises(fn, want, what)
    local ok, err = pcall(fn)
    if ok then
        fail(format("%s: raised nothing, want the error %s", what or "call", repr(want)))
    end
    err = tostring(err)
    local at = find(err, want, 1, true)
    local got = at and err:sub(at) or err
    if got ~= want then
        fail(format("%s: raised %s, want %s", what or "call", repr(err), repr(want)))
    end
end

-- validated(body, entry, err) -> "ok" and body when an API module's validate admitted
-- body (entry: its model entry), else the refusal's {status, code, param}: the outcome
-- the API specs compare, as validated(body, api.validate(route, body, models, edge))
function t.validated(body, entry, err)
    if entry then
        return "ok", body
    end
    return { err.status, err.code, err.param }
end

-- unhex("0a01") -> the bytes; hex(bytes) -> lowercase hex
function t.unhex(h)
    return (gsub(h, "%x%x", function(x) return string.char(tonumber(x, 16)) end))
end

function t.hex(s)
    return (gsub(s, ".", function(c) return format("%02x", byte(c)) end))
end

-- run(spec_dir, specs, result_path, dicts): runs every spec of the list (names without
-- "_spec.lua") and writes the result file. dicts: the shared dicts to empty before each
-- case. Never raises: a spec that does not load is one failed case "loads".
local function run(spec_dir, specs, result_path, dicts)
    local results = {}
    local function record(spec, name, ok, message, xfail, ms)
        results[#results + 1] = { spec = spec, name = name, status = ok and "pass" or "fail",
                                  message = message or "", xfail = xfail or cjson.null,
                                  ms = ms }
    end
    local function handler(e)
        if type(e) == "table" and e.assertion then
            return e.message
        end
        return traceback(tostring(e), 2)
    end
    for s = 1, #specs do
        local spec = specs[s]
        local before = {}
        for k in pairs(_G) do
            before[k] = true
        end
        local cases, names = {}, {}
        t.case = function(name, fn, opts)
            if names[name] then
                error("two cases named " .. repr(name), 2)
            end
            names[name] = true
            cases[#cases + 1] = { name = name, fn = fn, xfail = opts and opts.xfail }
        end
        local file = io.open(spec_dir .. "/" .. spec .. "_spec.lua", "rb")
        local text = file and file:read("*a")
        if file then
            file:close()
        end
        local chunk, err = nil, "no such spec file"
        if text then
            chunk, err = loadstring(text, "@" .. spec .. "_spec.lua")
        end
        local loaded = chunk and xpcall(function() chunk(t) end, function(e)
            err = handler(e)
        end)
        if not loaded then
            record(spec, "loads", false, err, nil, 0)
        end
        for c = 1, loaded and #cases or 0 do
            local case = cases[c]
            for d = 1, #dicts do
                ngx.shared[dicts[d]]:flush_all()
            end
            ngx.update_time()
            local t0 = ngx.now()
            local ok, msg = xpcall(case.fn, handler)
            ngx.update_time()
            record(spec, case.name, ok, msg, case.xfail, (ngx.now() - t0) * 1000)
        end
        local leaked = {}
        for k in pairs(_G) do
            if not before[k] then
                leaked[#leaked + 1] = tostring(k)
            end
        end
        sort(leaked)
        record(spec, "writes no global variable", #leaked == 0,
            #leaked > 0 and ("globals written: " .. concat(leaked, ", ")) or nil, nil, 0)
    end
    local out = assert(io.open(result_path, "wb"))
    out:write(cjson.encode(results))
    out:close()
end

return run
