-- Prompt tokens of a request: the counter sidecar's exact count
-- (tokengate.v1.TokenCounter/CountTokens, in counter frames through tokengate.sidecar),
-- and what happens
-- when the counter cannot answer (edge.on_counter_failure): "open" forwards with an
-- over-counting estimate, "closed" refuses with 503.

local ngx = ngx
local pb = require "tokengate.pb"
local sidecar = require "tokengate.sidecar"
local errors = require "tokengate.errors"
local digest = require "tokengate.digest"
local lrucache = require "resty.lrucache.pureffi"

local sha256 = digest.sha256
local ngx_log, WARN = ngx.log, ngx.WARN
local ceil, max = math.ceil, math.max
local find, sub = string.find, string.sub

local _M = {}

-- tokengate.v1.ENDPOINT_COMPLETIONS (proto/tokengate/v1/counter.proto): ping()'s
local COMPLETIONS = 2
local METHOD = "/tokengate.v1.TokenCounter/CountTokens"
local GRPC_INVALID_ARGUMENT = 3
local GRPC_NOT_FOUND = 5
local GRPC_OUT_OF_RANGE = 11
-- The counter's deadline is count_timeout_ms per started HEAVY_BYTES of body: a 1k-token
-- prompt is ~5 KB, and a body of several hundred KB (tens of thousands of messages) takes
-- the counter that much longer by itself. A larger body's timeout does not open the
-- counter's breaker either.
local HEAVY_BYTES = 256 * 1024

-- per-worker LRU: endpoint .. model .. SHA-256(body) -> reply. A digest, not the body
-- itself, is the key: count_cache_entries bodies of up to max_body_bytes each would be
-- held otherwise; SHA-256 (no known collision, unlike SHA-1) keeps it exact. A reply
-- with prefix hits (routing.policy prefix, replicas with KV events) is not kept: the
-- hits are the replicas' caches at the time of the call.
-- resty.lrucache.pureffi, not resty.lrucache: on a full cache every cold body evicts
-- one entry and adds another, and the plain one's Lua tables then rehash on each set
-- (LuaJIT reuses no slot of a deleted key): measured in this nginx, 64 µs a set at
-- 4,096 entries (16 µs at 1,024), against 0.4 µs for pureffi's own hash.
local cache
local client -- tokengate.sidecar client of the counter

-- init_worker(edge, sockets, dict) -> true | nil, err. edge: the compiled edge section
-- (count_cache_entries, count_timeout_ms, counter_backoff_ms); sockets: the counter
-- workers' unix sockets ({"unix:/path.0", ...}, spoken to in counter frames);
-- dict: the breaker's shared dict.
function _M.init_worker(edge, sockets, dict)
    cache = lrucache.new(edge.count_cache_entries)
    local err
    client, err = sidecar.frames("counter", sockets, edge.count_timeout_ms,
        edge.counter_backoff_ms, dict)
    return client ~= nil, err
end

