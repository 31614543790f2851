-- One unary gRPC call through the loopback hop (shared by tokengate.count and
-- tokengate.global_limit).
--
-- ngx.location.capture straight to a grpc_pass location crashes the worker with Debian's
-- lua module, so the call goes: capture -> an internal location -> proxy_pass (HTTP/1.1
-- keepalive) -> a second server of this nginx on a unix socket -> grpc_pass. What comes
-- back, verified with this nginx: success is HTTP 200 with the framed reply (grpc-status
-- travels in a trailer that the HTTP/1.1 hop drops); a gRPC error is a trailers-only
-- response, so grpc-status / grpc-message arrive as plain headers; a dead or slow sidecar
-- gives the hop's own 502/504.

local ngx = ngx
local pb = require "tokengate.pb"

local capture = ngx.location.capture
local HTTP_POST = ngx.HTTP_POST
local tonumber = tonumber
local type = type
local gsub = string.gsub
local char = string.char

local _M = {}

-- grpc-message is percent-encoded (gRPC over HTTP/2 spec: bytes outside 0x20..0x7E and
-- "%" only). ngx.unescape_uri would also turn "+" into a space, so decode by hand.
local function hexbyte(h)
    return char(tonumber(h, 16))
end

-- header(res, name) -> the first value of a subrequest response header, or nil
local function header(res, name)
    local v = res.header[name]
    if type(v) == "table" then
        v = v[1]
    end
    return v
end

-- call(uri, message) -> reply message bytes | nil, failure
--   uri: the internal hop location (e.g. "/_tokengate/count"); message: the serialized
--   request (unframed protobuf bytes).
--   failure = { grpc_status = <non-zero status number> | nil,
--               message = <decoded grpc-message, or why the reply is unreadable>,
--               http_status = <the hop's HTTP status> }
--   A non-zero grpc_status wins; otherwise a non-200 http_status; otherwise the 200 body
--   was not one well-formed gRPC frame (message says why).
function _M.call(uri, message)
    local res = capture(uri, { method = HTTP_POST, body = pb.frame(message) })
    local gs = tonumber(header(res, "grpc-status"))
    if gs and gs ~= 0 then
        return nil, { grpc_status = gs, http_status = res.status,
                      message = (gsub(header(res, "grpc-message") or "", "%%(%x%x)", hexbyte)) }
    end
    if res.status ~= 200 then
        return nil, { http_status = res.status, message = "" }
    end
    local msg, err = pb.unframe(res.body or "")
    if not msg then
        return nil, { http_status = 200, message = err }
    end
    return msg
end

return _M
