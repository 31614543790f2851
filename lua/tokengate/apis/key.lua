-- The calling key's quota (GET /v1/key): answered by the edge (tokengate.quota), never
-- forwarded, never counted against a window. The path is OpenRouter's (GET /api/v1/key
-- under its base URL), the one OpenAI-compatible clients and their users look for first;
-- OpenAI itself has none for API keys. The hooks: tokengate.api.

local api = require "tokengate.api"
local reply = require "tokengate.reply"
local quota = require "tokengate.quota"

local _M = {
    NAME = "key",
    ROUTES = { ["/v1/key"] = "key" },
    ALLOW = { key = "GET, HEAD" },
    NO_BODY = { key = true },
}

-- without_body(ctx, doc) -> never returns: the quota of ctx.key, answered here
function _M.without_body(ctx, doc)
    return reply.send(200, quota.document(doc, ctx.key, doc.global_limits.enabled == true))
end

return api.define(_M)
