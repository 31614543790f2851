-- Usage: what the model really consumed, read from vLLM's responses as they pass, and the
-- usage event line written for every request.
--
-- Streams: the edge asks vLLM for continuous_usage_stats, so every SSE chunk carries the
-- cumulative usage so far: the last value seen wins, values are never
-- added up, and a client that disconnects is billed the last chunk the edge saw. What
-- the client did not ask for is removed on the way out: the per-chunk usage (unless it
-- asked for continuous_usage_stats) and the final `"choices": []` usage chunk (unless it
-- asked for include_usage).
--
-- Each event, and each whole answer, is read by the request's API module
-- (ctx.api.sse_event, ctx.api.whole_usage: tokengate.api); OpenAI's shapes, the
-- defaults, are read here (openai_event, openai_whole), and the named events of other
-- APIs ("event: <type>\ndata: <json>") with named_event.
--
-- ctx fields used: stream, want_usage, want_continuous (tokengate.state).
-- ctx fields written: u_prompt, u_completion, u_cached (tokens), u_source
-- ("final" | "running"), sse_rest (partial event), sse_done ("data: [DONE]" seen),
-- json_parts (non-stream body), error.

local ngx = ngx
local ffi = require "ffi"
local cjson = require "cjson.safe"
local json = require "tokengate.json"
local clock = require "tokengate.clock"
local errors = require "tokengate.errors"
local state = require "tokengate.state"
local drift = require "tokengate.drift"
local trace = require "tokengate.trace"
local batch = require "tokengate.batch"

local find, sub, byte = string.find, string.sub, string.byte
local concat = table.concat
local tonumber, type = tonumber, type
local max = math.max
local ngx_var, ngx_req, ngx_now = ngx.var, ngx.req, ngx.now
local mono_ms, round3 = clock.mono_ms, clock.round3
local cast = ffi.cast
local u8p = ffi.typeof("const uint8_t *")

local _M = {}

-- count_after(text, key) -> the number written after key in text, what
-- match(text, key .. "%s*(%d+)") finds (key plain), or nil. A plain find and a byte scan:
-- LuaJIT compiles them, where string.match leaves the trace, and a stream reads three
-- counts from every chunk.
local function count_after(text, key)
    local init = 1
    while true do
        local _, e = find(text, key, init, true)
        if not e then
            return nil
        end
        local i = e + 1
        local b = byte(text, i)
        while b == 32 or (b and b >= 9 and b <= 13) do -- %s
            i = i + 1
            b = byte(text, i)
        end
        local j = i
        while b and b >= 48 and b <= 57 do
            j = j + 1
            b = byte(text, j)
        end
        if j > i then
            return sub(text, i, j - 1)
        end
        init = e + 1
    end
end

-- read_usage(ctx, usage_text, final): stores the cumulative counts of one usage object
-- (text of {"prompt_tokens":..}) in ctx; final marks the last ("choices": []) chunk.
local function read_usage(ctx, usage_text, final)
    local p = count_after(usage_text, '"prompt_tokens":')
    local c = count_after(usage_text, '"completion_tokens":')
    if not p and not c then
        return
    end
    ctx.u_prompt = tonumber(p) or ctx.u_prompt or 0
    ctx.u_completion = tonumber(c) or 0
    local cached = count_after(usage_text, '"cached_tokens":')
    if cached then
        ctx.u_cached = tonumber(cached)
    end
    ctx.u_source = final and "final" or "running"
end

-- SPACE: the bytes of Lua's %s (C isspace: space, \t \n \v \f \r)
local SPACE = ffi.new("uint8_t[256]")
SPACE[32] = 1
for b = 9, 13 do
    SPACE[b] = 1
end

-- usage_object(ev, p, init) -> first, last (1-based, inclusive) of the object after the
-- first '"usage":' at or after init that is followed by %s* and a balanced {...}, and
-- where that '"usage":' starts | nil. p: ev's bytes (FFI pointer). What
-- find(ev, '"usage":%s*(%b{})', init) finds, scanned byte by byte: %b{} counts braces
-- and nothing else (braces inside JSON strings count too, as they do for the pattern),
-- and a '"usage":' whose braces never balance is passed over for the next one.
-- string.match leaves the JIT-compiled trace on every call; a stream has an event per token.
local function usage_object(ev, p, init)
    local n = #ev
    while true do
        local q, e = find(ev, '"usage":', init, true)
        if not q then
            return nil
        end
        local i = e -- 0-based index of the byte after the key
        while i < n and SPACE[p[i]] ~= 0 do
            i = i + 1
        end
        if i < n and p[i] == 123 then -- {
            local depth = 1
            for j = i + 1, n - 1 do
                local b = p[j]
                if b == 125 then -- }
                    depth = depth - 1
                    if depth == 0 then
                        return i + 1, j + 1, q
                    end
                elseif b == 123 then
                    depth = depth + 1
                end
            end
        end
        init = q + 1
    end
