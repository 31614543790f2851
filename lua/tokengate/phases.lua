-- The request lifecycle of the tokengate edge, one function per nginx phase. Each calls
-- the concern modules in order; the logic lives there.
--
--   access:        auth -> body (type, size, read, strict JSON, shape) -> sanitize
--                  -> count (gRPC via the loopback hop) -> context check
--                  -> limits (reserve) -> X-Token-Count -> proxy to the model's vLLM
--   balancer:      the model's upstream address, keepalive pool
--   header_filter: x-ratelimit-* and X-Token-Count on every answer; OpenAI shape for
--                  upstream failures that nginx itself produced
--   body_filter:   watch usage (SSE or JSON), drop what the client did not ask for
--   log:           settle the reservation with real usage, write the usage event
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
local usage = require "tokengate.usage"
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
local pairs = pairs
local sort = table.sort
local json_integer = json.integer
local json_set = json.set
local null = json.null

local _M = {}

local ROUTES = {
    ["/v1/chat/completions"] = "chat",
    ["/v1/completions"] = "completions",
    ["/v1/models"] = "models",
}

-- init(path): init_by_lua (master; again on every reload). Loads the compiled config;
-- a broken file stops nginx from starting or reloading instead of failing requests.
function _M.init(path)
    local doc, err = config.load(path)
    if not doc then
        error(err)
    end
end

-- init_worker(): per-worker state: the count cache and the limits dict handle.
function _M.init_worker()
    local doc = config.get()
    count.init_worker(doc.edge.count_cache_entries)
    local ok, err = limit.init("tokengate_limits")
    if not ok then
        ngx_log(ERR, "tokengate: ", err)
    end
end

-- ----------------------------------------------------------------- access helpers

-- fail(ctx, err) -> ends the request with a body-module error {status, message, param, code}
local function fail(ctx, err)
    return errors.exit(ctx, err.status, err.message,
        err.status >= 500 and "server_error" or "invalid_request_error", err.param, err.code)
end

