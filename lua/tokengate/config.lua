-- The compiled configuration (tokengate.tools.compile_config): models, hashed keys, edge
-- settings. Loaded once in init_by_lua (the master, before workers fork) and again on
-- every `nginx -s reload`, which re-runs init in a new master generation; workers only
-- read it, so there is no cross-worker state here.

local cjson = require "cjson.safe"
local sampling = require "tokengate.sampling"
local cors = require "tokengate.cors"

local io_open = io.open
local type, tostring, pairs, ipairs, setmetatable = type, tostring, pairs, ipairs, setmetatable
local sort = table.sort
local find = string.find
local floor, huge = math.floor, math.huge

local _M = {}

local VERSION = 14 -- tokengate.tools.compile_config.VERSION

local doc -- the loaded document (see the compile_config module docstring for its shape)
local rules -- sampling.rules() of doc.access_log

-- fail(msg) -> nil, "tokengate config: <msg>"
local function fail(msg)
    return nil, "tokengate config: " .. msg
end

-- SECTIONS: the tables every compiled document has. Defaults are filled in by the schema
-- (tokengate.config) before the document is written, so nothing here fills any in.
local SECTIONS = { "models", "keys", "edge", "global_limits", "access_log", "tracing" }

-- The message roles of tokengate.config.Role.
local ROLES = { "system", "developer", "user", "assistant", "tool", "function" }

-- The fields of a model and of a key that JSON null leaves unset (null reads as
-- cjson.null, which is truthy): a model's max_tokens_cap and default_max_tokens (no cap,
-- no default); a key's expires_at (never), max_tokens_cap and cached_tokens_weight (the
-- model's: tokengate.output.cap_of, tokengate.limits).
local MODEL_NULLABLE = { "max_tokens_cap", "default_max_tokens" }
local KEY_NULLABLE = { "expires_at", "max_tokens_cap", "cached_tokens_weight" }

-- unset_nulls(t, fields): each of fields that holds JSON null, nil
local function unset_nulls(t, fields)
    for i = 1, #fields do
        if t[fields[i]] == cjson.null then
            t[fields[i]] = nil
        end
    end
end

-- token_list(a, b) -> the strings of both arrays, longest first (of two tokens found at
-- the same byte the longer wins; a strip pass removes a token before any prefix of it);
-- .anchor = "<" when every token holds one, so text without "<" is skipped unscanned.
local function token_list(a, b)
    local list, seen = {}, {}
    for _, src in ipairs({ a, b }) do
        for _, t in ipairs(src) do
            if not seen[t] then
                seen[t] = true
                list[#list + 1] = t
            end
        end
    end
    sort(list, function(x, y)
        if #x ~= #y then
            return #x > #y
        end
        return x < y
    end)
    local anchor = "<"
    for _, t in ipairs(list) do
        if not find(t, "<", 1, true) then
            anchor = nil
        end
    end
    list.anchor = anchor
    return list
end

-- not_finite(v, path) -> the dotted path of the first number in v that is NaN or
-- infinite, nil when there is none. cjson reads Infinity, NaN and 1e400 as such numbers;
-- the schema refuses them and compile_config never writes them (allow_nan=False), and a
-- hand-edited file must not hand one to the budgets' arithmetic either (an infinite
-- price once left NaN in a shared-dict counter, where it stayed after the fix).
local function not_finite(v, path)
    if type(v) == "number" then
        if v ~= v or v == huge or v == -huge then
            return path
        end
    elseif type(v) == "table" then
        for k, x in pairs(v) do
            local p = not_finite(x, path and path .. "." .. tostring(k) or tostring(k))
            if p then
                return p
            end
        end
    end
    return nil
end

-- budgets(list): a compiled budget list (a key's, a team's) made ready for
-- tokengate.budget: nulls as nil, spend also in whole nano-units of the currency
local function budgets(list)
    for _, b in ipairs(list) do
        b.model = b.model ~= cjson.null and b.model or nil
        b.tokens = b.tokens ~= cjson.null and b.tokens or nil
        b.spend = b.spend ~= cjson.null and b.spend or nil
        b.spend_nano = b.spend and floor(b.spend * 1e9 + 0.5) or nil
    end