end

-- after_comma(p, q) -> the 1-based index of the ',' that ends where only %s stands
-- between it and index q, or nil
local function after_comma(p, q)
    local i = q - 2 -- 0-based index of the byte before q
    while i >= 0 and SPACE[p[i]] ~= 0 do
        i = i - 1
    end
    if i >= 0 and p[i] == 44 then -- ,
        return i + 1
    end
    return nil
end

-- openai_event(ctx, ev) -> the text to send of one event of an OpenAI stream (chat,
-- completions: "data: <json>", without its blank-line terminator), or nil to drop it:
-- its cumulative usage read, and taken out where the client did not ask for it (module
-- comment); "data: [DONE]" ends the stream; an error object is the stream's error.
function _M.openai_event(ctx, ev)
    if sub(ev, 1, 6) ~= "data: " then
        return ev
    end
    if ev == "data: [DONE]" then
        ctx.sse_done = true
        return ev
    end
    local a = find(ev, '"usage":', 7, true)
    if not a then
        if not ctx.error and sub(ev, 7, 14) == '{"error"' then
            local d = cjson.decode(sub(ev, 7))
            local e = type(d) == "table" and type(d.error) == "table" and d.error
            _M.stream_error(ctx, e and (type(e.code) == "string" and e.code
                or type(e.type) == "string" and e.type) or "stream_error")
        end
        return ev
    end
    local p = cast(u8p, ev)
    local first, last, q = usage_object(ev, p, a)
    if not first then
        return ev -- "usage": null
    end
    local final = find(ev, '"choices":[]', 7, true) ~= nil
    read_usage(ctx, sub(ev, first, last), final)
    if final then
        if not ctx.want_usage then
            return nil
        end
        return ev
    end
    if ctx.want_usage and ctx.want_continuous then
        return ev
    end
    -- the first ',%s*"usage":%s*%b{}' removed, as gsub(ev, that, "", 1) does: the
    -- first '"usage":' object found above, or a later one, that a comma precedes
    local comma = after_comma(p, q)
    while not comma do
        first, last, q = usage_object(ev, p, q + 1)
        if not first then
            return ev
        end
        comma = after_comma(p, q)
    end
    return sub(ev, 1, comma - 1) .. sub(ev, last + 1)
end

-- stream_error(ctx, code): the stream's error event (an API module's, or an OpenAI
-- stream's). As its first event, vLLM refused the request before generating anything
-- (measured with vLLM 0.32: a thinking budget without a reasoning parser, allowed_token_ids
-- past the vocabulary, an empty completions prompt, each "200" and a first event that is
-- the error, then [DONE]): bill() bills it nothing, as a refused request; the engine
-- writes no record of it, so an estimate would stay billed.
function _M.stream_error(ctx, code)
    if not ctx.error then
        ctx.error = code
        if not ctx.sse_seen then
            ctx.refused_in_stream = true
        end
    end
end