-- models_list(doc) -> JSON text of GET /v1/models for the configured models
local function models_list(doc)
    local names = {}
    for name in pairs(doc.models) do
        names[#names + 1] = name
    end
    sort(names)
    local data = json.array()
    for i = 1, #names do
        local m = json.object()
        json_set(m, "id", names[i])
        json_set(m, "object", "model")
        json_set(m, "created", 0)
        json_set(m, "owned_by", "tokengate")
        json_set(m, "max_model_len", doc.models[names[i]].max_model_len)
        data[i] = m
    end
    local o = json.object()
    json_set(o, "object", "list")
    json_set(o, "data", data)
    return json.encode(o)
end

-- rate_limited(ctx, st, prompt, out_reserve) -> ends the request with a 429 that says
-- which limit (type "requests" | "tokens"), with Retry-After in whole seconds
local function rate_limited(ctx, st, prompt, out_reserve)
    local key_id = ctx.key.id
    local retry = st.retry_after
    local msg
    if st.reject == "requests" then
        msg = format("Rate limit reached for requests per minute (RPM) on key %s: limit %d, "
            .. "remaining %d. Please try again in %ds.", key_id, st.rpm, st.remaining_requests,
            retry)
    elseif st.alone then
        msg = format("Request too large for key %s: it needs %d tokens (%d prompt + %d reserved "
            .. "for the completion) but the limit is %d tokens per minute, so retrying cannot "
            .. "help. Reduce the prompt or max_tokens.", key_id, prompt + out_reserve, prompt,
            out_reserve, st.tpm)
    else
        msg = format("Rate limit reached for tokens per minute (TPM) on key %s: limit %d, "
            .. "remaining %d, requested %d (%d prompt + %d reserved for the completion). "
            .. "Please try again in %ds.", key_id, st.tpm, st.remaining_tokens,
            prompt + out_reserve, prompt, out_reserve, retry)
    end
    return errors.exit(ctx, 429, msg, st.reject, nil, "rate_limit_exceeded",
        { ["Retry-After"] = tostring(retry) })
end

-- Client-facing token cap and stream options, applied before counting (neither changes
-- the prompt's tokens, and the counter must see the body that is forwarded).
local function adjust(ctx, route, body, model)
    local cap = model.max_tokens_cap
    if cap then
        local fields = route == "chat" and { "max_completion_tokens", "max_tokens" }
            or { "max_tokens" }
        for i = 1, #fields do
            local v = json_integer(body[fields[i]])
            if v and v > cap then
                json_set(body, fields[i], cap)
                ctx.capped = true
            end
        end
    end
    if body.stream == true then
        ctx.stream = true
        local so = body.stream_options
        if not json.is_object(so) then
            so = json.object()
            json_set(body, "stream_options", so)
        end
        ctx.want_usage = so.include_usage == true
        ctx.want_continuous = so.continuous_usage_stats == true
        json_set(so, "include_usage", true)
        json_set(so, "continuous_usage_stats", true)
    end
end

-- ----------------------------------------------------------------- phases

-- access(): everything before the request is forwarded; ends the request with an
-- OpenAI-shaped error, or returns to let proxy_pass forward the sanitized body.
function _M.access()
    local ctx = ngx.ctx
    ctx.t0 = mono_ms()
    local doc = config.get()
    local edge = doc.edge
    local uri = ngx_var.uri
    local route = ROUTES[uri]
    ctx.endpoint = (route == "chat" or route == "completions") and route or uri

    local key, why = auth.authenticate(doc.keys, ngx_var.http_authorization)
    if not key then
        local msg = why == "missing"
            and "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            or "Incorrect API key provided."
        return errors.exit(ctx, 401, msg, "invalid_request_error", nil, "invalid_api_key")
    end
    ctx.key = key
    ctx.bucket, ctx.limits = key.id, key
    local method = ngx_req.get_method()

    if route == "models" then
        ctx.rate = limit.peek(ctx.bucket, key, ngx_now())
        if method ~= "GET" then
            return errors.exit(ctx, 405, "Method not allowed: use GET /v1/models",
                "invalid_request_error", nil, "method_not_allowed", { Allow = "GET" })
        end
        local text = models_list(doc)
        ngx.status = 200
        ngx.header["Content-Type"] = "application/json"
        ngx.header["Content-Length"] = #text
        ngx_print(text)
        return ngx_exit(200)
    end
    ctx.rate = limit.peek(ctx.bucket, key, ngx_now())
    if not route then
        return errors.exit(ctx, 404, format("Invalid URL (%s %s)", method, uri),
            "invalid_request_error", nil, "unknown_url")
    end
    if method ~= "POST" then
        return errors.exit(ctx, 405, format("Method not allowed: use POST %s", uri),
            "invalid_request_error", nil, "method_not_allowed", { Allow = "POST" })
    end

    -- body: type and size, read, strict JSON, shape
    local ok, err = body_mod.check_headers(ngx_req.get_headers(), edge.max_body_bytes)
    if not ok then
        return fail(ctx, err)
    end
    local raw
    raw, err = body_mod.read(edge.max_body_bytes)
    if not raw then
        return fail(ctx, err)
    end
    local body
    body, err = body_mod.decode(raw, edge.max_json_depth)
    if not body then
        return fail(ctx, err)
    end
    local model
    if route == "chat" then
        model, err = body_mod.validate_chat(body, doc.models)
    else
        model, err = body_mod.validate_completions(body, doc.models)
    end
    if not model then
        if err.param == "model" and type(body.model) == "string" and body.model ~= "" then
            ctx.model = body.model
        end
        return fail(ctx, err)
    end
    ctx.model = model.name
    local override = key.models[model.name]
    if override then
        ctx.bucket, ctx.limits = key.id .. "@" .. model.name, override
        ctx.rate = limit.peek(ctx.bucket, override, ngx_now())
    end

    -- sanitize
    local st
    if route == "chat" then
        st = sanitize.chat(body, model, edge.special_tokens)
    else
        st = sanitize.completions(body, model, edge.special_tokens)
    end
    if st.bad then
        return errors.invalid(ctx, format("%s contains the special token %q, which the model "
            .. "would read as a control token (a forged turn). Remove it from the text.",
            st.bad.param, st.bad.token), st.bad.param, "special_token_in_content")
    end
    ctx.sanitized = st.removed + st.stripped + st.collapsed
    adjust(ctx, route, body, model)
    local text = json.encode(body)

    -- count and context
    local reply, cerr = count.count(route, model.name, text)
    local prompt, out_effective
    local n = json_integer(body.n) or 1
    local prompts = 1
    if reply then
        prompt = reply.prompt_tokens
        prompts = max(1, reply.prompt_count)
        ctx.token_estimate = prompt
        ctx.count_source = "counter"
        ctx.system_tokens = reply.breakdown.system
        local requested = reply.max_tokens_requested
        if requested > 0 then
            if reply.max_tokens_effective < requested then
                return errors.invalid(ctx, format("This model's maximum context length is %d "
                    .. "tokens. However, you requested %d tokens (%d in the %s, %d in the "
                    .. "completion). Please reduce the length of the %s or completion.",
                    model.max_model_len, prompt + requested, prompt,
                    route == "chat" and "messages" or "prompt", requested,
                    route == "chat" and "messages" or "prompt"),
                    route == "chat" and "messages" or "prompt", "context_length_exceeded")
            end
            out_effective = requested
        else
            local room = model.max_model_len - prompt
            if room < 1 then
                return errors.invalid(ctx, format("This model's maximum context length is %d "
                    .. "tokens. However, your messages resulted in %d tokens, which leaves no "
                    .. "room for the completion. Please reduce the length of the messages.",
                    model.max_model_len, prompt), "messages", "context_length_exceeded")
            end
            out_effective = room
            if model.default_max_tokens then
                out_effective = min(model.default_max_tokens, room)
                json_set(body, "max_tokens", out_effective)
                text = json.encode(body)
            end
        end
    elseif cerr.kind == "invalid" then
        return errors.invalid(ctx, cerr.message, cerr.param, "invalid_value")
    elseif cerr.kind == "not_found" then
        return errors.exit(ctx, 404, cerr.message, "invalid_request_error", "model",
            "model_not_found")
    else
        ngx_log(WARN, "tokengate: counter unavailable (", cerr.message, "), failing ",
            edge.on_counter_failure)
        if edge.on_counter_failure == "closed" then
            return errors.unavailable(ctx, 503, "The token counter is unavailable; the request "
                .. "was not forwarded. Please retry.", "counter_unavailable", 1)
        end
        prompt = count.estimate(text, edge.estimate_bytes_per_token)
        ctx.count_source = "estimate"
        out_effective = json_integer(body.max_completion_tokens) or json_integer(body.max_tokens)
            or model.output_reserve
    end
    ctx.token_estimate = prompt

    -- limits: reserve prompt + min(effective output, configured reserve) per completion
    local out_reserve = min(out_effective, model.output_reserve) * n * prompts
    local reserve = prompt + out_reserve
    local state, rejected = limit.admit(ctx.bucket, ctx.limits, reserve, ngx_now())
    if not state then
        ctx.rate = rejected
        return rate_limited(ctx, rejected, prompt, out_reserve)
    end
    ctx.rate = state
    ctx.reserved = reserve
    ctx.window = state.window

    -- forward
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

-- The usage file's absolute path without its leading "/" (the location's access_log
-- supplies it, see tokengate-location.conf).
local function usage_path()
    return (config.get().edge.usage_file:gsub("^/+", ""))
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
    elseif ctx.proxied and ((ctx.status_sent and ctx.status_sent < 300) or aborted) then
        -- forwarded, no usage seen: vLLM read the prompt, the rest is unknown
        prompt, source = ctx.token_estimate or 0, "estimate"
    end
    local reserved = ctx.reserved or 0
    if reserved > 0 then
        limit.settle(ctx.bucket, ctx.window, (prompt + completion) - reserved)
    end
    local t0 = ctx.t0
    local total = t0 and (now - t0) or (ngx_now() - ngx_req.start_time()) * 1000
    local key = ctx.key
    local line = usage.event({
        request_id = ngx_var.request_id,
        ts = clock.rfc3339_ms(ngx_req.start_time()),
        key_id = key and key.id or null,
        model = ctx.model or null,
        endpoint = ctx.endpoint or ngx_var.uri,
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
        ttft_ms = (t0 and ctx.t_first) and round3(ctx.t_first - t0) or null,
        total_ms = round3(max(0, total)),
        upstream = ctx.proxied and (ngx_var.upstream_addr or ctx.upstream) or null,
        error = ctx.error or null,
    })
    ngx_var.tg_usage_line = line
    ngx_var.tg_usage_path = usage_path()
end

return _M
