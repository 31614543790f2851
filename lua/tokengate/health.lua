-- Unauthenticated probes on the API listener (no key, no usage event, no limits), each
-- answering GET and HEAD (HEAD: the headers only) and any other method 405 with
-- Allow: GET, HEAD:
--   /healthz  liveness: this nginx worker runs the edge's Lua
--   /readyz   readiness for a load balancer: the counter and every model ready
--   /health   what vLLM answers and vLLM-aware tools (guidellm, benchmark
--                 harnesses) probe before they start: 200 while some model has a
--                 ready replica
-- A replica is ready when it is not ejected (tokengate.upstream.is_out) and, with health
-- probes, its last probe answered 200 (tokengate.upstream.probed).

local ngx = ngx
local config = require "tokengate.config"
local count = require "tokengate.count"
local upstream = require "tokengate.upstream"
local json = require "tokengate.json"
local reply = require "tokengate.reply"

local pairs = pairs
local sort, concat = table.sort, table.concat

local _M = {}

local answer = reply.send

local function refusal(status, message, code, headers)
    local e = json.object()
    json.set(e, "message", message)
    json.set(e, "type", status == 405 and "invalid_request_error" or "server_error")
    json.set(e, "param", json.null)
    json.set(e, "code", code)
    return e, headers
end

-- not_get(object, path) -> true when the request's method is neither GET nor HEAD, and
-- answered: 405 with Allow: GET, HEAD, the probe's object with status "error" and an
-- error in OpenAI's shape (code method_not_allowed); false otherwise.
local function not_get(object, path)
    local method = ngx.req.get_method()
    if method == "GET" or method == "HEAD" then
        return false
    end
    local o = json.object()
    json.set(o, "object", object)
    json.set(o, "status", "error")
    json.set(o, "error", refusal(405, "Method not allowed: use GET " .. path .. " or HEAD "
        .. path, "method_not_allowed"))
    answer(405, json.encode(o), { Allow = "GET, HEAD" })
    return true
end

-- model_names(doc) -> the configured model names, sorted
local function model_names(doc)
    local names = {}
    for name in pairs(doc.models) do
        names[#names + 1] = name
    end
    sort(names)
    return names
end

-- replicas(doc, names) -> {"<model>": {replicas = n, healthy_replicas = n}} (a JSON
-- object), the names of the models with no ready replica
local function replicas(doc, names)
    local ms, none = json.object(), {}
    for i = 1, #names do
        local list = doc.models[names[i]].upstreams
        local n, healthy = #list, 0
        for j = 1, n do
            if not upstream.is_out(names[i], list[j])
                    and upstream.probed(names[i], list[j]) then
                healthy = healthy + 1
            end
        end
        local m = json.object()
        json.set(m, "replicas", n)
        json.set(m, "healthy_replicas", healthy)
        json.set(ms, names[i], m)
        if healthy == 0 then
            none[#none + 1] = names[i]
        end
    end
    return ms, none
end

-- healthz(): GET /healthz (liveness): 200 {"object": "health", "status": "ok"}; another
-- method than GET or HEAD: 405 (not_get).
function _M.healthz()
    if not_get("health", "/healthz") then
        return
    end
    return answer(200, '{"object":"health","status":"ok"}')
end

-- health(): GET or HEAD /health, as vLLM's own /health is probed (vllm/entrypoints/
-- openai/api_server.py answers 200 while its engine runs): 200 while at least one model
-- has a ready replica, with {"object": "health", "status": "ok", "models": {"<model>":
-- {"replicas": n, "healthy_replicas": n}}}; 503 {"..., "status": "unavailable",
-- "error": {message, type = "server_error", param, code = "no_ready_replica"}} when no
-- model has one. The counter is not asked: without it requests are still served, on
-- estimates. Another method: 405 (not_get).
function _M.health()
    if not_get("health", "/health") then
        return
    end
    local o = json.object()
    json.set(o, "object", "health")
    local doc = config.get()
    local names = model_names(doc)
    local ms, none = replicas(doc, names)
    local ok = #none < #names
    json.set(o, "status", ok and "ok" or "unavailable")
    json.set(o, "models", ms)
    if ok then
        return answer(200, json.encode(o))
    end
    json.set(o, "error", refusal(503, "No model has a ready replica (" .. concat(none, ", ")
        .. ").", "no_ready_replica"))
    return answer(503, json.encode(o), { ["Retry-After"] = "1" })
end

-- readyz(): GET /readyz (readiness, for a load balancer): 200 when the configuration is
-- loaded, the counter answers a one-token count (a real call through the hop, never the
-- edge's cache of answers; a counter in backoff after a failure is not asked) and every
-- model has a ready replica; else 503 in OpenAI's error shape naming what is not ready;
-- another method than GET or HEAD: 405 (not_get).
-- Both bodies list the checks:
--   {"object": "readiness", "status": "ready" | "not_ready", "config": "ok",
--    "counter": "ok" | "<reason>", "models": {"<model>": {"replicas": n,
--    "healthy_replicas": n}}}
-- and the 503 adds "error": {message, type, param, code = "not_ready"}.
function _M.readyz()
    if not_get("readiness", "/readyz") then
        return
    end
    local doc = config.get()
    local o = json.object()
    json.set(o, "object", "readiness")
    local problems = {}
    local names = model_names(doc)
    -- every model: a model the counter does not know (a configuration it has not
    -- reloaded) is as unready as a counter that does not answer
    local ok, why = true, nil
    for i = 1, #names do
        local m_ok, m_why = count.ping(names[i])
        if not m_ok then
            ok, why = false, (why and why .. "; " or "") .. "model " .. names[i] .. ": " .. m_why
        end
    end
    if not ok then
        problems[#problems + 1] = "counter: " .. why
    end
    local ms, none = replicas(doc, names)
    for i = 1, #none do
        problems[#problems + 1] = "model " .. none[i] .. ": no healthy replica"
    end
    local ready = #problems == 0
    json.set(o, "status", ready and "ready" or "not_ready")
    json.set(o, "config", "ok")
    json.set(o, "counter", ok and "ok" or why)
    json.set(o, "models", ms)
    if ready then
        return answer(200, json.encode(o))
    end
    json.set(o, "error", refusal(503, "Not ready: " .. concat(problems, "; ") .. ".",
        "not_ready"))
    return answer(503, json.encode(o))
end

return _M
