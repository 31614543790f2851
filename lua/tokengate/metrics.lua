-- Edge metrics: counters and histograms in a lua_shared_dict shared by all workers, served
-- by the loopback status server (edge.status_listen, tokengate-http.conf) in two views of
-- the same entries: /metrics in Prometheus's text format (version 0.0.4) and
-- /tokengate/status as JSON (the STATUS counters below, named as before).
--
-- Counters only ever grow (since nginx started; a reload keeps them, a restart clears
-- them), so a scraper takes rates from differences. incr with an init value is atomic
-- across workers; nothing here reads a value to write it back.
--
-- Entries: "<family>\t<labels>" for a counter, "<family>\t<labels>\t<i>" for the
-- observations of a histogram that fell into bucket i (not cumulative: one incr per
-- observation; the exposition adds them up) and "<family>\t<labels>\ts" for their sum.
-- <labels> is the exposition's own text (key="demo",model="tiny-qwen3"), so a scrape
-- only splits keys. Label values come from the configuration (key ids, model and
-- replica names) or from fixed sets, never from the client: the number of series is
-- bounded by the configuration (NONE stands for "no key", "no model" and "unknown").
-- (Over 600 lines: the families, their per-worker label memos and both views read one
-- entry format, so they stay in one module.)

local ngx = ngx
local json = require "tokengate.json"
local shdict = require "tokengate.shdict"

local ngx_log, ERR = ngx.log, ngx.ERR
local tostring, tonumber = tostring, tonumber
local find, sub, gsub, match = string.find, string.sub, string.gsub, string.match
local concat, sort = table.concat, table.sort
local pairs = pairs
local floor = math.floor

local _M = {}

_M.NONE = "none"

-- Bucket bounds, seconds.
local LATENCY = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60 }
local DURATION = { 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600 }
local FAST = { 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1 }
-- relative errors, (predicted - observed) / observed
local ERROR = { -0.5, -0.25, -0.1, -0.05, 0, 0.05, 0.1, 0.25, 0.5, 1 }

