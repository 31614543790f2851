-- Every error the edge answers, in OpenAI's shape (DESIGN.md §2.5):
--   {"error": {"message": "...", "type": "...", "param": "..." | null, "code": "..." | null}}
-- The one place that writes an error body; the phases module calls exit() and returns.

local ngx = ngx
local json = require "tokengate.json"

local ngx_print = ngx.print
local pairs = pairs
local ngx_exit = ngx.exit
local null = json.null
local encode = json.encode
local object = json.object
local set = json.set

local _M = {}

-- body(message, type, param, code) -> JSON text of one OpenAI error object.
-- message: string; type: string (e.g. "invalid_request_error", "tokens"); param: field
-- path string or nil; code: string or nil.
function _M.body(message, etype, param, code)
    local e = object()
    set(e, "message", message)
    set(e, "type", etype)
    set(e, "param", param or null)
    set(e, "code", code or null)
    local doc = object()
    set(doc, "error", e)
    return encode(doc)
end

-- exit(ctx, status, message, type, param, code, extra_headers) -> never returns normally;
-- ends the request from the access (or content) phase with an OpenAI-shaped error.
-- ctx.error records the code (or type) for the usage event. extra_headers: table of
-- response headers (Retry-After ...) or nil. Response headers common to every answer
-- (x-ratelimit-*, X-Token-Count) are added by the header filter from ctx.
function _M.exit(ctx, status, message, etype, param, code, extra_headers)
    ctx.error = code or etype
    ctx.edge_answered = true
    local body = _M.body(message, etype, param, code)
    ngx.status = status
    local h = ngx.header
    h["Content-Type"] = "application/json"
    h["Content-Length"] = #body
    if extra_headers then
        for k, v in pairs(extra_headers) do
            h[k] = v
        end
    end
    ngx_print(body)
    return ngx_exit(status)
end

-- new(status, message, param, code, type, headers) -> err: the error shape every concern
-- module returns, {status, message, param, code, type, headers}. type defaults to
-- "server_error" for 5xx, "invalid_request_error" otherwise.
function _M.new(status, message, param, code, etype, headers)
    return { status = status, message = message, param = param, code = code,
             type = etype, headers = headers }
end

-- fail(ctx, err) -> ends the request with err (see new()); returns like exit().
function _M.fail(ctx, err)
    local etype = err.type or (err.status >= 500 and "server_error" or "invalid_request_error")
    return _M.exit(ctx, err.status, err.message, etype, err.param, err.code, err.headers)
end

return _M
