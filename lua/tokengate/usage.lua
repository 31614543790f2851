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
-- ctx fields used (set by phases.access): stream, want_usage, want_continuous.
-- ctx fields written: u_prompt, u_completion, u_cached (tokens), u_source
-- ("final" | "running"), sse_rest (partial event), sse_done ("data: [DONE]" seen),
-- json_parts (non-stream body), error.

local cjson = require "cjson.safe"
local json = require "tokengate.json"

local find = string.find
local sub = string.sub
local match = string.match
local gsub = string.gsub
local concat = table.concat
local tonumber = tonumber
local type = type

local _M = {}

-- read_usage(ctx, usage_text, final): stores the cumulative counts of one usage object
-- (text of {"prompt_tokens":..}) in ctx; final marks the last ("choices": []) chunk.
local function read_usage(ctx, usage_text, final)
    local p = match(usage_text, '"prompt_tokens":%s*(%d+)')
    local c = match(usage_text, '"completion_tokens":%s*(%d+)')
    if not p and not c then
        return
    end
    ctx.u_prompt = tonumber(p) or ctx.u_prompt or 0
    ctx.u_completion = tonumber(c) or 0
    local cached = match(usage_text, '"cached_tokens":%s*(%d+)')
    if cached then
        ctx.u_cached = tonumber(cached)
    end
    ctx.u_source = final and "final" or "running"
end

-- One SSE event (without its blank-line terminator) -> the text to send, or nil to drop.
local function sse_event(ctx, ev)
    if sub(ev, 1, 6) ~= "data: " then
        return ev
    end
    if ev == "data: [DONE]" then
        ctx.sse_done = true
        return ev
    end
    local a = find(ev, '"usage":', 7, true)
    if not a then
        if not ctx.error and find(ev, '^data: {"error"') then
            local d = cjson.decode(sub(ev, 7))
            local e = type(d) == "table" and type(d.error) == "table" and d.error
            ctx.error = e and (type(e.code) == "string" and e.code
                or type(e.type) == "string" and e.type) or "stream_error"
        end
        return ev
    end
    local usage_text = match(ev, '"usage":%s*(%b{})', a)
    if not usage_text then
        return ev -- "usage": null
    end
    local final = find(ev, '"choices":[]', 7, true) ~= nil
    read_usage(ctx, usage_text, final)
    if final then
        if not ctx.want_usage then
            return nil
        end
        return ev
    end
    if ctx.want_usage and ctx.want_continuous then
        return ev
    end
    return (gsub(ev, ',%s*"usage":%s*%b{}', "", 1))
end

-- sse(ctx, chunk, eof) -> text to pass on for this body_filter call.
-- Complete events are passed at once (possibly edited or dropped); a partial event is
-- held until its end arrives (at most one event's delay); eof flushes what is left.
function _M.sse(ctx, chunk, eof)
    local buf = ctx.sse_rest
    if buf then
        buf = buf .. chunk
        ctx.sse_rest = nil
    else
        buf = chunk
    end
    local out, n, pos = nil, 0, 1
    while true do
        local a, b = find(buf, "\n\n", pos, true)
        if not a then
            break
        end
        local ev = sse_event(ctx, sub(buf, pos, a - 1))
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
-- and reads usage (or the error code) from the complete JSON at eof.
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
    local d = cjson.decode(concat(ctx.json_parts))
    ctx.json_parts = nil
    if type(d) ~= "table" then
        return
    end
    local u = d.usage
    if type(u) == "table" then
        ctx.u_prompt = tonumber(u.prompt_tokens) or 0
        ctx.u_completion = tonumber(u.completion_tokens) or 0
        local det = u.prompt_tokens_details
        ctx.u_cached = type(det) == "table" and tonumber(det.cached_tokens) or 0
        ctx.u_source = "final"
    end
    local e = d.error
    if type(e) == "table" and not ctx.error then
        ctx.error = type(e.code) == "string" and e.code
            or type(e.type) == "string" and e.type or "upstream_error"
    end
end

local null = json.null

-- or_null(v) -> v, or json.null for nil
local function or_null(v)
    if v == nil then
        return null
    end
    return v
end

-- The usage event's keys, in the order they are written (the ledger's schema).
local FIELDS = {
    "request_id", "ts", "key_id", "model", "endpoint", "status", "stream", "token_estimate",
    "count_source", "reserved", "prompt_tokens", "completion_tokens", "cached_tokens",
    "system_tokens", "usage_source", "client_aborted", "ttft_ms", "total_ms", "upstream",
    "error",
}

-- event(f) -> one JSON line (no newline: access_log adds it) of the usage event. f holds
-- the FIELDS (nil -> null): request_id, ts, key_id, model, endpoint, status, stream,
-- token_estimate, count_source, reserved, prompt_tokens, completion_tokens, cached_tokens,
-- system_tokens, usage_source, client_aborted, ttft_ms, total_ms, upstream, error.
function _M.event(f)
    local o = json.object()
    local set = json.set
    for i = 1, #FIELDS do
        local k = FIELDS[i]
        set(o, k, or_null(f[k]))
    end
    return json.encode(o)
end

return _M
