-- Every error the edge answers, in OpenAI's shape:
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
local sub = string.sub
local byte = string.byte

local _M = {}

local ECHO_CHARS = 64 -- characters of a client string an answer or the usage event repeats
local MAX_MESSAGE = 1024 -- bytes: the longest message / param an error body carries

-- clip(s, chars) -> s when it has at most `chars` UTF-8 characters (default ECHO_CHARS),
-- else its first `chars` characters followed by "…". Client strings (model names, paths,
-- keys) are echoed only through it: a 1 MB model name must not come back 1 MB long or
-- reach the usage event. s must be valid UTF-8 up to the cut (decoded JSON is; a byte
-- string that is not is cut at the byte count instead).
function _M.clip(s, chars)
    chars = chars or ECHO_CHARS
    if #s <= chars then
        return s
    end
    local i, n, len = 1, 0, #s
    while i <= len and n < chars do
        local b = byte(s, i)
        i = i + (b < 0x80 and 1 or b < 0xE0 and 2 or b < 0xF0 and 3 or 4)
        n = n + 1
    end
    if i > len then
        return s
    end
    return sub(s, 1, i - 1) .. "…"
end

-- cap(s) -> s cut to MAX_MESSAGE bytes (at a character boundary) with "…": the safety
-- net under every error body, whatever a module echoed.
local function cap(s)
    if #s <= MAX_MESSAGE then
        return s
    end
    local i = MAX_MESSAGE + 1
    while i > 1 and byte(s, i) >= 0x80 and byte(s, i) < 0xC0 do
        i = i - 1 -- back to the lead byte of the character cut in two
    end
    return sub(s, 1, i - 1) .. "…"
end

-- body(message, type, param, code) -> JSON text of one OpenAI error object.
-- message: string; type: string (e.g. "invalid_request_error", "tokens"); param: field
-- path string or nil; code: string or nil. message and param are cut to 1024 bytes.
function _M.body(message, etype, param, code)
    local e = object()
    set(e, "message", cap(message))
    set(e, "type", etype)
    set(e, "param", param and cap(param) or null)
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