-- The families, in the order /metrics lists them: name, type, help[, buckets]. Gauges are
-- not stored: the status server passes their samples at scrape time (exposition()).
local FAMILIES = {
    { "tokengate_requests_total", "counter",
      "Requests that ended, by API key, model, endpoint (chat, completions, messages, "
      .. "count_tokens, responses, input_tokens, response, response_cancel, embeddings, "
      .. "models, model, key, other) and status class (2xx..5xx)." },
    { "tokengate_prompt_tokens_total", "counter",
      "Prompt tokens billed (the usage events' prompt_tokens), by API key and model." },
    { "tokengate_completion_tokens_total", "counter",
      "Completion tokens billed (the usage events' completion_tokens), by API key and model." },
    { "tokengate_cached_tokens_total", "counter",
      "Prompt tokens served from vLLM's prefix cache (the usage events' cached_tokens), "
      .. "by API key and model." },
    { "tokengate_prefix_expected_tokens_total", "counter",
      "Prompt tokens the chosen replica was expected to serve from its prefix cache "
      .. "(routing.policy prefix; the usage events' expected_cached_tokens), forwarded "
      .. "requests with usage from vLLM, by model and source of the prediction (events: "
      .. "the counter's index of the replica's KV events; approximate: the edge's)." },
    { "tokengate_prefix_cached_tokens_total", "counter",
      "Prompt tokens vLLM served from its prefix cache (cached_tokens) for those same "
      .. "requests, by model and source of their prediction." },
    { "tokengate_prefix_overestimated_tokens_total", "counter",
      "Expected cached tokens that vLLM did not serve from its cache (per request, "
      .. "expected - cached when positive), by model and source: 1 - this / expected is "
      .. "the prediction's hit rate." },
    { "tokengate_rate_limited_total", "counter",
      "Requests refused with 429 by a key's limit, by API key, limit (rpm, tpm), tier "
      .. "(local, global) and the level whose window refused (key, team, org)." },
    { "tokengate_prompt_counts_total", "counter",
      "Prompts counted, by model and source (counter: exact; estimate: the counter was "
      .. "unavailable)." },
    { "tokengate_count_drift_requests_total", "counter",
      "Requests whose usage.prompt_tokens from vLLM differed from the counter's count." },
    { "tokengate_count_drift_tokens_total", "counter",
      "Sum of those differences, absolute, tokens." },
    { "tokengate_sanitizer_actions_total", "counter",
      "What the sanitizer did, by action: remove_invisible_char (characters), "
      .. "strip_special_token (tokens), escape_special_token (tokens), "
      .. "drop_repeated_system_message (messages), "
      .. "refuse_special_token (requests refused)." },
    { "tokengate_global_limit_decisions_total", "counter",
      "Answers of the global (Redis) tier, by result (admitted, refused)." },
    { "tokengate_global_limit_fallbacks_total", "counter",
      "Requests admitted on the local limits alone because the global tier failed, by "
      .. "reason (unavailable, down, timeout, error, backoff)." },
    { "tokengate_global_limit_settlements_total", "counter",
      "Settlements of the global tier, windows' and budgets', by result (applied, failed, "
      .. "dropped)." },
    { "tokengate_global_budget_decisions_total", "counter",
      "Answers of the keys' budgets in Redis (global tier), by result (admitted, refused; "
      .. "fallback: Redis's counters could not be asked, the edge's own decided)." },
    { "tokengate_unauthenticated_requests_total", "counter",
      "Requests without a valid API key (no usage event), by reason (missing_key, "
      .. "invalid_key, blocked, refused)." },
    { "tokengate_admission_shed_total", "counter",
      "Requests answered 503 overloaded before reserving: every replica's KV cache or "
      .. "queue above the bounds of the key's priority (tokengate.admission; each has a "
      .. "usage event)." },
    { "tokengate_admission_headroom_total", "counter",
      "Small prompts sent to a replica above its KV-cache threshold "
      .. "(edge.admission.small_prompt_headroom)." },
    { "tokengate_admission_held_total", "counter",
      "Requests that found every replica full for their priority and waited for room "
      .. "(edge.admission.priorities.<name>.hold_ms; those still without room then were "
      .. "shed too)." },
    { "tokengate_idle_sleeps_total", "counter",
      "Replicas put to sleep after models.<name>.idle_unload.idle_s without a request "
      .. "(tokengate.idle)." },
    { "tokengate_idle_wakes_total", "counter",
      "Replicas woken again (POST /wake_up answered awake)." },
    { "tokengate_idle_held_total", "counter",
      "Requests held while their replica woke from idle unload (each has a usage event)." },
    { "tokengate_idle_wake_timeouts_total", "counter",
      "Held requests answered 503 model_waking: the wake took longer than "
      .. "idle_unload.max_hold_ms (also in tokengate_idle_held_total)." },
    { "tokengate_cors_preflights_total", "counter",
      "Browser preflights (OPTIONS with Origin) answered by the edge, by result (allowed: "
      .. "204; refused: an origin edge.cors does not list, a path that is no route, or a "
      .. "bad header list)." },
    { "tokengate_auth_blocks_total", "counter",
      "Clients blocked after too many invalid keys (edge.auth_failures)." },
    { "tokengate_access_log_lines_total", "counter",
      "Lines written to the sampled access log." },
    { "tokengate_unauthenticated_log_lines_total", "counter",
      "Access-log lines of requests without a valid key (also in "
      .. "tokengate_access_log_lines_total)." },
    { "tokengate_time_to_first_token_seconds", "histogram",
      "Time from the request's arrival to the first byte of vLLM's answer, forwarded "
      .. "requests, by model.", LATENCY },
    { "tokengate_request_duration_seconds", "histogram",
      "Time from the request's arrival to its end, forwarded requests, by model.", DURATION },
    { "tokengate_count_duration_seconds", "histogram",
      "Time to count a prompt (the counter's call, or the edge's cache of its answers).",
      FAST },
    { "tokengate_upstream_connect_duration_seconds", "histogram",
      "Time to connect to the replica (nginx's $upstream_connect_time, last try), by model.",
      FAST },
    { "tokengate_queue_wait_seconds", "histogram",
      "Time a request waited in its key's queue (edge.queue) until it was dispatched, "
      .. "by model.", DURATION },
    { "tokengate_slo_prediction_error", "histogram",
      "Relative error of the predicted TTFT, (predicted - observed) / observed, of the "
      .. "requests routed by routing.policy slo (tokengate.slo), by model and replica.",
      ERROR },
    { "tokengate_queue_dispatched_total", "counter",
      "Queued requests dispatched to a replica, by API key and model." },
    { "tokengate_queue_refused_total", "counter",
      "Requests that queued in vain or could not queue, by reason (key_full: 429 "
      .. "queue_full; full: the edge's bounds, 503 overloaded; timeout: 503 "
      .. "queue_timeout; left: the client went away while waiting)." },
    { "tokengate_queue_requests", "gauge",
      "Requests waiting in the queues now, by priority." },
    { "tokengate_queue_tokens", "gauge",
      "Tokens (prompt + reserved completion) waiting in the queues now, by priority." },
    { "tokengate_upstream_up", "gauge",
      "1 while the replica takes requests, 0 while it is out (failed, health probe, no "
      .. "address), by model and replica." },
    { "tokengate_upstream_outstanding_tokens", "gauge",
      "Reserved tokens of the requests the replica is serving now, by model and replica." },
    { "tokengate_prefix_capacity_blocks", "gauge",
      "A replica's KV cache in blocks as the approximate prefix index counts it (vLLM's "
      .. "num_gpu_blocks, else a default of 8192), by model and replica." },
    { "tokengate_slo_backlog_seconds", "gauge",
      "The TTFT predicted now for a request with nothing of its own to prefill, averaged "
      .. "over the model's replicas that are not out (routing.policy slo): the prefill "
      .. "queued there and their running requests in seconds of predicted time; an "
      .. "autoscaling signal, by model." },
    { "tokengate_prefix_index_capacity_bytes", "gauge",
      "Size of this edge's approximate prefix index (lua_shared_dict tokengate_prefix)." },
    { "tokengate_prefix_index_free_bytes", "gauge",
      "Free bytes of that index (whole free pages); near 0 it evicts its least recently "
      .. "used blocks." },
}
local FAMILY = {}
for i = 1, #FAMILIES do
    FAMILY[FAMILIES[i][1]] = FAMILIES[i]