-- ask(endpoint, model, body, affinity) -> reply | nil, failure (tokengate.sidecar's
-- shape); affinity: the counter worker preference (prompt's)
local function ask(endpoint, model, body, affinity)
    local ckey = endpoint .. "\0" .. model .. "\0" .. sha256(body)
    local hit = cache:get(ckey)
    if hit then
        return hit
    end
    local msg, failure = client:call(METHOD, pb.count_request(model, endpoint, body),
        max(1, ceil(#body / HEAVY_BYTES)), affinity)
    if not msg then
        return nil, failure
    end
    local reply, derr = pb.count_reply(msg)
    if not reply then
        return nil, { reason = "error", message = "counter reply: " .. derr }
    end
    if #reply.prefix_hits == 0 then
        -- the replicas' prefix caches change with every request: hits are never reused
        cache:set(ckey, reply)
    end
    return reply
end

-- verdict(failure) -> the client's error when the counter judged the request itself
-- (INVALID_ARGUMENT -> 400 invalid_value, OUT_OF_RANGE -> 400 context_length_exceeded,
-- both naming the counter's field; NOT_FOUND -> 404), else nil
local function verdict(failure)
    local gs, msg = failure.grpc_status, failure.message
    if failure.reason ~= "status" then
        return nil
    end
    if gs == GRPC_INVALID_ARGUMENT or gs == GRPC_OUT_OF_RANGE then
        -- "messages[2].content: text" -> param "messages[2].content"
        local colon = find(msg, ": ", 1, true)
        local param = colon and sub(msg, 1, colon - 1) or nil
        if param and (param == "" or find(param, "%s")) then
            param = nil
        end
        return errors.new(400, msg, param, gs == GRPC_OUT_OF_RANGE
            and "context_length_exceeded" or "invalid_value")
    elseif gs == GRPC_NOT_FOUND then
        return errors.new(404, msg, "model", "model_not_found")
    end
    return nil
end

-- CLOSED: the 503 of a request the counter could not count, under "closed" (and of one
-- that only the exact count can answer: count_tokens)
local CLOSED = errors.new(503, "The token counter is unavailable; the request was not "
    .. "forwarded. Please retry.", nil, "counter_unavailable", nil, { ["Retry-After"] = "1" })
_M.CLOSED = CLOSED

-- prompt(endpoint, model, body, edge, affinity) -> counted | nil, err
--   endpoint: how the counter reads the body, a tokengate.v1.Endpoint (the route's API
--   module's ENDPOINT[route]); model: served model name; body: the body's JSON text as
--   the edge forwards it (tokengate.body.text); edge: compiled edge settings
--   (on_counter_failure, estimate_bytes_per_token); affinity: a string or nil, the
--   request's session (tokengate.session): calls of one session go to the same counter
--   worker while it is not busier than the others (tokengate.sidecar.call), so its
--   segment, template and block-hash caches hold the conversation's earlier turns,
--   which another worker would tokenize again. Without a session, the least busy worker
--   counts (a key's requests are many conversations: pinned to one worker, a busy key
--   would load it alone, and each worker caches what they share after its first).
--   counted = { prompt = <prompt tokens>, prompts = <prompts in the request, >= 1>,
--               source = "counter" | "estimate", system = <system-message tokens>,
--               reply = <pb.count_reply> | nil (estimate) }
--   err: 400 / 404 when the counter refused the request (400 context_length_exceeded:
--   an embeddings input longer than the context), 503 when it is unavailable
--   and the edge fails closed.
-- The estimate is ceil(#body / estimate_bytes_per_token): it counts the whole JSON
-- text, so it over-counts and limits stay on the safe side.
function _M.prompt(endpoint, model, body, edge, affinity)
    local reply, failure = ask(endpoint, model, body, affinity)
    if reply then
        return { prompt = reply.prompt_tokens, prompts = max(1, reply.prompt_count),
                 source = "counter", system = reply.breakdown.system, reply = reply }
    end
    local refused = verdict(failure)
    if refused then
        return nil, refused
    end
    if not failure.outage then -- an outage is logged once, by tokengate.sidecar
        ngx_log(WARN, "tokengate: counter unavailable (", failure.reason, ": ",
            failure.message, "), failing ", edge.on_counter_failure)
    end
    if edge.on_counter_failure == "closed" then
        return nil, CLOSED
    end
    return { prompt = ceil(#body / edge.estimate_bytes_per_token), prompts = 1,
             source = "estimate", system = 0 }
end

local PING = '{"prompt":"ok"}'

-- ping(model) -> true | nil, reason: the counter counted a one-token completions prompt
-- of model (a real call: the per-worker cache is not asked). reason: tokengate.sidecar's
-- failure reason ("backoff", "down", "timeout", "unavailable", "status", "error"), with
-- the sidecar's message in parentheses when it gave one (e.g. the counter's gRPC message
-- for a model it does not serve).
function _M.ping(model)
    local msg, failure = client:call(METHOD, pb.count_request(model, COMPLETIONS,
        PING))
    if not msg then
        if failure.message and failure.message ~= "" then
            return nil, failure.reason .. " (" .. failure.message .. ")"
        end
        return nil, failure.reason
    end
    return true
end

-- backing_off() -> true while the counter's breaker is open
function _M.backing_off()
    return client ~= nil and client:backing_off()
end

return _M