-- sse(ctx, chunk, eof) -> text to pass on for this body_filter call.
-- Complete events are passed at once (possibly edited or dropped); a partial event is
-- held until its end arrives (at most one event's delay); eof flushes what is left.
-- Each event goes to the request's API module (ctx.api.sse_event).
function _M.sse(ctx, chunk, eof)
    local on_event = ctx.api.sse_event
    local buf = ctx.sse_rest
    if buf then
        buf = buf .. chunk
        ctx.sse_rest = nil
    else
        buf = chunk
    end
    local out, n, pos = nil, 0, 1
    local seen = ctx.sse_seen
    while true do
        local a, b = find(buf, "\n\n", pos, true)
        if not a then
            break
        end
        local text = sub(buf, pos, a - 1)
        if ctx.trace then
            trace.reasons(ctx, text)
        end
        local ev = on_event(ctx, text)
        if not seen then -- set once, after the first event's look (stream_error)
            seen = true
            ctx.sse_seen = true
        end
        if ev then
            out = out or {}
            out[n + 1] = ev
            out[n + 2] = "\n\n"
            n = n + 2
        end
        pos = b + 1
    end
    local rest = pos <= #buf and sub(buf, pos) or nil
    if rest and eof then
        n = n + 1
        out = out or {}
        out[n] = rest
        rest = nil
    end
    ctx.sse_rest = rest
    return out and concat(out, "", 1, n) or ""
end

-- whole(ctx, chunk, eof): non-stream responses pass unchanged; the edge keeps a copy
-- and reads usage (or the error code) from the complete JSON at eof: the request's API
-- module's reading (ctx.api.whole_usage).
function _M.whole(ctx, chunk, eof)
    if chunk ~= "" then
        local parts = ctx.json_parts
        if not parts then
            parts = {}
            ctx.json_parts = parts
        end
        parts[#parts + 1] = chunk
    end
    if not eof or not ctx.json_parts then
        return
    end
    local text = concat(ctx.json_parts)
    ctx.json_parts = nil
    local d = cjson.decode(text)
    if type(d) ~= "table" then
        return
    end
    if ctx.trace then
        trace.reasons(ctx, text)
    end
    ctx.api.whole_usage(ctx, d)
    local e = d.error
    if type(e) == "table" and not ctx.error then
        ctx.error = type(e.code) == "string" and e.code
            or type(e.type) == "string" and e.type or "upstream_error"
    end
end

-- final(ctx, u, prompt, completion, details): a usage object (decoded; nothing when it
-- is no table) as the request's final usage. prompt, completion, details: the API's
-- names of the prompt tokens (cached ones included), the completion tokens and the
-- object holding cached_tokens; a count that is missing is 0.
function _M.final(ctx, u, prompt, completion, details)
    if type(u) ~= "table" then
        return
    end
    ctx.u_prompt = tonumber(u[prompt]) or 0
    ctx.u_completion = tonumber(u[completion]) or 0
    local det = u[details]
    ctx.u_cached = type(det) == "table" and tonumber(det.cached_tokens) or 0
    ctx.u_source = "final"
end

-- openai_whole(ctx, d): OpenAI's usage object of a whole answer (d decoded):
-- {prompt_tokens, completion_tokens, prompt_tokens_details: {cached_tokens}}; an
-- embeddings answer has no completion_tokens (0).
function _M.openai_whole(ctx, d)
    _M.final(ctx, d.usage, "prompt_tokens", "completion_tokens", "prompt_tokens_details")
end

-- named_event(ev) -> kind, nl | nil: one event of a stream whose events are named
-- ("event: <kind>\ndata: <json>", Anthropic's and the Responses API's): its kind, and
-- where its first line ends (for event_data); nil: no named event.
function _M.named_event(ev)
    if sub(ev, 1, 7) ~= "event: " then
        return nil
    end
    local nl = find(ev, "\n", 8, true)
    if not nl then
        return nil
    end
    return sub(ev, 8, nl - 1), nl
end

-- event_data(ev, nl) -> the decoded JSON object of a named event's data line (nl:
-- named_event's) | nil. Decoded only when a module asks: a stream has an event per
-- token, and most need no more than their kind.
function _M.event_data(ev, nl)
    local at = find(ev, "data:", nl + 1, true)
    local d = at and cjson.decode(sub(ev, at + 5))
    return type(d) == "table" and d or nil
end

local null = json.null

-- outcome(ctx, status) -> aborted: whether the client went away before the response
-- ended. 499 before the response headers; after them the status stays what was sent
-- (200) and nginx terminates the request without completing it. Verified with nginx
-- 1.22: a backend that dies mid-stream still ends the request "OK"
-- ($request_completion), a client that leaves does not. A client that closes right
-- after "data: [DONE]" (before the last chunk terminator) got everything: not an abort.
-- A forwarded request that neither ended nor was aborted gets ctx.error
-- "upstream_incomplete" (the backend died or timed out mid-response).
function _M.outcome(ctx, status, completion)
    local ended = ctx.eof or ctx.sse_done
    local aborted = status == 499
        or (ctx.proxied == true and not ended and completion ~= "OK")
    if ctx.proxied and not ended and not aborted and not ctx.error then
        ctx.error = "upstream_incomplete"
    end
    return aborted
end

-- bill(ctx, aborted) -> prompt, completion, cached (tokens), usage_source: what the
-- request is billed.
--   usage seen from vLLM: its numbers ("final", or "running" for the last cumulative
--   chunk before a disconnect);
--   a non-streaming request whose client left: vLLM kept generating until nginx closed
--   the upstream connection and no usage ever comes back, so the whole reservation
--   (prompt + the output tokens reserved, req.out_reserve) is billed ("estimate") and
--   nothing refunded: billing only the prompt would make "ask, then hang up" a free
--   generation;
--   forwarded and answered (or aborted) without usage: the prompt ("estimate");
--   not forwarded, a route without a body (a stored response read or cancelled: vLLM
--   generates nothing, and no engine record comes for the ledger to wait for), or a
--   stream whose first event was vLLM's refusal (stream_error): nothing ("none").
function _M.bill(ctx, aborted)
    if ctx.u_source then
        return ctx.u_prompt or 0, ctx.u_completion or 0, ctx.u_cached or 0, ctx.u_source
    end
    if ctx.refused_in_stream or ctx.no_body then
        return 0, 0, 0, "none"
    end
    local prompt = ctx.token_estimate or 0
    local req = ctx.limit_req
    if aborted and ctx.proxied and not ctx.stream and req and req.admitted then
        return prompt, req.out_reserve, 0, "estimate"
    end
    if ctx.proxied and ((ctx.status_sent and ctx.status_sent < 300) or aborted) then
        return prompt, 0, 0, "estimate"
    end
    return 0, 0, 0, "none"
end

-- The usage event's keys, in the order they are written. The ledger's parser
-- (sidecars/tokengate/ledger/event.py, UsageEvent) has the same fields in the same
-- order; tests/edge/test_edge_access_log.py checks a real edge's lines against it.
local FIELDS = {
    "request_id", "ts", "key_id", "model", "endpoint", "status", "stream", "token_estimate",
    "count_source", "reserved", "prompt_tokens", "completion_tokens", "cached_tokens",
    "system_tokens", "usage_source", "client_aborted", "ttft_ms", "total_ms", "upstream",
    "error", "sanitized_chars", "stripped_special_tokens", "escaped_special_tokens",
    "dropped_system_messages", "count_drift", "expected_cached_tokens",
    "expected_cached_source", "queue_ms", "trace", "max_tokens_requested",
    "max_tokens_applied", "session_id", "slo", "batch_id", "custom_id",
}
_M.FIELDS = FIELDS

-- event(f) -> f, the usage event: a plain table of the FIELDS (a missing one set to
-- null), written in FIELDS' order by line(): request_id, ts (RFC 3339), key_id, model, endpoint, status, stream,
-- token_estimate, count_source, reserved, prompt_tokens, completion_tokens,
-- cached_tokens, system_tokens (tokens), usage_source, client_aborted, ttft_ms, total_ms
-- (ms), upstream, error, and the sanitizer's counts: sanitized_chars (invisible or
-- control characters removed), stripped_special_tokens, escaped_special_tokens (U+200B
-- inserted into special-token text, edge.special_tokens: escape), dropped_system_messages;
-- count_drift (vLLM's usage.prompt_tokens - token_estimate, tokens: tokengate.drift);
-- expected_cached_tokens (tokens the replica was expected to serve from its prefix
-- cache when it was chosen, 0 when no prediction was made) and expected_cached_source
-- ("events" | "approximate": tokengate.prefix; null: the model's routing.policy is not
-- prefix, or the count had no block hashes); queue_ms (how long the request waited in
-- its key's queue, edge.queue: tokengate.queue; 0 when it did not queue); trace (the
-- request's span data, tokengate.trace.record; null when tracing is off or the request
-- was not sampled); max_tokens_requested (the completion limit the client sent, tokens;
-- null without one) and max_tokens_applied (the limit the request was forwarded and
-- reserved with: vLLM's fit into the context, lowered by the gateway's max_tokens_cap;
-- null when no completion budget was worked out: refused earlier, count_tokens,
-- embeddings); session_id (the agent session,
-- tokengate.session; null: none); slo (routing.policy slo: the request's class,
-- decision, targets, predicted and observed TTFT and TPOT, ms, and decision_us:
-- tokengate.slo.finish; null: no latency targets); batch_id, custom_id (a batch
-- line's batch and its custom_id, tokengate.batch; null: an online request).
function _M.event(f)
    for i = 1, #FIELDS do
        local k = FIELDS[i]
        if f[k] == nil then
            f[k] = null
        end
    end
    return f
end

-- record(ctx, status, aborted) -> the request's usage event (event()'s json.object),
-- from what the phases left in ctx; status: the status sent; aborted: outcome()'s.
-- Durations are monotonic (ctx.t0, ctx.t_first); ts is the wall-clock start time.
function _M.record(ctx, status, aborted)
    local prompt, completion, cached, source = _M.bill(ctx, aborted)
    local t0 = ctx.t0
    local total = t0 and (mono_ms() - t0) or (ngx_now() - ngx_req.start_time()) * 1000
    local req, counts = ctx.limit_req, ctx.sanitized
    local batch_id, custom_id = batch.event_fields(ctx)
    return _M.event({
        request_id = state.request_id(ctx),
        ts = clock.rfc3339_ms(ngx_req.start_time()),
        key_id = ctx.key and ctx.key.id,
        model = ctx.model,
        endpoint = ctx.endpoint,
        status = status,
        stream = ctx.stream == true,
        token_estimate = ctx.token_estimate or 0,
        count_source = ctx.count_source or "none",
        reserved = req and req.admitted and req.tokens or 0,
        prompt_tokens = prompt,
        completion_tokens = completion,
        cached_tokens = cached,
        system_tokens = ctx.system_tokens or 0,
        usage_source = source,
        client_aborted = aborted,
        ttft_ms = (t0 and ctx.t_first) and round3(ctx.t_first - t0) or nil,
        total_ms = round3(max(0, total)),
        upstream = ctx.replica and ctx.replica.name or nil,
        error = ctx.error,
        sanitized_chars = counts and counts.removed or 0,
        stripped_special_tokens = counts and counts.stripped or 0,
        escaped_special_tokens = counts and counts.escaped or 0,
        dropped_system_messages = counts and counts.collapsed or 0,
        count_drift = drift.of(ctx),
        expected_cached_tokens = ctx.prefix_source and ctx.prefix_expected or 0,
        expected_cached_source = ctx.prefix_source,
        queue_ms = ctx.queue_ms or 0,
        trace = ctx.trace and trace.record(ctx, status, aborted, ctx.error) or nil,
        max_tokens_requested = ctx.max_tokens_requested,
        max_tokens_applied = ctx.max_tokens_applied,
        session_id = ctx.session_id,
        batch_id = batch_id,
        custom_id = custom_id,
    })
end

-- ACCESS_FIELDS: the keys the sampled access line adds after the event's, in order.
local ACCESS_FIELDS = { "method", "uri", "limits", "client", "bytes_sent", "tier",
                        "sample_rate" }

-- access_fields(ctx, tier, rate) -> the sampled access line's fields beyond the event
-- (ACCESS_FIELDS): method, uri (clipped to 256 characters), limits (the tier that
-- decided: "local" | "global"), client (address), bytes_sent, tier and sample_rate
-- (tokengate.sampling's keep(): a line stands for 1 / sample_rate requests).
function _M.access_fields(ctx, tier, rate)
    return { method = ngx_req.get_method(), uri = errors.clip(ngx_var.uri, 256),
             limits = ctx.limits_tier or null, client = ngx_var.remote_addr or null,
             bytes_sent = tonumber(ngx_var.bytes_sent) or 0, tier = tier,
             sample_rate = rate }
end

-- KEY_TEXT[fields][i]: the text before the value of fields[i] in a line ('{"request_id":',
-- ',"ts":', ...): made once, so a line is its values' pieces and these.
local function key_texts(fields, first)
    local t = {}
    for i = 1, #fields do
        t[i] = (i == 1 and first or ",") .. '"' .. fields[i] .. '":'
    end
    return t
end
local EVENT_KEYS, ACCESS_KEYS = key_texts(FIELDS, "{"), key_texts(ACCESS_FIELDS, ",")

-- line(ev, extra) -> one JSON line (no newline: access_log adds it): the event's FIELDS,
-- then, when given, the access_fields() of extra, each in its order. Written straight
-- from the event's table (tokengate.json's encoding of each value): no JSON object is
-- built for a line written on every request.
function _M.line(ev, extra)
    local buf, n = {}, 0
    local append = json.append
    for i = 1, #FIELDS do
        n = n + 1
        buf[n] = EVENT_KEYS[i]
        n = append(ev[FIELDS[i]], buf, n)
    end
    if extra then
        for i = 1, #ACCESS_FIELDS do
            n = n + 1
            buf[n] = ACCESS_KEYS[i]
            n = append(extra[ACCESS_FIELDS[i]], buf, n)
        end
    end
    n = n + 1
    buf[n] = "}"
    return concat(buf, "", 1, n)
end

return _M