end

-- The counters of /tokengate/status: name -> family and labels (global_fallback, the sum
-- of the five fallback reasons, is added up when the page is made).
local STATUS = {
    { "global_admitted", "tokengate_global_limit_decisions_total", 'result="admitted"' },
    { "global_refused", "tokengate_global_limit_decisions_total", 'result="refused"' },
    { "global_fallback_unavailable", "tokengate_global_limit_fallbacks_total",
      'reason="unavailable"' },
    { "global_fallback_down", "tokengate_global_limit_fallbacks_total", 'reason="down"' },
    { "global_fallback_timeout", "tokengate_global_limit_fallbacks_total", 'reason="timeout"' },
    { "global_fallback_error", "tokengate_global_limit_fallbacks_total", 'reason="error"' },
    { "global_fallback_backoff", "tokengate_global_limit_fallbacks_total", 'reason="backoff"' },
    { "global_settled", "tokengate_global_limit_settlements_total", 'result="applied"' },
    { "global_settle_failed", "tokengate_global_limit_settlements_total", 'result="failed"' },
    { "global_settle_dropped", "tokengate_global_limit_settlements_total", 'result="dropped"' },
    { "global_budget_admitted", "tokengate_global_budget_decisions_total", 'result="admitted"' },
    { "global_budget_refused", "tokengate_global_budget_decisions_total", 'result="refused"' },
    { "global_budget_fallback", "tokengate_global_budget_decisions_total", 'result="fallback"' },
    { "access_log_lines", "tokengate_access_log_lines_total", "" },
    { "unauthenticated_missing_key", "tokengate_unauthenticated_requests_total",
      'reason="missing_key"' },
    { "unauthenticated_invalid_key", "tokengate_unauthenticated_requests_total",
      'reason="invalid_key"' },
    { "unauthenticated_blocked", "tokengate_unauthenticated_requests_total",
      'reason="blocked"' },
    { "unauthenticated_refused", "tokengate_unauthenticated_requests_total",
      'reason="refused"' },
    { "unauthenticated_log_lines", "tokengate_unauthenticated_log_lines_total", "" },
    { "auth_blocks", "tokengate_auth_blocks_total", "" },
    { "cors_preflight_allowed", "tokengate_cors_preflights_total", 'result="allowed"' },
    { "cors_preflight_refused", "tokengate_cors_preflights_total", 'result="refused"' },
    { "count_drift_requests", "tokengate_count_drift_requests_total", "" },
    { "count_drift_tokens", "tokengate_count_drift_tokens_total", "" },
    { "admission_shed", "tokengate_admission_shed_total", "" },
    { "admission_headroom", "tokengate_admission_headroom_total", "" },
    { "admission_held", "tokengate_admission_held_total", "" },
    { "idle_sleeps", "tokengate_idle_sleeps_total", "" },
    { "idle_wakes", "tokengate_idle_wakes_total", "" },
    { "idle_held", "tokengate_idle_held_total", "" },
    { "idle_wake_timeouts", "tokengate_idle_wake_timeouts_total", "" },
}
local STATUS_KEY = {}
for i = 1, #STATUS do
    STATUS_KEY[STATUS[i][1]] = STATUS[i][2] .. "\t" .. STATUS[i][3]
