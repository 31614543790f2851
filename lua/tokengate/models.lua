-- GET /v1/models and GET /v1/models/{id}, answered by the edge from the compiled
-- configuration, in OpenAI's shapes (https://platform.openai.com/docs/api-reference/models):
--   list:  {"object": "list", "data": [<model>, ...]}   (sorted by id)
--   model: {"id", "object": "model", "created": 0, "owned_by": "tokengate",
--           "max_model_len": <tokens>}
-- A key with allowed_models sees only those. An unknown id, and a model the key may not
-- use, is 404 model_not_found with OpenAI's message for both (so a key cannot tell a
-- model it may not use from one that does not exist).

local json = require "tokengate.json"
local errors = require "tokengate.errors"

local pairs = pairs
local sort = table.sort
local format = string.format
local setmetatable = setmetatable

local _M = {}

-- compiled document -> {list = text, by_id = {id -> text}}; a reload loads a new
-- document, so answers are built once per configuration
local built = setmetatable({}, { __mode = "k" })

local function model_object(id, m)
    local o = json.object()
    json.set(o, "id", id)
    json.set(o, "object", "model")
    json.set(o, "created", 0)
    json.set(o, "owned_by", "tokengate")
    json.set(o, "max_model_len", m.max_model_len)
    return o
end

-- names(doc, key) -> the model names the key may use, sorted
local function names(doc, key)
    local out = {}
    for name in pairs(doc.models) do
        if not key.allowed or key.allowed[name] then
            out[#out + 1] = name
        end
    end
    sort(out)
    return out
end

-- build(doc, key) -> {list = text, by_id = {id -> text}} of what the key sees
local function build(doc, key)
    local ids = names(doc, key)
    local data, by_id = json.array(), {}
    for i = 1, #ids do
        local o = model_object(ids[i], doc.models[ids[i]])
        data[i] = o
        by_id[ids[i]] = json.encode(o)
    end
    local list = json.object()
    json.set(list, "object", "list")
    json.set(list, "data", data)
    return { list = json.encode(list), by_id = by_id }
end

-- seen(doc, key) -> build(doc, key), built once per configuration and key
local function seen(doc, key)
    local per_key = built[doc]
    if not per_key then
        per_key = {}
        built[doc] = per_key
    end
    local b = per_key[key]
    if not b then
        b = build(doc, key)
        per_key[key] = b
    end
    return b
end

-- not_found(id) -> nil, err: 404 model_not_found, OpenAI's answer to a model that does
-- not exist or that the key may not use. id: the requested model name (clipped).
function _M.not_found(id)
    return errors.refuse(404, format("The model `%s` does not exist or you do not have "
        .. "access to it.", errors.clip(id)), "model", "model_not_found")
end

-- serves(model, runner, uri) -> true | nil, err (400 model_not_supported): whether the
-- compiled model takes a request of a route served by vLLM's runner `runner`
-- ("generate" | "pooling": the API module's RUNNER, tokengate.api) at path uri. vLLM itself answers
-- 404 {"detail": "Not Found"} there (a pooling server registers /v1/embeddings and no
-- generating route, a generating server the other way round): the edge answers first,
-- in OpenAI's shape and naming the model, and forwards nothing.
function _M.serves(model, runner, uri)
    local has = model.runner or "generate"
    if has == runner then
        return true
    end
    local name = errors.clip(model.name)
    local msg
    if has == "pooling" then
        msg = format("The model `%s` is an embedding model (runner: pooling): it serves "
            .. "POST /v1/embeddings only, not %s.", name, errors.clip(uri))
    else
        msg = format("The model `%s` generates text (runner: generate) and does not serve "
            .. "%s: use an embedding model (runner: pooling).", name, errors.clip(uri))
    end
    return errors.refuse(400, msg, "model", "model_not_supported")
end

-- allowed(key, name) -> true when the key may use the served model name
function _M.allowed(key, name)
    return not key.allowed or key.allowed[name] == true
end

-- list(doc, key) -> JSON text of the models the key may use. doc: the compiled
-- configuration; key: the compiled key.
function _M.list(doc, key)
    return seen(doc, key).list
end

-- retrieve(doc, key, id) -> JSON text of one model | nil, err (404 model_not_found).
function _M.retrieve(doc, key, id)
    local text = seen(doc, key).by_id[id]
    if not text then
        return _M.not_found(id)
    end
    return text
end

return _M
