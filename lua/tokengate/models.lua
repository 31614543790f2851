-- GET /v1/models and GET /v1/models/{id}, answered by the edge from the compiled
-- configuration, in OpenAI's shapes (https://platform.openai.com/docs/api-reference/models):
--   list:  {"object": "list", "data": [<model>, ...]}   (sorted by id)
--   model: {"id", "object": "model", "created": 0, "owned_by": "tokengate",
--           "max_model_len": <tokens>}
-- An unknown id is 404 model_not_found, as OpenAI answers it.

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

local function build(doc)
    local names = {}
    for name in pairs(doc.models) do
        names[#names + 1] = name
    end
    sort(names)
    local data, by_id = json.array(), {}
    for i = 1, #names do
        local o = model_object(names[i], doc.models[names[i]])
        data[i] = o
        by_id[names[i]] = json.encode(o)
    end
    local list = json.object()
    json.set(list, "object", "list")
    json.set(list, "data", data)
    local b = { list = json.encode(list), by_id = by_id }
    built[doc] = b
    return b
end

-- list(doc) -> JSON text of the model list. doc: the compiled configuration.
function _M.list(doc)
    return (built[doc] or build(doc)).list
end

-- retrieve(doc, id) -> JSON text of one model | nil, err (404 model_not_found).
function _M.retrieve(doc, id)
    local text = (built[doc] or build(doc)).by_id[id]
    if not text then
        return errors.refuse(404, format("The model '%s' does not exist", errors.clip(id)),
            "model", "model_not_found")
    end
    return text
end

return _M