end

local dict

-- init(dict_name) -> true | nil, "shared dict not found: <name>"
function _M.init(dict_name)
    dict = shdict.get(dict_name)
    return shdict.found(dict, dict_name)
end

-- value(v) -> v as a label value: \, " and newline escaped (exposition format)
function _M.value(v)
    v = tostring(v)
    if find(v, '[\\"\n]') then
        v = gsub(gsub(gsub(v, "\\", "\\\\"), '"', '\\"'), "\n", "\\n")
    end
    return v
end

local function add(k, n)
    local ok, err = dict:incr(k, n, 0)
    if not ok then
        ngx_log(ERR, "tokengate metrics: incr ", k, ": ", err)
    end
end

-- count(family, labels, n?): adds n (default 1) to a counter of a declared family;
-- labels: the exposition's label text ('key="demo",model="m"', values through value()).
function _M.count(family, labels, n)
    if dict then
        add(family .. "\t" .. labels, n or 1)
    end
end

-- SERIES[family][labels] -> the dict keys of one histogram's series: [i] the
-- observations of bucket i, .s their sum. Made once per worker and series (label values
-- are bounded by the configuration, see the module comment): the log phase of every
-- request observes several histograms, and concatenating their keys each time was most
-- of what an observation cost.
local SERIES = {}

-- sub_table(t, k) -> t[k], a table, made empty on first use (the memos below)
local function sub_table(t, k)
    local v = t[k] or {}
    t[k] = v
    return v
end

local function series_keys(family, labels)
    local by_labels = sub_table(SERIES, family)
    local keys = by_labels[labels]
    if not keys then
        local k = family .. "\t" .. labels .. "\t"
        keys = { s = k .. "s" }
        for i = 1, #FAMILY[family][4] + 1 do
            keys[i] = k .. i
        end
        by_labels[labels] = keys
    end
    return keys
end

-- observe(family, labels, seconds): one observation of a declared histogram.
function _M.observe(family, labels, seconds)
    if not dict then
        return
    end
    local bounds = FAMILY[family][4]
    local i = #bounds + 1
    for b = 1, #bounds do
        if seconds <= bounds[b] then
            i = b
            break
        end
    end
    local keys = series_keys(family, labels)
    add(keys[i], 1)
    add(keys.s, seconds)
end

-- incr(name, n?): adds n (default 1) to a counter of /tokengate/status (STATUS).
function _M.incr(name, n)
    local k = STATUS_KEY[name]
    if not k then
        ngx_log(ERR, "tokengate metrics: no status counter ", name)
    elseif dict then
        add(k, n or 1)
    end
