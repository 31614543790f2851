-- The loopback status server's content handlers (edge.status_listen, tokengate-http.conf):
--   GET /tokengate/status  the metrics as JSON (tokengate.metrics), whether the global
--                          tier and the counter are skipped after a failure, and every
--                          replica's state
--   GET /metrics           every edge metric in Prometheus's text format (version 0.0.4),
--                          with the replicas' and the queues' gauges read now
-- Neither is on the API listener: no key, no usage event.

local config = require "tokengate.config"
local json = require "tokengate.json"
local reply = require "tokengate.reply"
local metrics = require "tokengate.metrics"
local limits = require "tokengate.limits"
local count = require "tokengate.count"
local upstream = require "tokengate.upstream"
local admission = require "tokengate.admission"
local prefix = require "tokengate.prefix"
local queue = require "tokengate.queue"
local slo = require "tokengate.slo"

local pairs, ipairs = pairs, ipairs

local _M = {}

-- json(): content handler of /tokengate/status: the metrics as JSON, plus whether the
-- global tier and the counter are skipped after a failure, and per model and replica
-- {outstanding_tokens, out, asleep, address, kv_cache_usage, num_requests_waiting,
-- num_requests_running, finish_rate, mean_ttft_s} (the vLLM metrics null while unknown:
-- tokengate.admission).
function _M.json()
    local extra = json.object()
    json.set(extra, "global_limits_enabled", config.get().global_limits.enabled == true)
    json.set(extra, "global_limits_backing_off", limits.global_backing_off())
    json.set(extra, "counter_backing_off", count.backing_off())
    local ups = json.object()
    for name, replicas in pairs(upstream.states(config.get(), admission.state)) do
        local m = json.object()
        for rname, st in pairs(replicas) do
            local o = json.object()
            json.set(o, "outstanding_tokens", st.outstanding_tokens)
            json.set(o, "out", st.out)
            json.set(o, "asleep", st.asleep)
            json.set(o, "address", st.address or json.null)
            local kv = st.more
            json.set(o, "kv_cache_usage", kv and kv.kv_cache_usage or json.null)
            json.set(o, "num_requests_waiting", kv and kv.waiting or json.null)
            json.set(o, "num_requests_running", kv and kv.running or json.null)
            json.set(o, "finish_rate", kv and kv.finish_rate or json.null)
            json.set(o, "mean_ttft_s", kv and kv.mean_ttft or json.null)
            json.set(m, rname, o)
        end
        json.set(ups, name, m)
    end
    json.set(extra, "upstreams", ups)
    return reply.send(200, metrics.json_text(extra))
end

-- prometheus(): content handler of /metrics: every edge metric in Prometheus's text
-- format, with the replicas' state read now (tokengate.upstream), the prefix index's
-- capacity (tokengate.prefix), the queues' depth (tokengate.queue) and, for a model
-- routed by slo, its backlog in seconds of predicted time (tokengate.slo.backlog_s).
function _M.prometheus()
    local up, outstanding, blocks, backlog = {}, {}, {}, {}
    local doc = config.get()
    for name, replicas in pairs(upstream.states(doc)) do
        local m = 'model="' .. metrics.value(name) .. '",replica="'
        for rname, st in pairs(replicas) do
            local labels = m .. metrics.value(rname) .. '"'
            up[labels] = st.out and 0 or 1
            outstanding[labels] = st.outstanding_tokens
        end
        local model = doc.models[name]
        if model.routing and model.routing.policy == "slo" then
            local live = {}
            for _, r in ipairs(model.upstreams) do
                if not upstream.is_out(name, r) then
                    live[#live + 1] = r
                end
            end
            backlog['model="' .. metrics.value(name) .. '"'] = slo.backlog_s(name, live,
                function(r) return upstream.in_flight(name, r) end)
        end
        if model.routing and (model.routing.policy == "prefix"
                or model.routing.policy == "slo") then
            local list = model.upstreams
            for i = 1, #list do
                blocks[m .. metrics.value(list[i].name) .. '"'] =
                    prefix.capacity_blocks(name, list[i])
            end
        end
    end
    local size, free = prefix.memory()
    local qreq, qtok = {}, {}
    for prio, d in pairs(queue.depth(doc)) do
        local labels = 'priority="' .. metrics.value(prio) .. '"'
        qreq[labels], qtok[labels] = d.requests, d.tokens
    end
    local text = metrics.exposition({ tokengate_upstream_up = up,
                                      tokengate_queue_requests = qreq,
                                      tokengate_queue_tokens = qtok,
                                      tokengate_upstream_outstanding_tokens = outstanding,
                                      tokengate_prefix_capacity_blocks = blocks,
                                      tokengate_slo_backlog_seconds = backlog,
                                      tokengate_prefix_index_capacity_bytes =
                                          size and { [""] = size },
                                      tokengate_prefix_index_free_bytes =
                                          free and { [""] = free } })
    return reply.send(200, text, nil, "text/plain; version=0.0.4; charset=utf-8")
end

return _M
