-- Every error the edge answers, in OpenAI's shape:
--   {"error": {"message": "...", "type": "...", "param": "..." | null, "code": "..." | null}}
-- or, for the routes of another API module, in that API's (render: tokengate.api's
-- error_body).
--
-- One error kind: concern modules return `nil, err` with err made by new() (or
-- `return refuse(...)`), and the phases module ends the request with send(ctx, err).
-- body() is the one place that writes an error body's JSON.

local ngx = ngx
local json = require "tokengate.json"
local cjson = require "cjson.safe"
local reply = require "tokengate.reply"

local ngx_exit, HTTP_OK = ngx.exit, ngx.HTTP_OK
local null, encode, object, set = json.null, json.encode, json.object, json.set
local sub, byte, format, match = string.sub, string.byte, string.format, string.match
local type = type

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

_M.cap = cap

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

-- new(status, message, param, code, type, headers) -> err: the error every concern
-- module returns, {status, message, param, code, type, headers}. status: HTTP status;
-- param: field path or nil; code: short error code or nil; type defaults to
-- "server_error" for 5xx, "invalid_request_error" otherwise; headers: extra response
-- headers (Retry-After ...) or nil.
function _M.new(status, message, param, code, etype, headers)
    return { status = status, message = message, param = param, code = code,
             type = etype or (status >= 500 and "server_error" or "invalid_request_error"),
             headers = headers }
end

-- refuse(...) -> nil, new(...): for `return errors.refuse(400, "...", param, code)`.
function _M.refuse(status, message, param, code, etype, headers)
    return nil, _M.new(status, message, param, code, etype, headers)
end

-- render(ctx, err) -> JSON text of err in the shape of the request's API: ctx.api's
-- error_body (tokengate.api), or OpenAI's before a request has an API module.
function _M.render(ctx, err)
    local api = ctx.api
    if api then
        return api.error_body(err)
    end
    return _M.body(err.message, err.type, err.param, err.code)
end

-- send(ctx, err) -> never returns normally: ends the request (access or content phase)
-- with err as an answer in its API's shape (render). ctx.error records the code (or type) for the
-- usage event. Headers common to every answer (x-ratelimit-*, X-Token-Count) are added
-- by the header filter from ctx.
function _M.send(ctx, err)
    ctx.error = err.code or err.type
    reply.write(err.status, _M.render(ctx, err), err.headers)
    -- nginx terminates a request finalized with 408 without sending what was printed
    -- (it takes 408 for its own client_body_timeout): end it as answered instead, the
    -- status stays 408
    return ngx_exit(err.status == 408 and HTTP_OK or err.status)
end

-- unknown_url(method, uri) -> err: the 404 of a path that is no route (method and uri
-- are the client's, clipped).
function _M.unknown_url(method, uri)
    return _M.new(404, format("Invalid URL (%s %s)", _M.clip(method), _M.clip(uri)), nil,
        "unknown_url")
end

-- What nginx itself answers (error pages before or around the edge's Lua), as errors:
-- status -> {message, code[, type]}. 5xx of a proxied request are the backend's
-- failures; 501 and 505 are the client's (what it sent is not HTTP nginx accepts).
local NGINX = {
    [400] = { "The request is not HTTP that the gateway accepts: a bad request line or "
        .. "header, a header that may appear once sent twice (Host, Authorization, "
        .. "Content-Length), Content-Length with Transfer-Encoding, or a broken chunked "
        .. "body.", "invalid_request" },
    [404] = { "Invalid URL: the API is under /v1/.", "unknown_url" },
    [405] = { "Method not allowed (nginx refuses TRACE, and methods it does not know).",
              "method_not_allowed" },
    [408] = { "The request was not received in time.", "request_timeout" },
    [413] = { "Request body is larger than the gateway accepts.", "request_too_large" },
    [414] = { "Request URI is too long.", "request_too_large" },
    [431] = { "Request headers are too large.", "request_too_large" },
    [494] = { "Request headers are too large.", "request_too_large" },
    [500] = { "The gateway failed to handle the request.", "internal_error" },
    [501] = { "The request's Transfer-Encoding is not supported (only chunked is).",
              "invalid_request", "invalid_request_error" },
    [502] = { "The gateway could not reach a service it needs. Please retry.",
              "upstream_unavailable" },
    [503] = { "The gateway is unavailable. Please retry.", "upstream_unavailable" },
    [504] = { "A service behind the gateway did not answer in time.", "upstream_timeout" },
    [505] = { "The request's HTTP version is not supported.",
              "invalid_request", "invalid_request_error" },
}
local UPSTREAM = {
    [502] = { "The model backend is unreachable. Please retry.", "upstream_unavailable" },
    [503] = { "The model backend is unavailable. Please retry.", "upstream_unavailable" },
    [504] = { "The model backend did not answer in time.", "upstream_timeout" },
}

-- nginx(status, proxied) -> err (new()'s shape) for an error page nginx made (or a
-- backend's non-JSON error when proxied: a 5xx a server error, a 4xx the request's,
-- 422 as 400). Unlisted statuses get a generic message.
-- 494 is nginx's internal status for headers too large; the client is sent 400.
function _M.nginx(status, proxied)
    local f
    if proxied then
        f = UPSTREAM[status]
    else
        f = NGINX[status]
    end
    if status == 494 then
        status = 400
    end
    if f then
        return _M.new(status, f[1], nil, f[2], f[3])
    end
    if proxied then
        if status >= 500 then
            return _M.new(status, format("The model backend failed with HTTP %d.", status),
                nil, "upstream_error", "server_error")
        end
        return _M.new(_M.upstream_status(status), format(
            "The model backend refused the request with HTTP %d.", status), nil,
            "upstream_error")
    end
    return _M.new(status, format("The gateway answered HTTP %d.", status), nil,
        status >= 500 and "internal_error" or "invalid_request")
end

-- upstream_status(status) -> the status the client gets for a backend's 4xx error: the
-- same, except 422 (vLLM's UnprocessableEntityError, FastAPI's validation status),
-- which OpenAI answers as 400.
function _M.upstream_status(status)
    return status == 422 and 400 or status
end

-- upstream(status, text) -> err (new()'s shape) | nil: a backend's (vLLM's) JSON
-- error body in OpenAI's shape. vLLM writes {"error": {"message", "type": "Bad Request"
-- | "BadRequestError" | "NotFoundError" | ..., "param": "body.temperature" | ... | null,
-- "code": 400}} (vllm/entrypoints/serve/engine/protocol.py ErrorInfo: code is the HTTP
-- status). Kept: the message (cut to 1024 bytes by body()) and the param without
-- FastAPI's "body." prefix ("body" itself, the whole body, is no param); type becomes
-- invalid_request_error for a 4xx, server_error for a 5xx (vLLM's InternalServerError,
-- EngineDeadError); code is kept only when it is a string. nil when text is not
-- JSON or has no error object with a string message: such a body passes unchanged.
function _M.upstream(status, text)
    local doc = cjson.decode(text)
    local e = type(doc) == "table" and doc.error
    if type(e) ~= "table" or type(e.message) ~= "string" then
        return nil
    end
    local param = e.param
    if type(param) == "string" then
        param = match(param, "^body%.(.+)") or param
        if param == "body" then
            param = nil
        end
    else
        param = nil
    end
    local code = type(e.code) == "string" and _M.clip(e.code) or nil
    return _M.new(_M.upstream_status(status), e.message, param, code)
end

return _M