end

-- first_in(key, seconds) -> true for the first call with key in each period of that
-- many seconds, across all workers (add is atomic; its ttl ends the period): what
-- bounds a repeated log line. A full dict answers false: better a missed line than a
-- flood. (Keys without a tab: never part of the exposition.)
function _M.first_in(key, seconds)
    return dict ~= nil and dict:add(key, true, seconds) == true
end

-- queue_wait(model, seconds): one queued request's wait (tokengate.queue).
function _M.queue_wait(model, seconds)
    _M.observe("tokengate_queue_wait_seconds", 'model="' .. _M.value(model) .. '"', seconds)
end

-- slo_error(model, replica, err): one relative error of a TTFT prediction
function _M.slo_error(model, replica, err)
    _M.observe("tokengate_slo_prediction_error", 'model="' .. _M.value(model)
        .. '",replica="' .. _M.value(replica) .. '"', err)
end

-- queue_dispatched(key_id, model): one queued request dispatched.
function _M.queue_dispatched(key_id, model)
    _M.count("tokengate_queue_dispatched_total", 'key="' .. _M.value(key_id)
        .. '",model="' .. _M.value(model) .. '"')
end

-- queue_refused(reason): one request that could not queue or waited in vain
-- (key_full, full, timeout, left).
function _M.queue_refused(reason)
    _M.count("tokengate_queue_refused_total", 'reason="' .. reason .. '"')
end

-- get(name) -> the status counter's value (0 when never incremented)
function _M.get(name)
    return dict and dict:get(STATUS_KEY[name]) or 0
end

-- json_text(extra) -> {"<counter>": n, ..., <extra fields>} as JSON text; extra: a
-- json.object whose fields are appended (state that is not a counter).
function _M.json_text(extra)
    local o = json.object()
    local fallback = 0
    for i = 1, #STATUS do
        local name = STATUS[i][1]
        if sub(name, 1, 16) == "global_fallback_" then
            fallback = fallback + _M.get(name)
        end
    end
    for i = 1, #STATUS do
        local name = STATUS[i][1]
        json.set(o, name, _M.get(name))
        if name == "global_refused" then
            json.set(o, "global_fallback", fallback)
        end
    end
    if extra then
        local keys = extra[json.KEYS]
        for i = 1, #keys do
            json.set(o, keys[i], extra[keys[i]])
        end
    end
    return json.encode(o)
end

local LIMIT = { requests = "rpm", tokens = "tpm" }

-- connect_s(v) -> nginx's $upstream_connect_time of the last try, seconds, or nil
-- ("0.001, 0.000" after a retry; "-" when it never connected)
local function connect_s(v)
    return v and tonumber((match(v, "([%d%.]+)%s*$")))
end

-- request(ctx, status, ev, models): the log phase's record of one request. ctx: the
-- phases' fields (key, model, route, count_source, count_s, sanitized, error,
-- limit_req, limits_tier, proxied); status: the status sent; ev: its usage event
-- (usage.record) or nil (no valid key: nothing billed); models: the configuration's
-- models (a model label must name one); upstream_connect_time: nginx's variable.
-- LABELS[key id][model name] -> the label texts of one key and model (raw names; NONE
-- when absent: key, km, m) and the dict keys of the per-request counters, made on first
-- use (the prompt counts' by source, the prefix predictions' by source, the requests'
-- by route and status class: requests_key). Per worker, bounded by the configuration's
-- keys and models: request() no longer joins the same strings on every request.
local LABELS = {}

local function labels_of(key_id, model)
    local by_model = sub_table(LABELS, key_id)
    local l = by_model[model]
    if not l then
        local key = key_id == _M.NONE and key_id or _M.value(key_id)
        local mv = model == _M.NONE and model or _M.value(model)
        local km = 'key="' .. key .. '",model="' .. mv .. '"'
        l = { key = key, km = km, m = 'model="' .. mv .. '"',
              prompt = "tokengate_prompt_tokens_total\t" .. km,
              completion = "tokengate_completion_tokens_total\t" .. km,
              cached = "tokengate_cached_tokens_total\t" .. km,
              requests = {}, counts = {}, prefix = {} }
        by_model[model] = l
    end
    return l
