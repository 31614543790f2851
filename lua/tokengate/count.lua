-- Prompt-token counts from the counter sidecar (tokengate.v1.TokenCounter/CountTokens).
--
-- The call goes through the loopback hop: ngx.location.capture to the
-- internal location /_tokengate/count, which proxy_passes (HTTP/1.1 keepalive) to a
-- second server of this nginx on a unix socket, which grpc_passes to the counter
-- workers. A capture straight to grpc_pass crashes the worker with Debian's lua module.
-- What comes back, verified with this nginx: success is HTTP 200 with the framed
-- CountReply (grpc-status travels in a trailer that the HTTP/1.1 hop drops); a gRPC error
-- is a trailers-only response, so grpc-status / grpc-message arrive as plain headers;
-- a dead or slow counter gives the hop's own 502/504.

local ngx = ngx
local pb = require "tokengate.pb"
local errors = require "tokengate.errors"
local lrucache = require "resty.lrucache"

local capture = ngx.location.capture
local HTTP_POST = ngx.HTTP_POST
local sha1_bin = ngx.sha1_bin
local tonumber = tonumber
local type = type
local ceil = math.ceil
local find = string.find
local sub = string.sub
local gsub = string.gsub
local char = string.char

local _M = {}

local ENDPOINT = { chat = 1, completions = 2 }
local GRPC_INVALID_ARGUMENT = 3
local GRPC_NOT_FOUND = 5
local HOP = "/_tokengate/count"

local cache -- per-worker LRU: route .. model .. sha1(body) -> reply

-- init_worker(entries): creates this worker's count cache (entries: max bodies kept).
function _M.init_worker(entries)
    cache = lrucache.new(entries)
end

-- grpc-message is percent-encoded (gRPC over HTTP/2 spec: bytes outside 0x20..0x7E and
-- "%" only). ngx.unescape_uri would also turn "+" into a space, so decode by hand.
local function hexbyte(h)
    return char(tonumber(h, 16))
end

-- grpc_message(header value or nil) -> decoded message string
local function grpc_message(v)
    return (gsub(v or "", "%%(%x%x)", hexbyte))
end

-- header(res, name) -> the first value of a subrequest response header, or nil
local function header(res, name)
    local v = res.header[name]
    if type(v) == "table" then
        v = v[1]
    end
    return v
end

-- count(route, model, body) -> reply, cached (bool) | nil, err
--   route: "chat" | "completions"; model: served model name; body: the exact bytes the
--   edge will forward.
--   reply: see pb.count_reply (token counts in tokens).
--   err = {kind = "invalid", message = "<counter's message>", param = "<field path>"}
--       | {kind = "not_found", message = ...}
--       | {kind = "unavailable", message = "<why>"}   (fail open / closed applies)
function _M.count(route, model, body)
    local ckey = route .. "\0" .. model .. "\0" .. sha1_bin(body)
    local hit = cache and cache:get(ckey)
    if hit then
        return hit, true
    end
    local frame = pb.frame(pb.count_request(model, ENDPOINT[route], body))
    local res = capture(HOP, { method = HTTP_POST, body = frame })
    local gs = tonumber(header(res, "grpc-status"))
    if gs and gs ~= 0 then
        local msg = grpc_message(header(res, "grpc-message"))
        if gs == GRPC_INVALID_ARGUMENT then
            -- "messages[2].content: text" -> param "messages[2].content"
            local colon = find(msg, ": ", 1, true)
            local param = colon and sub(msg, 1, colon - 1) or nil
            if param and (param == "" or find(param, "%s")) then
                param = nil
            end
            return nil, { kind = "invalid", message = msg, param = param }
        elseif gs == GRPC_NOT_FOUND then
            return nil, { kind = "not_found", message = msg }
        end
        return nil, { kind = "unavailable", message = "counter answered gRPC status " .. gs
            .. ": " .. msg }
    end
    if res.status ~= 200 then
        return nil, { kind = "unavailable", message = "counter hop answered HTTP " .. res.status }
    end
    local msg, ferr = pb.unframe(res.body or "")
    if not msg then
        return nil, { kind = "unavailable", message = "counter reply: " .. ferr }
    end
    local reply, derr = pb.count_reply(msg)
    if not reply then
        return nil, { kind = "unavailable", message = "counter reply: " .. derr }
    end
    if cache then
        cache:set(ckey, reply)
    end
    return reply, false
end

-- rejection(err) -> the client's error (errors.new shape) for a counter verdict on the
-- request: "invalid" -> 400 naming the counter's field, "not_found" -> 404; and for
-- "unavailable" the fail-closed 503 with Retry-After.
function _M.rejection(err)
    if err.kind == "invalid" then
        return errors.new(400, err.message, err.param, "invalid_value")
    elseif err.kind == "not_found" then
        return errors.new(404, err.message, "model", "model_not_found")
    end
    return errors.new(503, "The token counter is unavailable; the request was not forwarded. "
        .. "Please retry.", nil, "counter_unavailable", nil, { ["Retry-After"] = "1" })
end

-- estimate(body, bytes_per_token) -> tokens: the fail-open estimate, ceil(#body / bpt).
-- Counts the whole JSON text, so it over-counts: limits stay on the safe side.
function _M.estimate(body, bytes_per_token)
    return ceil(#body / bytes_per_token)
end

return _M
