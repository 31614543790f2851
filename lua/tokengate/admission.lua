-- KV-cache-aware admission: which replicas may take a new request, read from what each
-- replica's vLLM says on its /metrics, and when the edge sheds a request instead.
--
-- Why: above about 0.92 of the KV cache, vLLM preempts running requests and a new
-- prompt's prefill waits for blocks to free, so its time to first token rises steeply;
-- a queue of waiting requests says the same. The edge sees this before forwarding and
-- sends the request to a replica with room, or answers 503 at once with a Retry-After,
-- rather than adding to a queue it cannot see the end of.
--
-- Metrics: one worker (worker 0, like the health probe) reads every replica's /metrics
-- every edge.admission.metrics_interval_ms and keeps, in the shared dict, with a ttl
-- of metrics_stale_ms (vLLM 0.32's names, vllm/v1/metrics/loggers.py; one sample per
-- engine, labels model_name and engine):
--   kv:   vllm:kv_cache_usage_perc, 0..1 (1 = full), the largest of the engines
--   wait: vllm:num_requests_waiting, requests, summed over the engines
--   run:  vllm:num_requests_running, requests, summed
--   rate: finished requests per second, from vllm:request_success_total (summed over
--         engines and finish reasons): an exponential moving average of the rate between
--         two reads, time constant RATE_TAU_S
--   ttft: the mean time to first token, s, from vllm:time_to_first_token_seconds (a
--         histogram: its _sum over its _count, summed over engines) of the requests
--         that got their first token between two reads, averaged with time constant
--         TTFT_TAU_S
-- and hands the KV cache's size in blocks (the num_gpu_blocks label of
-- vllm:cache_config_info, the largest of the engines: each engine has a cache of its
-- own) to tokengate.prefix, the capacity of its approximate index.
-- Only that worker writes them (plain set is enough: one writer). A replica whose
-- metrics were not refreshed within metrics_stale_ms (it stopped answering /metrics,
-- never served them, or answers something else) has none: it is UNKNOWN.
--
-- Rank of a replica for one request (its key's priority: kv_cache_threshold,
-- max_waiting, max_running, max_prefill_tokens; its prompt tokens), best first;
-- tokengate.upstream picks the replica with the fewest outstanding tokens among the
-- best rank:
--   ROOM      known, queue <= max_waiting, running < max_running, prefill lane free
--             and KV cache <= kv_cache_threshold
--   HEADROOM  known, queue <= max_waiting, running < max_running, KV cache above the
--             threshold but at most threshold + small_prompt_headroom, and a prompt of
--             at most small_prompt_tokens (a small prefill needs few KV-cache blocks)
--   UNKNOWN   no fresh metrics: used when no known replica has room, never counted as
--             full (shedding claims the fleet is full; only metrics can say so; a dead
--             replica is the health probe's and the ejection's business)
--   FULL      known, and the queue, the running requests or the KV cache is above the
--             bounds, or its prefill lane is taken
-- running: vllm:num_requests_running plus vllm:num_requests_waiting as last read (a
-- waiting request takes the next seat that frees, ahead of any that comes later: vLLM
-- admits in order), plus the requests this edge has sent to the replica since, less
-- those of its requests that ended since (tokengate.upstream.in_flight now less
-- in_flight at the read): the metrics see every edge's requests but are up to
-- metrics_interval_ms old; this edge's own count moves at once. Never fewer than this
-- edge's requests in flight there: one on its way at the read (or in the replica's
-- HTTP server, before its engine saw it) is in the in-flight count read, not in the
-- metrics, so the sum above leaves it out until the next read, and a burst of such
-- gaps let lines take the seats kept free. (In flight alone counts a request from its
-- choice to the end of its relay, longer than vLLM runs it: a bound on it alone leaves
-- seats empty when the metrics are fresh.)
-- max_running keeps seats of vLLM's running batch (--max-num-seqs) free for the
-- priorities above: a request that finds every seat taken waits in vLLM's queue for a
-- running one to finish (vLLM 0.32 preempts for priority only when KV blocks run out,
-- never for a seat).
-- Prefill lane (a priority with max_prefill_tokens): vLLM computes the prefills of
-- every request it admits in the next engine step, whatever their priority, and a
-- step whose prefill tokens pass the GPU's ridge (about 260 tokens a step on an H100
-- in bf16: below it a step costs its weights' read, above it its FLOPs) lasts longer
-- for every request in it, so an interactive request that shares a step with a
-- batch line's prefill gets its first token later. While requests of other priorities
-- run on a replica, each request of such a priority sent there (sent()) takes the
-- replica's prefill lane for prompt / max_prefill_tokens times the replica's mean TTFT
-- (the time a prefill sent there takes, on average, to be done): the next request of
-- a paced priority waits for the lane (FULL until then), so their prefills arrive one
-- at a time, at most about max_prefill_tokens of them per TTFT, instead of landing in
-- one step together. Without requests of other priorities there the lane is not
-- taken: a batch alone on a replica slows only itself.
-- A request whose best replica is FULL is shed: 503 overloaded, before anything is
-- reserved (or held first: its priority's hold_ms, tokengate.stages.route).

local ngx = ngx
local errors = require "tokengate.errors"
local upstream = require "tokengate.upstream"
local metrics = require "tokengate.metrics"
local prefix = require "tokengate.prefix"
local shdict = require "tokengate.shdict"

local ngx_log, WARN, ngx_now, timer_every = ngx.log, ngx.WARN, ngx.now, ngx.timer.every
local timer_at, spawn, wait = ngx.timer.at, ngx.thread.spawn, ngx.thread.wait
local pairs, tonumber, tostring, type = pairs, tonumber, tostring, type
local match, find = string.match, string.find
local ceil, exp, max, min = math.ceil, math.exp, math.max, math.min
local upstream_paced = upstream.paced

local _M = {}

local ROOM, HEADROOM, UNKNOWN, FULL = 1, 2, 3, upstream.FULL
_M.ROOM, _M.HEADROOM, _M.UNKNOWN, _M.FULL = ROOM, HEADROOM, UNKNOWN, FULL

local RATE_TAU_S = 10 -- s: time constant of the finish-rate average
local TTFT_TAU_S = 2  -- s: time constant of the mean TTFT's average
local TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
local TTFT_COUNT = "vllm:time_to_first_token_seconds_count"

local dict, conf
local stale_s
local last = {} -- the scraping worker's previous read per replica: {count, t}
local last_ttft = {} -- and of its TTFT histogram: {sum, count, t}

local key = upstream.key

-- init_worker(doc, dict_name) -> true | nil, err. doc: the compiled configuration
-- (edge.admission: metrics_interval_ms (0: off), metrics_timeout_ms, metrics_stale_ms,
-- small_prompt_tokens, small_prompt_headroom, max_retry_after_s). Worker 0 reads the
-- metrics: once at once, then every metrics_interval_ms.
function _M.init_worker(doc, dict_name)
    local err
    dict, err = shdict.get(dict_name)
    if not dict then
        return nil, err
    end
    conf = doc.edge.admission
    stale_s = conf.metrics_stale_ms / 1000
    local interval = conf.metrics_interval_ms
    if interval == 0 or ngx.worker.id() ~= 0 then
        return true
    end
    local ok, err = timer_at(0, _M.scrape_all, doc.models)
    if ok then
        ok, err = timer_every(interval / 1000, _M.scrape_all, doc.models)
    end
    if not ok then
        return nil, "metrics timer: " .. err
    end
    return true
end

-- WANT: the vLLM metrics read, and how the samples of several engines combine
local WANT = {
    ["vllm:kv_cache_usage_perc"] = "max",
    ["vllm:num_requests_waiting"] = "sum",
    ["vllm:num_requests_running"] = "sum",
    ["vllm:request_success_total"] = "sum",
    [TTFT_SUM] = "sum",
    [TTFT_COUNT] = "sum",
}

local CACHE_INFO = "vllm:cache_config_info" -- an info gauge: its labels are the values

-- read(sock) -> {[metric name] = value} of the WANT metrics in a Prometheus text
-- exposition (lines `name{labels} value [timestamp]`), read line by line until the
-- replica closes, plus num_gpu_blocks (the largest num_gpu_blocks label of
-- vllm:cache_config_info; absent while vLLM says "None"); nil when a read fails. Each
-- sample's value is the field after the labels.
local function read(sock)
    local got = {}
    while true do
        local line, err = sock:receive("*l")
        if not line then
            return err == "closed" and got or nil
        end
        local name = match(line, "^vllm:[%w_]+")
        local how = name and WANT[name]
        if name == CACHE_INFO then
            local blocks = tonumber(match(line, 'num_gpu_blocks="(%d+)"'))
            if blocks then
                got.num_gpu_blocks = max(got.num_gpu_blocks or 0, blocks)
            end
        elseif how then
            local at = find(line, "}", #name + 1, true) or #name
            local v = tonumber(match(line, "^%s*(%S+)", at + 1))
            if v then
                local old = got[name]
                if not old then
                    got[name] = v
                elseif how == "max" then
                    got[name] = max(old, v)
                else
                    got[name] = old + v
                end
            end
        end
    end
end

-- parse(text) -> read()'s table for a whole exposition text (for tests).
function _M.parse(text)
    local pos = 1
    local fake = { receive = function()
        if pos > #text then
            return nil, "closed"
        end
        local nl = find(text, "\n", pos, true) or #text + 1
        local line = text:sub(pos, nl - 1)
        pos = nl + 1
        return line
    end }
    return read(fake)
end

-- finish_rate(k, count, t) -> requests/s finished since the previous read of the
-- replica whose rate is kept under k (count: its vllm:request_success_total, t: s),
-- averaged; nil until there are two reads (a counter that went down is a restarted
-- replica: start again).
local function finish_rate(k, count, t)
    local prev = last[k]
    last[k] = { count, t }
    if not prev or count < prev[1] or t <= prev[2] then
        return nil
    end
    local dt = t - prev[2]
    local x = (count - prev[1]) / dt
    local old = dict:get(k)
    if not old then
        return x
    end
    return old + (1 - exp(-dt / RATE_TAU_S)) * (x - old)
end

-- mean_ttft(k, sum, count, t) -> s: the mean TTFT of the requests that got their
-- first token since the previous read of the replica whose mean is kept under k (sum,
-- count: its vllm:time_to_first_token_seconds_sum and _count, t: s), averaged; the
-- average as it was when none did; nil until there are two reads (a count that went
-- down is a restarted replica: start again).
local function mean_ttft(k, sum, count, t)
    local prev = last_ttft[k]
    last_ttft[k] = { sum, count, t }
    local old = dict:get(k)
    if not prev or count < prev[2] or t <= prev[3] then
        return nil
    end
    local n = count - prev[2]
    if n == 0 then
        return old
    end
    local x = max(0, sum - prev[1]) / n
    if not old then
        return x
    end
    return old + (1 - exp(-(t - prev[3]) / TTFT_TAU_S)) * (x - old)
end

-- scrape(name, r): one read of replica r of model name; stores what it found.
local function scrape(name, r)
    local addr = upstream.address(name, r)
    if not addr then
        return
    end
    local sock, status = upstream.call(r, addr, "GET", "/metrics",
        conf.metrics_timeout_ms)
    local got
    if sock then
        got = status == 200 and read(sock) or nil
        sock:close()
    end
    if sock and status == 200 and not got
            and metrics.first_in(key("slow:", name, r), 60) then
        -- the cosocket's own error line names no replica; this one does
        ngx_log(WARN, "tokengate: GET /metrics of upstream ", r.name, " of ", name,
            " failed before its end (edge.admission.metrics_timeout_ms ",
            conf.metrics_timeout_ms, "): its KV cache stays as last read")
    end
    local kv = got and got["vllm:kv_cache_usage_perc"]
    if not kv then
        -- what it had stays until it expires (metrics_stale_ms)
        if dict:get(key("kv:", name, r)) == nil and metrics.first_in(key("nokv:", name, r),
                60) then
            ngx_log(WARN, "tokengate: upstream ", r.name, " of ", name, " sends no vLLM "
                .. "metrics (GET /metrics): its KV cache is unknown")
        end
        return
    end
    prefix.set_capacity(name, r, got.num_gpu_blocks)
    dict:set(key("kv:", name, r), kv, stale_s)
    dict:set(key("wait:", name, r), got["vllm:num_requests_waiting"] or 0, stale_s)
    dict:set(key("run:", name, r), got["vllm:num_requests_running"] or 0, stale_s)
    dict:set(key("runat:", name, r), upstream.in_flight(name, r), stale_s)
    local done = got["vllm:request_success_total"]
    local k = key("rate:", name, r)
    local rate = done and finish_rate(k, done, ngx_now())
    if rate then
        dict:set(k, rate, stale_s)
    end
    local sum, count = got[TTFT_SUM], got[TTFT_COUNT]
    k = key("ttft:", name, r)
    local ttft = sum and count and mean_ttft(k, sum, count, ngx_now())
    if ttft then
        dict:set(k, ttft, stale_s)
    end
end

local sweeping = false -- this worker's sweep is still running (a hung replica)

-- scrape_all(premature, models): the metrics timer: every replica of every model, each
-- in a light thread of its own, so one that hangs delays no other.
function _M.scrape_all(premature, models)
    if premature or sweeping then
        return
    end
    sweeping = true
    ngx.update_time()
    local threads = {}
    for name, m in pairs(models) do
        for i = 1, #m.upstreams do
            threads[#threads + 1] = spawn(scrape, name, m.upstreams[i])
        end
    end
    for i = 1, #threads do
        wait(threads[i])
    end
    sweeping = false
end

-- rank(model_name, r, level, prompt) -> ROOM | HEADROOM | UNKNOWN | FULL (module
-- comment) of replica r for a request of priority level (a compiled
-- edge.admission.priorities entry: kv_cache_threshold, max_waiting, max_running and
-- max_prefill_tokens (numbers, or null: no bound)) whose prompt has `prompt` tokens,
-- steady: true when the rank is the same for any request of that level until the
-- metrics are read again (it depends on neither the prompt nor, through max_running
-- or the prefill lane, the requests sent since; tokengate.upstream keeps such a rank
-- for a while under policy slo).
function _M.rank(model_name, r, level, prompt)
    local kv = dict:get(key("kv:", model_name, r))
    if kv == nil then
        return UNKNOWN, true
    end
    if (dict:get(key("wait:", model_name, r)) or 0) > level.max_waiting then
        return FULL, true
    end
    local seats = level.max_running
    local bounded = type(seats) == "number"
    if bounded and _M.running(model_name, r) >= seats then
        return FULL, false
    end
    if type(level.max_prefill_tokens) == "number" then
        bounded = true
        if dict:get(key("lane:", model_name, r)) then
            return FULL, false
        end
    end
    local limit = level.kv_cache_threshold
    if kv <= limit then
        return ROOM, not bounded
    end
    if prompt <= conf.small_prompt_tokens and kv <= limit + conf.small_prompt_headroom then
        return HEADROOM, false
    end
    return FULL, false
end

-- sent(model_name, r, level, prompt): a request of priority level with `prompt`
-- tokens goes to replica r. With level.max_prefill_tokens, while requests of other
-- priorities run there (running() above the paced requests this edge has there), it
-- takes r's prefill lane (module comment) for prompt / max_prefill_tokens x the
-- replica's mean TTFT, s (at least 1 ms: a shared-dict ttl is in ms, and 0 would
-- never expire); nothing while that mean is unknown. Not atomic with rank(): two
-- workers that saw the lane free at once both send (their prefills overlap once).
function _M.sent(model_name, r, level, prompt)
    local most = level.max_prefill_tokens
    if type(most) ~= "number" or most <= 0 then
        return
    end
    local ttft = dict:get(key("ttft:", model_name, r))
    if not ttft or _M.running(model_name, r) <= upstream_paced(model_name, r) then
        return
    end
    local s = max(0.001, ttft * max(prompt or 0, 1) / most)
    dict:add(key("lane:", model_name, r), true, s)
end

-- running(model_name, r) -> requests running or waiting on replica r now, estimated
-- (module comment: the metrics as read, moved by this edge's requests since, at least
-- the edge's own requests in flight there); those alone while the metrics are unknown.
function _M.running(model_name, r)
    local now = upstream.in_flight(model_name, r)
    local run = dict:get(key("run:", model_name, r))
    if run == nil then
        return now
    end
    run = run + (dict:get(key("wait:", model_name, r)) or 0)
    return max(now, run + now - (dict:get(key("runat:", model_name, r)) or now))
end

-- estimate(waiting, rate, most) -> s: how long until a replica that finishes `rate`
-- requests/s and has `waiting` queued may take one more: (waiting + 1) / rate (the
-- queue ahead, then the request itself, served in order), rounded up, within
-- 1..most; most when nothing finishes (rate nil or 0).
function _M.estimate(waiting, rate, most)
    if not rate or rate <= 0 then
        return most
    end
    return max(1, min(most, ceil((waiting + 1) / rate)))
end

-- finish_rate(model_name, r) -> requests/s replica r finishes (its metrics' moving
-- average), nil when unknown
function _M.finish_rate(model_name, r)
    return dict:get(key("rate:", model_name, r))
end

-- overloaded(model) -> err (503 overloaded) with Retry-After: the soonest estimate()
-- of the model's replicas.
function _M.overloaded(model)
    local most = conf.max_retry_after_s
    local s = most
    for i = 1, #model.upstreams do
        local r = model.upstreams[i]
        local rate = dict:get(key("rate:", model.name, r))
        s = min(s, _M.estimate(dict:get(key("wait:", model.name, r)) or 0, rate, most))
    end
    return errors.new(503, "Every replica of model " .. errors.clip(model.name) .. " is too "
        .. "busy to take this request now (KV cache or queue above its bounds). Please "
        .. "retry after " .. s .. " s.", nil, "overloaded", nil,
        { ["Retry-After"] = tostring(s) })
end

-- state(model_name, r) -> {kv_cache_usage, waiting, running, finish_rate, mean_ttft}
-- of replica r (mean_ttft: s), nil when unknown (for the status server).
function _M.state(model_name, r)
    local kv = dict:get(key("kv:", model_name, r))
    if kv == nil then
        return nil
    end
    return { kv_cache_usage = kv, waiting = dict:get(key("wait:", model_name, r)) or 0,
             running = dict:get(key("run:", model_name, r)) or 0,
             finish_rate = dict:get(key("rate:", model_name, r)),
             mean_ttft = dict:get(key("ttft:", model_name, r)) }
end

return _M