end

-- requests_key(l, endpoint, status) -> the dict key of tokengate_requests_total for the
-- label set l (labels_of), a route name and a status; kept in l per route and class
local function requests_key(l, endpoint, status)
    local class = (status >= 100 and status < 600) and floor(status / 100) or 5
    local by_class = sub_table(l.requests, endpoint)
    local k = by_class[class]
    if not k then
        k = "tokengate_requests_total\t" .. l.km .. ',endpoint="' .. endpoint
            .. '",status="' .. class .. 'xx"'
        by_class[class] = k
    end
    return k
end

function _M.request(ctx, status, ev, models, upstream_connect_time)
    if not dict then
        return
    end
    local l = labels_of(ctx.key and ctx.key.id or _M.NONE,
        ctx.model and models[ctx.model] and ctx.model or _M.NONE)
    local key, m = l.key, l.m
    -- a route's name (tokengate.apis: a fixed set), or "other" for a path that is none
    add(requests_key(l, ctx.route or "other", status), 1)
    if ev then
        local p, c, cached = ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens
        if p > 0 then
            add(l.prompt, p)
        end
        if c > 0 then
            add(l.completion, c)
        end
        if cached > 0 then
            add(l.cached, cached)
        end
        local source = ctx.prefix_source
        if source and ctx.proxied and (ev.usage_source == "final"
                or ev.usage_source == "running") then
            local pk = l.prefix[source]
            if not pk then
                local labels = m .. ',source="' .. source .. '"'
                pk = { expected = "tokengate_prefix_expected_tokens_total\t" .. labels,
                       cached = "tokengate_prefix_cached_tokens_total\t" .. labels,
                       over = "tokengate_prefix_overestimated_tokens_total\t" .. labels }
                l.prefix[source] = pk
            end
            local expected = ev.expected_cached_tokens
            if expected > 0 then
                add(pk.expected, expected)
            end
            if cached > 0 then
                add(pk.cached, cached)
            end
            if expected > cached then
                add(pk.over, expected - cached)
            end
        end
    end
    local req = ctx.limit_req
    local st = req and not req.admitted and req.state
    if status == 429 and st and st.reject then
        add('tokengate_rate_limited_total\tkey="' .. key .. '",limit="' .. LIMIT[st.reject]
            .. '",tier="' .. (ctx.limits_tier or "local") .. '",level="'
            .. (st.level and st.level.level or "key") .. '"', 1)
    end
    local count_source = ctx.count_source
    if count_source == "counter" or count_source == "estimate" then
        local k = l.counts[count_source]
        if not k then
            k = "tokengate_prompt_counts_total\t" .. m .. ',source="' .. count_source .. '"'
            l.counts[count_source] = k
        end
        add(k, 1)
        if ctx.count_s then
            _M.observe("tokengate_count_duration_seconds", "", ctx.count_s)
        end
    end
    local counts = ctx.sanitized
    if counts then
        local A = "tokengate_sanitizer_actions_total\taction="
        if counts.removed > 0 then
            add(A .. '"remove_invisible_char"', counts.removed)
        end
        if counts.stripped > 0 then
            add(A .. '"strip_special_token"', counts.stripped)
        end
        if counts.escaped > 0 then
            add(A .. '"escape_special_token"', counts.escaped)
        end
        if counts.collapsed > 0 then
            add(A .. '"drop_repeated_system_message"', counts.collapsed)
        end
    end
    if ctx.error == "special_token_in_content" then
        add('tokengate_sanitizer_actions_total\taction="refuse_special_token"', 1)
    end
    if ctx.proxied and ev then
        if ev.ttft_ms ~= json.null then
            _M.observe("tokengate_time_to_first_token_seconds", m, ev.ttft_ms / 1000)
        end
        _M.observe("tokengate_request_duration_seconds", m, ev.total_ms / 1000)
        local cs = connect_s(upstream_connect_time)
        if cs then
            _M.observe("tokengate_upstream_connect_duration_seconds", m, cs)
        end
    end
