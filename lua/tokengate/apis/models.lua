-- OpenAI's model list (GET /v1/models) and model entry (GET /v1/models/{id}, the openai
-- client's models.retrieve): answered by the edge from the compiled configuration
-- (tokengate.models), never forwarded, never counted. The hooks: tokengate.api.

local errors = require "tokengate.errors"
local api = require "tokengate.api"
local reply = require "tokengate.reply"
local models = require "tokengate.models"

local sub = string.sub

local PREFIX = "/v1/models/"

local _M = {
    NAME = "models",
    ROUTES = { ["/v1/models"] = "models" },
    -- GET /v1/models/{id} (route())
    PREFIX = PREFIX,
    -- GET and HEAD (RFC 9110 §9.3.2: HEAD wherever GET; nginx sends a HEAD answer's
    -- headers only)
    ALLOW = { models = "GET, HEAD", model = "GET, HEAD" },
    NO_BODY = { models = true, model = true },
}

-- route(uri) -> "model", the id | nil: GET /v1/models/{id}
function _M.route(uri)
    if #uri > #PREFIX then
        return "model", sub(uri, #PREFIX + 1)
    end
    return nil
end

-- endpoint(route, uri) -> the usage event's endpoint: the path (a client's string: at
-- most 64 characters and "…", tokengate.errors.clip), as for any path no API counts.
function _M.endpoint(_, uri)
    return errors.clip(uri)
end

-- without_body(ctx, doc) -> nil, err (404) | never returns: the list of the models the
-- key may use, or one of them (ctx.model_id), answered here.
function _M.without_body(ctx, doc)
    if ctx.route == "models" then
        return reply.send(200, models.list(doc, ctx.key))
    end
    local text, err = models.retrieve(doc, ctx.key, ctx.model_id)
    if not text then
        return nil, err
    end
    return reply.send(200, text)
end

return api.define(_M)
