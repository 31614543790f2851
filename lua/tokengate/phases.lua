-- The request lifecycle of the tokengate edge, one function per nginx phase. Each calls
-- the concern modules in order; the logic lives there.
--
--   access:        auth -> body (type, size, read, strict JSON, shape) -> sanitize
--                  -> count (gRPC via the loopback hop) -> context check
--                  -> limits (reserve: local window, then the global one when enabled)
--                  -> X-Token-Count -> proxy to the model's vLLM
--   balancer:      the model's upstream address, keepalive pool
--   header_filter: x-ratelimit-* and X-Token-Count on every answer; OpenAI shape for
--                  upstream failures that nginx itself produced
--   body_filter:   watch usage (SSE or JSON), drop what the client did not ask for
--   log:           settle the reservation(s) with real usage, write the usage event and,
--                  when sampled, the access-log line
--
-- Per-request state is ngx.ctx; nothing here writes globals.

local ngx = ngx
local config = require "tokengate.config"
local errors = require "tokengate.errors"
local auth = require "tokengate.auth"
local body_mod = require "tokengate.body"
local sanitize = require "tokengate.sanitize"
local count = require "tokengate.count"
local limit = require "tokengate.limit"
local global_limit = require "tokengate.global_limit"
local metrics = require "tokengate.metrics"
local sampling = require "tokengate.sampling"
local usage = require "tokengate.usage"
local request = require "tokengate.request"
local clock = require "tokengate.clock"
local json = require "tokengate.json"
local balancer = require "ngx.balancer"

local ngx_var = ngx.var
local ngx_req = ngx.req
local ngx_now = ngx.now
local ngx_log = ngx.log
local ngx_exit = ngx.exit
local ngx_print = ngx.print
local ERR = ngx.ERR
local WARN = ngx.WARN
local mono_ms = clock.mono_ms
local format = string.format
local find = string.find
local min = math.min
local max = math.max
local floor = math.floor
local type = type
local tostring = tostring
local tonumber = tonumber
local json_integer = json.integer
local null = json.null

local _M = {}

local ROUTES = request.ROUTES
local fail = errors.fail

local hop_address -- where this nginx's loopback hop server listens (init's argument)

-- init(path, hop): init_by_lua (master; again on every reload). Loads the compiled config;
-- a broken file stops nginx from starting or reloading instead of failing requests.
-- hop: the hop server's address, "unix:/path" or "host:port" (global-limit settlements
-- connect to it).
function _M.init(path, hop)
    local doc, err = config.load(path)
    if not doc then
        error(err)
    end
    hop_address = hop
end

-- init_worker(): per-worker state: the count cache, the limits and status dict handles,
-- the global tier's settings.
function _M.init_worker()
    local doc = config.get()
    count.init_worker(doc.edge.count_cache_entries)
    local ok, err = limit.init("tokengate_limits")
    if not ok then
        ngx_log(ERR, "tokengate: ", err)
    end
    ok, err = metrics.init("tokengate_status")
    if not ok then
        ngx_log(ERR, "tokengate: ", err)
    end
    if doc.global_limits.enabled then
        ok, err = global_limit.init_worker("tokengate_limits", doc.edge, hop_address or "")
        if not ok then
            ngx_log(ERR, "tokengate: global limits: ", err)
        end
    end
end

-- answer(status, text) -> ends the request with a JSON body the edge made itself.
local function answer(status, text)
    ngx.status = status
    ngx.header["Content-Type"] = "application/json"
    ngx.header["Content-Length"] = #text
    ngx_print(text)
    return ngx_exit(status)
end