end

-- load(path) -> doc | nil, err. path: the compiled JSON file. Checks the version, the
-- sections and that every number is finite, so that a stale or broken file fails
-- `nginx -t`/reload instead of requests.
function _M.load(path)
    local f, err = io_open(path, "rb")
    if not f then
        return fail(err)
    end
    local text = f:read("*a")
    f:close()
    local d, derr = cjson.decode(text)
    if type(d) ~= "table" then
        return fail(path .. ": " .. (derr or "not a JSON object"))
    end
    if d.version ~= VERSION then
        return fail(path .. ": version " .. tostring(d.version) .. ", expected " .. VERSION
            .. ": compile it again with this tokengate (tokengate.tools.compile_config)")
    end
    for i = 1, #SECTIONS do
        if type(d[SECTIONS[i]]) ~= "table" then
            return fail(path .. ": no " .. SECTIONS[i] .. " section: compile it again with "
                .. "this tokengate (tokengate.tools.compile_config)")
        end
    end
    local bad = not_finite(d)
    if bad then
        return fail(path .. ": " .. bad .. " is not a finite number: compile it again "
            .. "(tokengate config check names what the schema refuses)")
    end
    local edge = d.edge
    local special_roles, structural_roles = {}, {}
    for _, r in ipairs(edge.special_token_roles) do
        special_roles[r] = true
    end
    for _, r in ipairs(edge.structural_token_roles) do
        structural_roles[r] = true
    end
    local allowed = {}
    for _, k in ipairs(edge.chat_template_kwargs_allowed) do
        allowed[k] = true
    end
    edge.template_kwargs_allowed = allowed
    cors.compile(edge.cors)
    for name, m in pairs(d.models) do
        unset_nulls(m, MODEL_NULLABLE)
        m.name = name
        m.special_token_roles = special_roles
        m.structural_set = {}
        for _, t in ipairs(m.structural_tokens) do
            m.structural_set[t] = true
        end
        m.all_tokens = token_list(m.special_tokens, m.structural_tokens)
        m.role_tokens = {}
        for _, r in ipairs(ROLES) do
            local list = token_list(special_roles[r] and m.special_tokens or {},
                structural_roles[r] and m.structural_tokens or {})
            m.role_tokens[r] = #list > 0 and list or nil
        end
    end
    local priorities = edge.admission.priorities
    d.keys_by_id = {}
    -- digest of a rotated key's old secret -> {key = the key, expires_at = epoch s}:
    -- kept apart from d.keys so that whatever walks the keys sees each key once
    d.previous_keys = {}
    for digest, k in pairs(d.keys) do
        k.digest = digest
        d.keys_by_id[k.id] = k
        unset_nulls(k, KEY_NULLABLE)
        for _, p in ipairs(k.previous or {}) do
            d.previous_keys[p.sha256] = { key = k, expires_at = p.expires_at }
        end
        budgets(k.budgets)
        -- the key's team, then its organization: each a window (rpm and tpm, or
        -- neither) and budgets pooled over their members (tokengate.limits)
        k.windows = {} -- the levels with a window, in order
        for _, lv in ipairs(k.levels) do
            budgets(lv.budgets)
            if lv.rpm == cjson.null then
                lv.rpm, lv.tpm = nil, nil
            else
                k.windows[#k.windows + 1] = lv
            end
        end
        -- null: every model; else the set of names the key may use
        if k.allowed_models ~= cjson.null then
            k.allowed = {}
            for _, name in ipairs(k.allowed_models) do
                k.allowed[name] = true
            end
        end
        -- the schema checked that the name is configured
        k.admission = priorities[k.priority]
    end
    doc = setmetatable(d, nil)
    rules = sampling.rules(d.access_log)
    return doc
end

-- rules() -> the access log's sampling rules (tokengate.sampling.rules of access_log).
function _M.rules()
    return rules
end

-- get() -> the loaded document (nil before load()).
function _M.get()
    return doc
end

return _M
