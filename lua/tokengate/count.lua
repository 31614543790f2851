-- Prompt-token counts from the counter sidecar (tokengate.v1.TokenCounter/CountTokens),
-- called through the loopback hop (tokengate.hop) at the internal location
-- /_tokengate/count.

local ngx = ngx
local pb = require "tokengate.pb"
local hop = require "tokengate.hop"
local errors = require "tokengate.errors"
local lrucache = require "resty.lrucache"

local sha1_bin = ngx.sha1_bin
local ceil = math.ceil
local find = string.find
local sub = string.sub

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
    local msg, failure = hop.call(HOP, pb.count_request(model, ENDPOINT[route], body))
    if not msg then
        local gs, fmsg = failure.grpc_status, failure.message
        if gs == GRPC_INVALID_ARGUMENT then
            -- "messages[2].content: text" -> param "messages[2].content"
            local colon = find(fmsg, ": ", 1, true)
            local param = colon and sub(fmsg, 1, colon - 1) or nil
            if param and (param == "" or find(param, "%s")) then
                param = nil
            end
            return nil, { kind = "invalid", message = fmsg, param = param }
        elseif gs == GRPC_NOT_FOUND then
            return nil, { kind = "not_found", message = fmsg }
        elseif gs then
            return nil, { kind = "unavailable", message = "counter answered gRPC status " .. gs
                .. ": " .. fmsg }
        elseif failure.http_status ~= 200 then
            return nil, { kind = "unavailable",
                          message = "counter hop answered HTTP " .. failure.http_status }
        end
        return nil, { kind = "unavailable", message = "counter reply: " .. fmsg }
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