-- access(): everything before the request is forwarded; ends the request with an
-- OpenAI-shaped error, or returns to let proxy_pass forward the sanitized body.
function _M.access()
    local ctx = ngx.ctx
    ctx.t0 = mono_ms()
    local doc = config.get()
    local edge = doc.edge
    local uri = ngx_var.uri
    local route = ROUTES[uri]
    ctx.endpoint = request.endpoint(route, uri)

    -- who: the key and its limits (per-model overrides once the model is known)
    local key, err = auth.authenticate(doc.keys, ngx_var.http_authorization)
    if not key then
        return fail(ctx, err)
    end
    ctx.key, ctx.bucket, ctx.limits = key, key.id, key
    ctx.rate = limit.peek(ctx.bucket, key, ngx_now())
    err = request.check_method(route, ngx_req.get_method(), uri)
    if err then
        return fail(ctx, err)
    end
    if route == "models" then
        return answer(200, config.models_json())
    end

    -- what: the body, parsed strictly, and the model it names
    local body, model, name
    body, err, name = body_mod.parse(route, doc.models, edge)
    if not body then
        ctx.model = name
        return fail(ctx, err)
    end
    model = err
    ctx.model = model.name
    local override = key.models[model.name]
    if override then
        ctx.bucket, ctx.limits = key.id .. "@" .. model.name, override
        ctx.rate = limit.peek(ctx.bucket, override, ngx_now())
    end
    local st = sanitize.request(route, body, model, edge.special_tokens)
    if st.err then
        return fail(ctx, st.err)
    end
    request.adjust(ctx, route, body, model)
    local text = json.encode(body)

    -- how much: exact prompt tokens and the completion budget
    local prompt, prompts, out
    local reply, cerr = count.count(route, model.name, text)
    if reply then
        prompt, prompts = reply.prompt_tokens, max(1, reply.prompt_count)
        ctx.token_estimate, ctx.count_source = prompt, "counter"
        ctx.system_tokens = reply.breakdown.system
        local changed
        out, changed = request.completion_budget(route, model, body, reply)
        if not out then
            return fail(ctx, changed)
        end
        if changed then
            text = json.encode(body)
        end
    elseif cerr.kind ~= "unavailable" or edge.on_counter_failure == "closed" then
        if cerr.kind == "unavailable" then
            ngx_log(WARN, "tokengate: counter unavailable (", cerr.message, "), failing closed")
        end
        return fail(ctx, count.rejection(cerr))
    else
        ngx_log(WARN, "tokengate: counter unavailable (", cerr.message, "), failing open")
        prompt, prompts = count.estimate(text, edge.estimate_bytes_per_token), 1
        ctx.token_estimate, ctx.count_source = prompt, "estimate"
        local changed
        out, changed = request.estimate_budget(route, body, model, prompt)
        if changed then
            text = json.encode(body)
        end
    end

    -- limits: RPM 1, TPM prompt + min(budget, configured reserve) per completion; the
    -- local window first, then (when enabled) the window all edges share
    local out_reserve = min(out, model.output_reserve) * (json_integer(body.n) or 1) * prompts
    local reserve = prompt + out_reserve
    local state, rejected = limit.admit(ctx.bucket, ctx.limits, reserve, ngx_now())
    ctx.limits_tier = "local"
    if not state then
        ctx.rate = rejected
        return fail(ctx, limit.rejection(key.id, rejected, prompt, out_reserve))
    end
    ctx.rate, ctx.reserved, ctx.window = state, reserve, state.window
    if doc.global_limits.enabled then
        local gstate, tier = global_limit.reserve(key.id, model.name, override ~= nil,
            ctx.limits, reserve, ngx_var.request_id)
        ctx.limits_tier = tier
        if gstate and gstate.reject then
            limit.release(ctx.bucket, state.window, reserve)
            ctx.rate, ctx.reserved = gstate, nil
            return fail(ctx, limit.rejection(key.id, gstate, prompt, out_reserve))
        elseif gstate then
            -- the shared window's numbers are the ones that count across edges
            ctx.rate, ctx.global, ctx.per_model = gstate, true, override ~= nil
        end
    end

    -- forward the body the edge parsed, with its count
    ngx_req.set_header("X-Token-Count", prompt)
    ngx_req.set_header("X-Token-Count-Source", ctx.count_source)
    ngx_req.set_body_data(text)
    ctx.peer_host, ctx.peer_port = model.host, model.port
    ctx.upstream = model.upstream
    ctx.proxied = true
end

-- balancer(): the model's vLLM server; no retries (a POST that reached vLLM may have
-- started generating).
function _M.balancer()
    local ctx = ngx.ctx
    local ok, err = balancer.set_current_peer(ctx.peer_host, ctx.peer_port)
    if not ok then
        ngx_log(ERR, "tokengate: set_current_peer: ", err)
        return ngx_exit(500)
    end
end

local UPSTREAM_FAILURE = {
    [502] = { "The model backend is unreachable. Please retry.", "upstream_unavailable" },
    [503] = { "The model backend is unavailable. Please retry.", "upstream_unavailable" },
    [504] = { "The model backend did not answer in time.", "upstream_timeout" },
}