end

-- sorted_keys(t) -> t's keys, sorted
local function sorted_keys(t)
    local ks, n = {}, 0
    for k in pairs(t) do
        n = n + 1
        ks[n] = k
    end
    sort(ks)
    return ks
end

-- with_le(labels, le) -> the label text of a bucket
local function with_le(labels, le)
    if labels == "" then
        return 'le="' .. le .. '"'
    end
    return labels .. ',le="' .. le .. '"'
end

-- histogram(out, n, name, bounds, series) -> n: the _bucket (cumulative, +Inf last),
-- _sum and _count lines of every label set of one family.
local function histogram(out, n, name, bounds, series)
    local ls = sorted_keys(series)
    for j = 1, #ls do
        local labels, s = ls[j], series[ls[j]]
        local cum = 0
        for b = 1, #bounds + 1 do
            cum = cum + (s[b] or 0)
            local le = b <= #bounds and tostring(bounds[b]) or "+Inf"
            n = n + 1
            out[n] = name .. "_bucket{" .. with_le(labels, le) .. "} " .. cum
        end
        local braces = labels == "" and "" or "{" .. labels .. "}"
        out[n + 1] = name .. "_sum" .. braces .. " " .. tostring(s.sum or 0)
        out[n + 2] = name .. "_count" .. braces .. " " .. cum
        n = n + 2
    end
    return n
end

-- exposition(gauges) -> the text of /metrics (Content-Type: text/plain; version=0.0.4)
--   gauges: {[family] = {[labels] = value}} for the gauge families (state read at
--   scrape time). Every declared family gets its HELP and TYPE lines; label sets are
--   sorted, so two scrapes list series in the same order.
-- get_keys(0) locks the dict while it copies the keys: a scrape's cost grows with the
-- number of series, which the configuration bounds.
function _M.exposition(gauges)
    local by = {}
    if dict then
        local keys = dict:get_keys(0)
        for i = 1, #keys do
            local k = keys[i]
            local t1 = find(k, "\t", 1, true)
            local fam = t1 and FAMILY[sub(k, 1, t1 - 1)]
            local v = fam and dict:get(k)
            if v then
                local name = fam[1]
                local series = by[name]
                if not series then
                    series = {}
                    by[name] = series
                end
                if fam[2] == "histogram" then
                    local t2 = find(k, "\t", t1 + 1, true)
                    local labels, slot = sub(k, t1 + 1, t2 - 1), sub(k, t2 + 1)
                    local s = series[labels]
                    if not s then
                        s = {}
                        series[labels] = s
                    end
                    if slot == "s" then
                        s.sum = v
                    else
                        s[tonumber(slot)] = v
                    end
                else
                    series[sub(k, t1 + 1)] = v
                end
            end
        end
    end
    -- the status counters' series are known in advance: each is exposed from the start,
    -- at 0 until counted (as Prometheus's client libraries expose a counter without
    -- labels), so a rate over them reads 0 instead of no data
    for i = 1, #STATUS do
        local name, labels = STATUS[i][2], STATUS[i][3]
        local series = by[name]
        if not series then
            series = {}
            by[name] = series
        end
        if not series[labels] then
            series[labels] = 0
        end
    end
    local out, n = {}, 0
    for i = 1, #FAMILIES do
        local f = FAMILIES[i]
        local name, typ = f[1], f[2]
        out[n + 1] = "# HELP " .. name .. " " .. f[3]
        out[n + 2] = "# TYPE " .. name .. " " .. typ
        n = n + 2
        local series = typ == "gauge" and gauges and gauges[name] or by[name]
        if typ == "histogram" then
            n = histogram(out, n, name, f[4], series or {})
        elseif series then
            local ls = sorted_keys(series)
            for j = 1, #ls do
                local labels = ls[j]
                n = n + 1
                out[n] = name .. (labels == "" and "" or "{" .. labels .. "}") .. " "
                    .. tostring(series[labels])
            end
        end
    end
    out[n + 1] = ""
    return concat(out, "\n")
end

return _M
