-- Tracing (tokengate.yaml's tracing section): one W3C trace per request, its span data
-- written into the request's usage event, where the ledger (tokengate.ledger.tracing, off the
-- request path) turns it into OpenTelemetry spans and exports them over OTLP. The edge
-- never talks to a collector and never waits on one.
--
-- Context (W3C Trace Context, https://www.w3.org/TR/trace-context/): a request's valid
-- `traceparent` is continued (its trace id, its span as the parent, its sampled flag:
-- parent-based sampling); otherwise a trace starts with the request id as its trace id
-- ($request_id: 16 random bytes, so X-Request-Id finds the trace), sampled when the low
-- 32 bits of the trace id fall below sample_ratio * 2^32 (OpenTelemetry's
-- TraceIdRatioBased compares the low 64 bits; a Lua number holds 53). The edge's span id
-- is the first half of the request id, the upstream call's the second half: unique per
-- request, with no random source of the edge's own.
--
-- vLLM gets `traceparent: 00-<trace>-<upstream span>-<flags>` (its llm_request span, with
-- --otlp-traces-endpoint, is then a child of the upstream call's span:
-- vllm/tracing/otel.py, extract_trace_context); the client gets the edge span's
-- `traceparent` on every answer the edge's Lua sees, refusals included. A client's
-- `tracestate` (repeated headers joined with ",", as the W3C says) reaches vLLM and the
-- spans only with the valid `traceparent` it belongs to, and only as printable ASCII of
-- at most 512 characters: otherwise it is removed (vLLM refuses a request whose
-- tracestate holds control bytes). With tracing off the edge still removes trace headers
-- that are not valid, for the same reason, and forwards the valid ones unchanged.
--
-- ctx.trace = {id, parent (span id | nil), span, up, sampled, state (tracestate | nil),
-- start_ms (wall clock, epoch ms), spans = {{name, offset_ms, duration_ms}, ...},
-- t_up (monotonic ms when the request was forwarded), reasons = {finish reasons}}.
-- Offsets are from ctx.t0 (the access phase's start, monotonic).

local ngx = ngx
local json = require "tokengate.json"
local clock = require "tokengate.clock"
local request_id = require("tokengate.state").request_id

local sub, find = string.sub, string.find
local max = math.max
local tonumber, type = tonumber, type
local re_find, ngx_var, ngx_req = ngx.re.find, ngx.var, ngx.req
local mono_ms, round3 = clock.mono_ms, clock.round3
local null = json.null

local _M = {}

local concat = table.concat
local ngx_get_headers = ngx.req.get_headers
local ZERO_TRACE = "00000000000000000000000000000000"
local ZERO_SPAN = "0000000000000000"
local TWO32 = 4294967296
local MAX_TRACESTATE = 512 -- W3C: at most 32 list members; longer headers are dropped

-- parse(header) -> trace id, parent span id, sampled | nil: a W3C traceparent
-- (version 00 exactly four fields; a later version may add fields after a '-'; version
-- ff, all-zero ids and upper-case hex are invalid; so is a repeated header, which
-- arrives as a table).
local function parse(header)
    if type(header) ~= "string" or #header < 55 then
        return nil
    end
    if not re_find(header, [[^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-|$)]], "jo") then
        return nil
    end
    local version = sub(header, 1, 2)
    if version == "ff" or (version == "00" and #header ~= 55) then
        return nil
    end
    local id, parent = sub(header, 4, 35), sub(header, 37, 52)
    if id == ZERO_TRACE or parent == ZERO_SPAN then
        return nil
    end
    local flags = tonumber(sub(header, 54, 55), 16)
    return id, parent, flags % 2 == 1
end
_M.parse = parse

-- nonzero(span_id) -> span_id, or one that is not all zeros (W3C forbids it)
local function nonzero(id)
    if id == ZERO_SPAN then
        return "0000000000000001"
    end
    return id
end

-- received() -> the client's traceparent (string, or a table when repeated) and its
-- tracestate (repeated headers joined) | nil each. The whole header list is read only
-- when one of them is there: nginx 1.22's $http_* variables hold a repeated header's
-- first value only.
local function received()
    if not ngx_var.http_traceparent and not ngx_var.http_tracestate then
        return nil, nil
    end
    local h = ngx_get_headers(100)
    local tp, ts = h["traceparent"], h["tracestate"]
    if type(ts) == "table" then
        ts = concat(ts, ",")
    end
    return tp, ts
end

-- valid_state(ts) -> ts when it may be forwarded: printable ASCII, 1..512 characters
local function valid_state(ts)
    if type(ts) ~= "string" or ts == "" or #ts > MAX_TRACESTATE
            or not re_find(ts, [[^[\x20-\x7e]+$]], "jo") then
        return nil
    end
    return ts
end

-- forwarded(state, ts_sent): vLLM gets tracestate only as ``state``: the client's
-- header (ts_sent) is replaced when it was joined, removed when it is not valid
local function forwarded(state, ts_sent)
    if state then
        if state ~= ngx_var.http_tracestate then
            ngx_req.set_header("tracestate", state)
        end
    elseif ts_sent then
        ngx_req.clear_header("tracestate")
    end
end

-- start(ctx, tracing): the request's trace (ctx.trace), when tracing.enabled; tracing:
-- the compiled document's tracing section {enabled, sample_ratio (0..1)}. With tracing
-- off, only the client's trace headers that are not valid are removed.
function _M.start(ctx, tracing)
    local tp, ts = received()
    local id, parent, sampled = parse(tp)
    local tracestate = id and valid_state(ts) or nil
    if not tracing.enabled then
        if tp and not id then
            ngx_req.clear_header("traceparent")
        end
        return forwarded(tracestate, ts)
    end
    forwarded(tracestate, ts)
    local rid = request_id(ctx)
    if not id then
        id = rid
        sampled = tonumber(sub(id, 25, 32), 16) < tracing.sample_ratio * TWO32
    end
    ctx.trace = {
        id = id, parent = parent, sampled = sampled, state = tracestate,
        span = nonzero(sub(rid, 1, 16)), up = nonzero(sub(rid, 17, 32)),
        start_ms = ngx_req.start_time() * 1000, spans = {},
    }
end

-- span(ctx, name, t_start): a child span of the edge's from t_start (monotonic ms) to
-- now; nothing without a trace.
function _M.span(ctx, name, t_start)
    local tr = ctx.trace
    if not tr then
        return
    end
    local s = tr.spans
    s[#s + 1] = { name, round3(t_start - ctx.t0), round3(mono_ms() - t_start) }
end

-- flags(tr) -> the traceparent's flags field
local function flags(tr)
    return tr.sampled and "01" or "00"
end

-- forward(ctx): the upstream call's traceparent on the request to vLLM; the upstream
-- span starts now.
function _M.forward(ctx)
    local tr = ctx.trace
    if not tr then
        return
    end
    tr.t_up = mono_ms()
    ngx_req.set_header("traceparent", "00-" .. tr.id .. "-" .. tr.up .. "-" .. flags(tr))
end

-- header(ctx) -> the edge span's traceparent for the answer, or nil without a trace
function _M.header(ctx)
    local tr = ctx.trace
    if not tr then
        return nil
    end
    return "00-" .. tr.id .. "-" .. tr.span .. "-" .. flags(tr)
end

-- reasons(ctx, text): the finish reasons written in one SSE event or JSON body, in
-- order: the request's API's FINISH_FIELD ("finish_reason" of OpenAI's APIs,
-- "stop_reason" of the Messages API; one key per request: a stream has an event per
-- token). A plain find: a quote inside generated text is escaped, so the key is never
-- the model's own text.
function _M.reasons(ctx, text)
    local tr = ctx.trace
    if not tr then
        return
    end
    local key = '"' .. ctx.api.FINISH_FIELD .. '":"'
    local init = 1
    while true do
        local _, e = find(text, key, init, true)
        if not e then
            return
        end
        local q = find(text, '"', e + 1, true)
        if not q or q - e > 65 then
            return
        end
        local r = tr.reasons
        if not r then
            r = {}
            tr.reasons = r
        end
        if #r < 16 then
            r[#r + 1] = sub(text, e + 1, q - 1)
        end
        init = q + 1
    end
end

-- record(ctx, status, aborted, error) -> the usage event's trace object, or nil when the
-- request is not traced or not sampled and neither refused, failed nor aborted (those
-- are always kept). Shape (tokengate/ledger/event.py, Trace): trace_id, span_id,
-- parent_span_id (null: the trace started here), upstream_span_id (null: not
-- forwarded), sampled, tracestate (or null), start_ms (wall clock, epoch ms), spans
-- [[name, offset_ms, duration_ms], ...] ("count", "queue", "limits"; offsets from the
-- start of the access phase), upstream [offset_ms, duration_ms] (or null),
-- finish_reasons [...].
function _M.record(ctx, status, aborted, error)
    local tr = ctx.trace
    if not tr or not (tr.sampled or status >= 400 or aborted or error) then
        return nil
    end
    local o = json.object()
    local set = json.set
    set(o, "trace_id", tr.id)
    set(o, "span_id", tr.span)
    set(o, "parent_span_id", tr.parent or null)
    set(o, "upstream_span_id", tr.t_up and tr.up or null)
    set(o, "sampled", tr.sampled == true)
    set(o, "tracestate", tr.state or null)
    set(o, "start_ms", tr.start_ms)
    local spans = {}
    for i = 1, #tr.spans do
        spans[i] = json.array(tr.spans[i])
    end
    set(o, "spans", json.array(spans))
    local t0 = ctx.t0
    if tr.t_up and t0 then
        set(o, "upstream", json.array({ round3(tr.t_up - t0), round3(max(0, mono_ms() - tr.t_up)) }))
    else
        set(o, "upstream", null)
    end
    set(o, "finish_reasons", json.array(tr.reasons or {}))
    return o
end

return _M