-- header_filter(): headers every answer carries; detects nginx-made upstream errors.
function _M.header_filter()
    local ctx = ngx.ctx
    local h = ngx.header
    -- the usage event's request_id; vLLM also uses it in its response ids
    h["X-Request-Id"] = ngx_var.request_id
    if ctx.rate then
        limit.headers(h, ctx.rate)
    end
    if ctx.token_estimate then
        h["X-Token-Count"] = ctx.token_estimate
        h["X-Token-Count-Source"] = ctx.count_source
    end
    if ctx.limits_tier then
        h["X-Tokengate-Limits"] = ctx.limits_tier
    end
    local status = ngx.status
    ctx.status_sent = status
    if not ctx.proxied then
        return
    end
    local ct = h["Content-Type"]
    if type(ct) == "table" then
        ct = ct[1]
    end
    if status >= 400 and not (ct and find(ct, "json", 1, true)) then
        -- nginx's own HTML error page (vLLM down, timed out) or a non-JSON error from the
        -- backend: answer in OpenAI shape instead.
        if status == 504 and ngx_var.upstream_connect_time == "-" then
            status = 503 -- never connected: unavailable rather than slow
            ngx.status = status
            ctx.status_sent = status
        end
        local f = UPSTREAM_FAILURE[status]
        local text = errors.body(f and f[1] or format("The model backend failed with HTTP %d.",
            status), "server_error", nil, f and f[2] or "upstream_error")
        ctx.replace_body = text
        ctx.error = f and f[2] or "upstream_error"
        h["Content-Type"] = "application/json"
        h["Content-Length"] = #text
        if status >= 502 and status <= 504 then
            h["Retry-After"] = tostring(config.get().edge.upstream_retry_after_s)
        end
        return
    end
    if ct and find(ct, "text/event-stream", 1, true) then
        ctx.sse = true
        h["Content-Length"] = nil
    end
end

-- body_filter(): usage watch; see tokengate.usage.
function _M.body_filter()
    local ctx = ngx.ctx
    if not ctx.proxied then
        return
    end
    local chunk, eof = ngx.arg[1], ngx.arg[2]
    if not ctx.t_first and chunk ~= "" then
        ctx.t_first = mono_ms()
    end
    if eof then
        ctx.eof = true
    end
    local replace = ctx.replace_body
    if replace then
        if eof then
            ngx.arg[1] = replace
        else
            ngx.arg[1] = ""
        end
        return
    end
    if ctx.sse then
        ngx.arg[1] = usage.sse(ctx, chunk, eof)
    else
        usage.whole(ctx, chunk, eof)
    end
end

-- Codes for answers nginx itself made before any Lua ran (no ctx.error).
local NGINX_ERRORS = { [400] = "invalid_request", [413] = "request_too_large",
                       [414] = "request_too_large", [431] = "request_too_large" }

-- The usage file's absolute path without its leading "/" (the location's access_log
-- supplies it, see tokengate-location.conf).
local function usage_path()
    return (config.get().edge.usage_file:gsub("^/+", ""))
end

-- The sampled access log's absolute path without its leading "/" (as usage_path()), or
-- nil when the access log is off.
local function access_path()
    local file = config.get().access_log.file
    if file == "" then
        return nil
    end
    return (file:gsub("^/+", ""))
end

-- round3(x) -> x rounded to 3 decimals (ms with µs resolution)
local function round3(x)
    return floor(x * 1000 + 0.5) / 1000
end

