-- The Batch API at the edge: the batch service's calls on behalf of the keys whose
-- batches it runs, and the edge's own half of /v1/files and /v1/batches.
--
-- The batch service (tokengate-batch) presents a secret of its own, no API key: the one
-- whose digest is batch.worker_sha256. Its request names a key in X-Tokengate-Batch-Key
-- and is that key's request in everything (its models, limits, budgets, usage event,
-- bill) except its admission priority, batch.priority: batch lines are admitted only
-- where that (lowest) priority finds room. X-Tokengate-Batch-Line gives the line's
-- request id (32 hex, the same on every attempt of the line), so the ledger, which
-- applies each request id once, bills a line once however often a crash made the
-- service send it again. X-Tokengate-Batch-Check: 1 asks only for the checks and the
-- count an online request of the body would get (the batch's creation), answered after
-- the count stage; it is not billed and writes no usage event. The headers of any other
-- key are ignored.
--
-- /v1/files and /v1/batches (their own location of tokengate-location.conf) are the
-- service's: the edge reads the key as for every route (lockout, 401) and forwards with
-- X-Tokengate-Key set to the key's id; the service trusts that header because only the
-- edge reaches it: its unix socket (batch.unix_socket, mode 0660, nginx's group) or,
-- without one, loopback (batch.listen: any local user could name a key there).

local ngx = ngx
local json = require "tokengate.json"
local errors = require "tokengate.errors"
local auth = require "tokengate.auth"

local ngx_var = ngx.var
local find = string.find
local pairs, type, setmetatable = pairs, type, setmetatable

local _M = {}

local by_id_of = setmetatable({}, { __mode = "k" }) -- doc -> {key id -> key}

-- key_by_id(doc, id) -> the compiled key of that id, or nil
local function key_by_id(doc, id)
    local index = by_id_of[doc]
    if not index then
        index = {}
        for _, k in pairs(doc.keys) do
            index[k.id] = k
        end
        by_id_of[doc] = index
    end
    return index[id]
end

local UNKNOWN = errors.new(400, "X-Tokengate-Batch-Key names no configured key (deleted "
    .. "since the batch was created?).", nil, "batch_key_unknown")
local DISABLED = errors.new(400, "The batch's key is disabled or expired.", nil,
    "batch_key_disabled")
local BAD_LINE = errors.new(400, "X-Tokengate-Batch-Line must be 32 lowercase hex digits.",
    nil, "batch_line_invalid")

local NO_KEY = errors.new(400, "The batch service's requests must name a key "
    .. "(X-Tokengate-Batch-Key).", nil, "batch_key_missing")

-- act_for(ctx, doc, authorization) -> key | nil (not the batch service) | nil, err
-- (400): the key the batch service's request acts as: the X-Tokengate-Batch-Key key
-- with batch.priority's admission; ctx.batch = {id, custom_id, check} is set then, and
-- ctx.request_id is X-Tokengate-Batch-Line's id when given. authorization: the
-- Authorization header, whose bearer token is the service's when its digest is
-- batch.worker_sha256.
function _M.act_for(ctx, doc, authorization)
    local b = doc.batch
    local worker = b and b.worker_sha256
    if type(worker) ~= "string" then
        return nil
    end
    local token = auth.bearer(authorization)
    if not token or auth.digest(token) ~= worker then
        return nil
    end
    local target_id = ngx_var.http_x_tokengate_batch_key
    if not target_id then
        return nil, NO_KEY
    end
    local target = key_by_id(doc, target_id)
    if not target then
        return nil, UNKNOWN
    end
    if not auth.usable(target, ngx.time()) then
        return nil, DISABLED
    end
    local check = ngx_var.http_x_tokengate_batch_check == "1"
    ctx.batch = { id = ngx_var.http_x_tokengate_batch_id,
                  custom_id = ngx_var.http_x_tokengate_batch_custom_id, check = check }
    local line = ngx_var.http_x_tokengate_batch_line
    if line and not check then
        if #line ~= 32 or find(line, "[^0-9a-f]") then
            return nil, BAD_LINE
        end
        ctx.request_id = line
        ngx_var.tg_request_id = line
    end
    return setmetatable({ priority = b.priority,
                          admission = doc.edge.admission.priorities[b.priority] },
        { __index = target })
end

-- check_answer(ctx) -> JSON text of a check's answer: {"prompt_tokens", "max_tokens"
-- (the completion limit the request would be forwarded and reserved with, tokens; null
-- for a route that generates nothing), "model", "count_source"}.
function _M.check_answer(ctx)
    local o = json.object()
    json.set(o, "prompt_tokens", ctx.token_estimate or 0)
    json.set(o, "max_tokens", ctx.max_tokens_applied or json.null)
    json.set(o, "model", ctx.model or json.null)
    json.set(o, "count_source", ctx.count_source or json.null)
    return json.encode(o)
end

-- checking(ctx) -> true for a check (X-Tokengate-Batch-Check), which is answered after
-- the count and never billed.
function _M.checking(ctx)
    local b = ctx.batch
    return b ~= nil and b.check
end

-- event_fields(ctx) -> batch_id, custom_id of the usage event (nil, nil: not a line)
function _M.event_fields(ctx)
    local b = ctx.batch
    if not b then
        return nil, nil
    end
    return b.id, b.custom_id
end

-- ALLOW: the methods of the Batch API's paths together, what a browser's preflight is
-- answered (the batch service answers a method a path does not take with its 405).
_M.ALLOW = "GET, POST, DELETE"

-- files_access(ctx, doc, key): the access phase of /v1/files and /v1/batches once the
-- key is read: forwarded to the batch service with the key's id, on its unix socket
-- (batch.unix_socket; proxy_pass's "unix:<path>:" form) or else on batch.listen. A
-- gateway without the service (batch.enabled false) answers 404 in OpenAI's shape.
function _M.files_access(ctx, doc, key)
    local b = doc.batch
    if not b or not b.enabled then
        return nil, errors.new(404, "The Batch API is not enabled on this gateway "
            .. "(batch.enabled).", nil, "unknown_url")
    end
    ngx_var.tg_batch_key = key.id
    local sock = b.unix_socket
    ngx_var.tg_batch_upstream = type(sock) == "string" and "unix:" .. sock .. ":" or b.listen
    return true
end

return _M
