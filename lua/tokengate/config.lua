-- The compiled configuration (tokengate.tools.compile_config): models, hashed keys, edge
-- settings. Loaded once in init_by_lua (the master, before workers fork) and again on
-- every `nginx -s reload`, which re-runs init in a new master generation; workers only
-- read it, so there is no cross-worker state here.

local cjson = require "cjson.safe"
local sampling = require "tokengate.sampling"

local io_open = io.open
local type = type
local tonumber = tonumber
local pairs = pairs
local setmetatable = setmetatable
local sort = table.sort

local _M = {}

local doc -- the loaded document (see the compile_config module docstring for its shape)
local models_text -- models_json() of doc
local rules -- sampling.rules() of doc.access_log

-- fail(msg) -> nil, "tokengate config: <msg>"
local function fail(msg)
    return nil, "tokengate config: " .. msg
end

-- load(path) -> doc | nil, err. path: the compiled JSON file. Validates the fields the
-- edge relies on so that a broken file fails `nginx -t`/reload instead of requests.
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
    if d.version ~= 1 or type(d.models) ~= "table" or type(d.keys) ~= "table"
        or type(d.edge) ~= "table" then
        return fail(path .. ": expected version 1 with models, keys and edge")
    end
    for name, m in pairs(d.models) do
        if type(m.max_model_len) ~= "number" or type(m.host) ~= "string"
            or type(m.port) ~= "number" then
            return fail(path .. ": models." .. name .. " incomplete")
        end
        if m.max_tokens_cap == cjson.null then
            m.max_tokens_cap = nil
        end
        if m.default_max_tokens == cjson.null then
            m.default_max_tokens = nil
        end
        if type(m.max_n) ~= "number" then
            m.max_n = 8 -- a file compiled before max_n existed
        end
        m.name = name
        local roles = {}
        for _, r in pairs(d.edge.special_token_roles or {}) do
            roles[r] = true
        end
        m.special_token_roles = roles
    end
    for digest, k in pairs(d.keys) do
        if type(k.rpm) ~= "number" or type(k.tpm) ~= "number" then
            return fail(path .. ": keys." .. digest .. " incomplete")
        end
        k.digest = digest
        if type(k.models) ~= "table" then
            k.models = {}
        end
    end
    -- sections added later than version 1's first edition: defaults when absent
    if type(d.global_limits) ~= "table" then
        d.global_limits = { enabled = false }
    end
    d.global_limits.enabled = d.global_limits.enabled == true
    d.edge.global_limits_timeout_ms = d.edge.global_limits_timeout_ms or 250
    d.edge.global_limits_backoff_ms = d.edge.global_limits_backoff_ms or 500
    local al = d.access_log
    if type(al) ~= "table" then
        al = { file = "" }
        d.access_log = al
    end
    if type(al.file) ~= "string" then
        al.file = ""
    end
    al.error_status = tonumber(al.error_status) or 400
    al.slow_ms = tonumber(al.slow_ms) or 5000
    al.slow_rate = tonumber(al.slow_rate) or 0.1
    al.rate = tonumber(al.rate) or 0.01
    doc = setmetatable(d, nil)
    models_text = nil
    rules = sampling.rules(al)
    return doc
end

-- models_json() -> JSON text of GET /v1/models: the configured models, sorted by name,
-- each {"id", "object": "model", "created": 0, "owned_by": "tokengate", "max_model_len"}.
-- Built once per loaded document.
function _M.models_json()
    if models_text then
        return models_text
    end
    local json = require "tokengate.json"
    local names = {}
    for name in pairs(doc.models) do
        names[#names + 1] = name
    end
    sort(names)
    local data = json.array()
    for i = 1, #names do
        local m = json.object()
        json.set(m, "id", names[i])
        json.set(m, "object", "model")
        json.set(m, "created", 0)
        json.set(m, "owned_by", "tokengate")
        json.set(m, "max_model_len", doc.models[names[i]].max_model_len)
        data[i] = m
    end
    local o = json.object()
    json.set(o, "object", "list")
    json.set(o, "data", data)
    models_text = json.encode(o)
    return models_text
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