-- log(): settle the reservation, then the usage event (written by access_log right
-- after this handler: verified with Debian's nginx 1.22 + lua 0.10.23 that access_log
-- runs after log_by_lua and sees variables it set).
function _M.log()
    local ctx = ngx.ctx
    local now = mono_ms()
    local status = ctx.status_sent or ngx.status
    -- A client that went away: 499 before the response headers; after them the status
    -- stays what was sent (200) and nginx terminates the request without completing it.
    -- Verified with nginx 1.22: a backend that dies mid-stream still ends the request
    -- "OK" ($request_completion), a client that leaves does not. A client that closes
    -- right after "data: [DONE]" (before the last chunk terminator) got everything: that
    -- is not an abort.
    local aborted = ngx.status == 499
        or (ctx.proxied == true and not ctx.eof and not ctx.sse_done
            and ngx_var.request_completion ~= "OK")
    if ctx.proxied and not ctx.eof and not ctx.sse_done and not aborted and not ctx.error then
        ctx.error = "upstream_incomplete" -- the backend died or timed out mid-response
    end
    local prompt, completion, cached, source = 0, 0, 0, "none"
    if ctx.u_source then
        prompt, completion, cached = ctx.u_prompt or 0, ctx.u_completion or 0, ctx.u_cached or 0
        source = ctx.u_source
    elseif aborted and ctx.proxied and not ctx.stream and ctx.reserved then
        -- A non-streaming request whose client left: vLLM kept generating until nginx
        -- closed the upstream connection, and no usage ever comes back. Bill the whole
        -- reservation (prompt + the output tokens reserved for it) and refund nothing;
        -- billing only the prompt would make "ask, then hang up" a free generation.
        prompt = ctx.token_estimate or 0
        completion, source = ctx.reserved - prompt, "estimate"
    elseif ctx.proxied and ((ctx.status_sent and ctx.status_sent < 300) or aborted) then
        -- forwarded, no usage seen: vLLM read the prompt, the rest is unknown
        prompt, source = ctx.token_estimate or 0, "estimate"
    end
    local reserved = ctx.reserved or 0
    local key = ctx.key
    local request_id = ngx_var.request_id
    if reserved > 0 then
        limit.settle(ctx.bucket, ctx.window, (prompt + completion) - reserved)
        if ctx.global and prompt + completion ~= reserved then
            global_limit.settle(key.id, ctx.model, ctx.per_model, request_id,
                prompt + completion)
        end
    end
    local t0 = ctx.t0
    local total = t0 and (now - t0) or (ngx_now() - ngx_req.start_time()) * 1000
    local total_ms = round3(max(0, total))
    local ts = clock.rfc3339_ms(ngx_req.start_time())
    local ttft_ms = (t0 and ctx.t_first) and round3(ctx.t_first - t0) or null
    local upstream = ctx.proxied and (ngx_var.upstream_addr or ctx.upstream) or null
    local error_code = ctx.error or NGINX_ERRORS[status] or null
    local line = usage.event({
        request_id = request_id,
        ts = ts,
        key_id = key and key.id or null,
        model = ctx.model or null,
        endpoint = ctx.endpoint or request.endpoint(ROUTES[ngx_var.uri], ngx_var.uri),
        status = status,
        stream = ctx.stream == true,
        token_estimate = ctx.token_estimate or 0,
        count_source = ctx.count_source or "none",
        reserved = reserved,
        prompt_tokens = prompt,
        completion_tokens = completion,
        cached_tokens = cached,
        system_tokens = ctx.system_tokens or 0,
        usage_source = source,
        client_aborted = aborted,
        ttft_ms = ttft_ms,
        total_ms = total_ms,
        upstream = upstream,
        error = error_code,
    })
    ngx_var.tg_usage_line = line
    ngx_var.tg_usage_path = usage_path()

    -- the sampled access log: decided on the same rounded total_ms the line records
    local apath = access_path()
    if not apath then
        return
    end
    local kept, tier, rate = sampling.keep(config.rules(), request_id, status, total_ms)
    if not kept then
        return
    end
    ngx_var.tg_access_line = sampling.line({
        ts = ts, request_id = request_id, status = status, method = ngx_req.get_method(),
        uri = errors.clip(ngx_var.uri, 256), key_id = key and key.id, model = ctx.model,
        token_estimate = ctx.token_estimate or 0, count_source = ctx.count_source or "none",
        limits = ctx.limits_tier, total_ms = total_ms, ttft_ms = ttft_ms,
        upstream = upstream, error = error_code, client = ngx_var.remote_addr,
        bytes_sent = tonumber(ngx_var.bytes_sent), tier = tier, sample_rate = rate,
    })
    ngx_var.tg_access_path = apath
    metrics.incr("access_log_lines")
end

-- status(): content handler of /tokengate/status (loopback only): the metrics as JSON,
-- plus whether the global tier is enabled and currently skipped after a failure.
function _M.status()
    local extra = json.object()
    json.set(extra, "global_limits_enabled", config.get().global_limits.enabled == true)
    json.set(extra, "global_limits_backing_off", global_limit.backing_off())
    return answer(200, metrics.json_text(extra))
end

return _M
