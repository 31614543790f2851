-- The request lifecycle of the tokengate edge, one function per nginx phase. Each calls
-- the concern modules in order; the logic (and the policy) lives there.
--
--   access:        a browser's preflight (tokengate.cors) is answered first; then
--                  who (key) -> what (body, model, sanitized) -> how much (prompt
--                  tokens, completion budget, reservation) -> where (a replica with
--                  room in its KV cache, else shed) -> limits (every tier) ->
--                  awake (the replica takes it; held while it wakes from idle
--                  unload) -> forward (the parsed body, its count, the normalized path)
--   balancer:      the request's replica (tokengate.upstream), another one on a retry
--   header_filter: x-ratelimit-*, X-Token-Count and CORS (tokengate.cors) on every
--                  answer; OpenAI shape for errors that nginx itself or a non-JSON
--                  backend produced, and for the backend's own 4xx JSON errors
--                  (vLLM's shape)
--   body_filter:   watch usage (SSE or JSON), drop what the client did not ask for
--   log:           settle the reservation with the usage billed, note a count drift
--                  (tokengate.drift), write the usage event and, when sampled, the
--                  access-log line; a request without a valid API key writes no
--                  event: counted, and logged at a bounded rate
--
-- The Anthropic Messages API's, the OpenAI Responses API's and the embeddings' routes
-- run the same stages; where their shapes differ (key header, body, sanitizing, budget,
-- usage, errors, limit headers) the stages ask ctx.api (tokengate.messages,
-- tokengate.responses, tokengate.embeddings);
-- count_tokens and input_tokens are answered after the limits, never forwarded; a route
-- that names a stored response (ctx.stored) has no body to count and goes to the replica
-- that holds the response (ctx.pin).
--
-- Every stage returns value | nil, err (tokengate.errors); errors.send answers err.
-- Per-request state is ngx.ctx; nothing here writes globals.

local ngx = ngx
local config = require "tokengate.config"
local errors = require "tokengate.errors"
local auth = require "tokengate.auth"
local lockout = require "tokengate.lockout"
local body_mod = require "tokengate.body"
local sanitize = require "tokengate.sanitize"
local count = require "tokengate.count"
local limits = require "tokengate.limits"
local metrics = require "tokengate.metrics"
local upstream = require "tokengate.upstream"
local prefix = require "tokengate.prefix"
local admission = require "tokengate.admission"
local queue = require "tokengate.queue"
local idle = require "tokengate.idle"
local models = require "tokengate.models"
local sampling = require "tokengate.sampling"
local usage = require "tokengate.usage"
local drift = require "tokengate.drift"
local budget = require "tokengate.budget"
local request = require "tokengate.request"
local cors = require "tokengate.cors"
local clock = require "tokengate.clock"
local json = require "tokengate.json"
local trace = require "tokengate.trace"
local session = require "tokengate.session"
local balancer = require "ngx.balancer"

local ngx_var = ngx.var
local ngx_req = ngx.req
local ngx_log = ngx.log
local ngx_exit = ngx.exit
local ngx_print = ngx.print
local ERR = ngx.ERR
local mono_ms = clock.mono_ms
local ngx_now = ngx.now
local find = string.find
local format = string.format
local match = string.match
local gmatch = string.gmatch
local type = type
local tostring = tostring
local tonumber = tonumber
local pairs = pairs
local concat = table.concat
local json_integer = json.integer
local floor = math.floor
local max = math.max

local _M = {}

local send = errors.send
local DICT = "tokengate_limits" -- the windows and the sidecar breakers
local PREFIX_DICT = "tokengate_prefix" -- the approximate prefix-cache index

local hop_address -- where this nginx's loopback hop server listens (init's argument)
local counter_sockets -- the counter workers' unix sockets (init's argument)

-- init(path, hop, counter): init_by_lua (master; again on every reload). Loads the
-- compiled config; a broken file stops nginx from starting or reloading instead of
-- failing requests. hop: the hop server's address, "unix:/path" or "host:port" (the
-- global limits' calls); counter: the counter workers' sockets, "unix:/path.0
-- unix:/path.1 ..." (its calls, in counter frames).
function _M.init(path, hop, counter)
    local doc, err = config.load(path)
    if not doc then
        error(err)
    end
    hop_address = hop
    counter_sockets = {}
    for s in gmatch(counter or "", "%S+") do
        counter_sockets[#counter_sockets + 1] = s
    end
end

-- init_worker(): per-worker state: the counter client and its cache, the limit tiers,
-- the status counters.
function _M.init_worker()
    local doc = config.get()
    local ok, err = count.init_worker(doc.edge, counter_sockets, ngx.shared[DICT])
    if ok then
        ok, err = limits.init_worker(doc, hop_address, DICT)
    end
    if ok then
        ok, err = metrics.init("tokengate_status")
    end
    if ok then
        ok, err = lockout.init("tokengate_auth_failures", doc.edge.auth_failures)
    end
    if ok then
        local pok, perr = prefix.init(PREFIX_DICT, DICT)
        if not pok then
            for name, m in pairs(doc.models) do
                if m.routing and m.routing.policy == "prefix" then
                    ngx_log(ERR, "tokengate: ", perr, ": model ", name, " routes by prefix "
                        .. "without the edge's approximate index (add the lua_shared_dict "
                        .. "of tokengate-http.conf)")
                    break
                end
            end
        end
        ok, err = upstream.init_worker(doc, DICT)
    end
    if ok then
        ok, err = admission.init_worker(doc, DICT)
    end
    if ok then
        ok, err = idle.init_worker(doc, DICT)
    end
    if ok then
        local qok, qerr = queue.init_worker()
        if not qok and doc.edge.queue.enabled then
            ngx_log(ERR, "tokengate: ", qerr, ": edge.queue.enabled without the queues' "
                .. "lua_shared_dict of tokengate-http.conf: requests are shed, not queued")
        end
    end
    if not ok then
        ngx_log(ERR, "tokengate: ", err)
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

-- who(ctx, doc) -> key | nil, err (429 blocked client, 401): the API key and the limits
-- it is held to. ctx.unauthenticated: why there is no key (the status counter's reason).
local function who(ctx, doc)
    local ok, err = lockout.check()
    if not ok then
        ctx.unauthenticated = "unauthenticated_blocked"
        return nil, err
    end
    local key
    local api = ctx.api
    key, err = auth.authenticate(doc.keys, ngx_var.http_authorization,
        api and api.key(ngx_var), doc.previous_keys)
    if not key then
        if err == auth.MISSING then
            ctx.unauthenticated = "unauthenticated_missing_key"
            err = api and api.MISSING or err
        else
            ctx.unauthenticated = "unauthenticated_invalid_key"
            -- a disabled or expired key is a real secret, not a guess: no lockout
            if err == auth.INVALID then
                lockout.failed()
            end
        end
        return nil, err
    end
    ctx.key, ctx.limit_req = key, limits.request(key, nil, request.id(ctx))
    ctx.rate = limits.peek(ctx.limit_req)
    return key
end

-- listing(ctx, doc) -> true | nil, err (404/405): a known route with its method; the
-- model list and GET /v1/models/{id} are answered here; a route that names a stored
-- response is checked against the key (the API module's stored()).
local function listing(ctx, doc)
    local route, uri = ctx.route, ctx.uri
    local err = request.check_method(route, ngx_req.get_method(), uri)
    if err then
        return nil, err
    end
    local api = ctx.api
    if api and api.STORED and api.STORED[route] then
        ctx.stored = true
        return api.stored(ctx, doc)
    end
    if route == "models" then
        return answer(200, models.list(doc, ctx.key))
    elseif route == "model" then
        local text
        text, err = models.retrieve(doc, ctx.key, ctx.model_id)
        if not text then
            return nil, err
        end
        return answer(200, text)
    end
    return true
end

-- what(ctx, doc) -> body | nil, err: the body parsed strictly, the model it names (whose
-- limits then apply; served by the route's kind of vLLM runner, else 400
-- model_not_supported: an embedding model takes only embeddings), sanitized, with the
-- edge's adjustments (cap, stream options); a route of an API module (ctx.api) is
-- validated and sanitized by the module.
local function what(ctx, doc)
    if ctx.stored then
        return true
    end
    local route, edge, api = ctx.route, doc.edge, ctx.api
    local body, err = body_mod.parse(route, doc.models, edge, api)
    if not body then
        ctx.model, ctx.stream = err.model, err.stream
        return nil, err
    end
    -- what the client asked for, also in the event of a request refused before
    -- request.adjust (which sets it again with the stream options)
    ctx.stream = body.stream == true
    if not models.allowed(ctx.key, body.model) then
        return models.not_found(body.model)
    end
    local model = doc.models[body.model]
    ctx.model, ctx.model_entry = model.name, model
    ctx.limit_req = limits.request(ctx.key, model.name, request.id(ctx))
    ctx.rate = limits.peek(ctx.limit_req)
    local served
    served, err = models.serves(model, request.runner(route), ctx.uri)
    if not served then
        return nil, err
    end
    local counts
    if api then
        counts, err = api.sanitize(body, model, edge)
    else
        counts, err = sanitize.request(route, body, model, edge)
    end
    if not counts then
        return nil, err
    end
    ctx.sanitized = counts
    request.adjust(ctx, route, body, model)
    local fits
    fits, err = request.check_output(route, body, model)
    if not fits then
        return nil, err
    end
    if api and api.check then
        local ok
        ok, err = api.check(ctx, doc, body)
        if not ok then
            return nil, err
        end
    end
    ctx.body = body
    return body
end

-- whose(ctx) -> true | nil, err (403 session_budget_exceeded): the agent session the
-- request belongs to (tokengate.session: its headers, read when access began, then the
-- body's fields), refused once the key's session_budget is spent.
local function whose(ctx, doc)
    session.read(ctx, ctx.body)
    return session.check(ctx, doc)
end

-- how_much(ctx, doc) -> text | nil, err: the prompt's tokens, the completion budget and
-- the TPM reservation; text: the JSON body that will be forwarded (what was counted).
local function how_much(ctx, doc)
    if ctx.stored then
        return true
    end
    local route, body, model = ctx.route, ctx.body, ctx.model_entry
    local text = json.encode(body)
    local t = mono_ms()
    local counted, err = count.prompt(route, model.name, text, doc.edge)
    ctx.count_s = (mono_ms() - t) / 1000
    trace.span(ctx, "count", t)
    if not counted then
        return nil, err
    end
    ctx.token_estimate, ctx.count_source = counted.prompt, counted.source
    if ctx.history and counted.source == "counter" then
        -- the counter saw the body, not the stored history it continues
        ctx.count_source = "history"
    end
    ctx.system_tokens = counted.system
    ctx.prompt_count, ctx.n = counted.prompts, json_integer(body.n) or 1
    local routing = model.routing
    if routing and routing.policy == "prefix" then
        ctx.prefix_plan = prefix.plan(counted.reply, counted.prompt, routing)
    end
    local api = ctx.api
    if api and api.LOCAL[route] then
        -- answered here from the count: one request of the key's RPM, no tokens, no
        -- budget; an estimate is no answer
        if counted.source ~= "counter" then
            ctx.token_estimate, ctx.count_source = nil, nil -- (no X-Token-Count)
            return nil, count.CLOSED
        end
        local answer_text
        answer_text, err = api.count_answer(model, counted.prompt)
        if not answer_text then
            return nil, err
        end
        limits.reservation(ctx.limit_req, 0, 1, 0, 1, 0)
        ctx.local_answer = answer_text
        return text
    end
    local out
    out, err = request.budget(route, model, body, counted, ctx.key)
    if not out then
        return nil, err
    end
    -- the usage event's max_tokens_requested / max_tokens_applied, and the header that
    -- says the gateway's cap lowered the client's limit
    ctx.max_tokens_requested, ctx.max_tokens_applied = counted.requested, out
    ctx.max_tokens_capped_by = counted.capped_by
    if counted.body_changed then
        text = json.encode(body)
    end
    local n = json_integer(body.n) or 1
    limits.reservation(ctx.limit_req, counted.prompt, counted.prompts, out, n,
        model.output_reserve)
    ctx.limit_req.estimated = counted.source == "estimate"
    ctx.limit_req.budget = budget.request(ctx.key, model, doc, counted.prompt,
        out * n * counted.prompts, ngx_now())
    ctx.text = text
    return text
end

-- where(ctx) -> true | nil, err (503, 429): the replica that will serve the request,
-- chosen before anything is reserved: one with room in its KV cache for the key's
-- priority and below the model's max_concurrency, else one whose metrics are unknown
-- (tokengate.admission); when the best is full, the request is shed (503 overloaded,
-- Retry-After), or with edge.queue.enabled waits in its key's queue (tokengate.queue:
-- also while other requests of its model wait) and takes a replica when dispatched.
-- The replica carries the request's tokens from here (upstream.take), so the requests
-- that arrive while this one waits for its limits see it. A request pinned to a replica (ctx.pin: the one that holds
-- the stored response it names) goes there, full or not. A budget reservation prices
-- the prompt tokens the replica is expected to serve from its prefix cache
-- (ctx.prefix_expected, routing.policy prefix) at the model's cached rate. An API
-- module's placed(ctx) then gives the text to forward (tokengate.responses: the
-- response id names the replica).
local function where(ctx, doc)
    if ctx.local_answer then
        return true -- answered by the edge: no replica
    end
    local model = ctx.model_entry
    local pin = ctx.pin
    local prompt, tokens = ctx.token_estimate or 0, ctx.limit_req.tokens
    local tried = pin and upstream.others(model, pin)
    local r, rank = upstream.take(ctx, model, tried, admission.rank, ctx.key.admission,
        prompt, tokens)
    if not r then
        return nil, errors.new(503, "No replica of model " .. model.name .. " has an "
            .. "address yet (its host names did not resolve). Please retry.", nil,
            "upstream_unavailable", nil, { ["Retry-After"] = "5" })
    end
    local queueing = not ctx.stored and queue.enabled(doc)
    if queueing then
        ctx.queue_ms = 0 -- X-Tokengate-Queue-Ms on every answer while queueing is on
    end
    if not ctx.stored
            and (rank == admission.FULL or queueing and queue.busy(model.name)) then
        upstream.release(ctx, true)
        if not queueing then
            metrics.incr("admission_shed")
            return nil, admission.overloaded(model)
        end
        -- wait in the key's queue (tokengate.queue), then take a replica again
        local t = mono_ms()
        local ok, err = queue.wait(ctx, doc, prompt, max(0, tokens - prompt))
        trace.span(ctx, "queue", t)
        if not ok then
            return nil, err
        end
        r, rank = upstream.take(ctx, model, tried, admission.rank, ctx.key.admission,
            prompt, tokens)
        queue.took(ctx)
        if not r then
            return nil, errors.new(503, "No replica of model " .. model.name .. " has an "
                .. "address any more. Please retry.", nil, "upstream_unavailable", nil,
                { ["Retry-After"] = "5" })
        end
    end
    if rank == admission.HEADROOM then
        metrics.incr("admission_headroom")
    end
    local bud = ctx.limit_req.budget
    if bud and ctx.prefix_expected and ctx.prefix_expected > 0 then
        -- the tokens the replica is expected to serve from its prefix cache are priced
        -- at the cached rate; the settlement prices what vLLM reports
        budget.reprice(bud, model.cost, doc.billing, ctx.prefix_expected)
    end
    local api = ctx.api
    if ctx.body and api and api.placed then
        ctx.text = api.placed(ctx)
    end
    return true
end

-- reserve(ctx) -> true | nil, err (429): the reservation in every limit tier, with the
-- prompt tokens the replica is expected to serve from its prefix cache weighed
-- (tokengate.limits.weigh).
local function reserve(ctx)
    local req = ctx.limit_req
    if ctx.model_entry then
        -- the replica's expected prefix-cache hits count cached_tokens_weight each
        limits.weigh(req, limits.cached_weight(ctx.key, ctx.model_entry), ctx.prefix_expected)
    end
    local t = mono_ms()
    local ok, err = limits.reserve(req)
    trace.span(ctx, "limits", t)
    ctx.rate, ctx.limits_tier = req.state, req.tier
    if not ok then
        upstream.release(ctx, true)
    end
    return ok, err
end

-- answered(ctx) -> true, or the edge's own answer (count_tokens) once it is admitted.
local function answered(ctx)
    local text = ctx.local_answer
    if not text then
        return true
    end
    return answer(200, text)
end

-- awake(ctx) -> true | nil, err (503 model_waking): the request waits while its replica
-- wakes from idle unload (tokengate.idle).
local function awake(ctx)
    return idle.hold(ctx)
end

local STAGES = { who, listing, what, whose, how_much, where, reserve, answered, awake }

-- sent(ctx): the request goes to ctx.replica: its prompt's blocks are recorded there
-- (tokengate.prefix.sent; policy prefix, a count with block hashes).
local function sent(ctx)
    local plan = ctx.prefix_plan
    if plan and ctx.replica then
        prefix.sent(ctx.model, ctx.replica, plan, floor((ctx.prefix_expected or 0) / plan.bs))
    end
end

-- access(): everything before the request is forwarded; ends the request with an
-- OpenAI-shaped error, or returns to let proxy_pass forward the sanitized body.
function _M.access()
    local ctx = ngx.ctx
    ctx.t0 = mono_ms()
    local doc = config.get()
    local uri = ngx_var.uri -- the client's path: set_uri below changes $uri
    ctx.uri = uri
    ctx.route, ctx.model_id = request.route(uri)
    ctx.api = request.api(ctx.route, uri)
    ctx.endpoint = request.endpoint(ctx.route, uri)
    session.from_headers(ctx)
    -- a browser's preflight carries no key: answered before any is asked for
    cors.preflight(ctx, doc.edge.cors, ctx.route, uri)
    trace.start(ctx, doc.tracing)
    for i = 1, #STAGES do
        local ok, err = STAGES[i](ctx, doc)
        if not ok then
            return send(ctx, err)
        end
    end
    sent(ctx)
    -- forward the body the edge parsed, with its count, to the path the edge matched
    -- (proxy_pass without a URI would send the client's raw request line)
    ngx_req.set_header("X-Token-Count", ctx.token_estimate)
    ngx_req.set_header("X-Token-Count-Source", ctx.count_source)
    -- whose request it is, for the replica's engine record (tokengate_vllm.edge): a
    -- record whose usage event never comes (a worker killed mid-stream) is billed to
    -- this key by the ledger. Set, never passed on: a client's own value is replaced.
    ngx_req.set_header("X-Tokengate-Key", ctx.key.id)
    ngx_req.set_header("X-Tokengate-Endpoint", ctx.endpoint)
    if ctx.text then
        ngx_req.set_body_data(ctx.text)
    end
    -- a stored response's path is the client's, normalized (its id was checked)
    ngx_req.set_uri(request.PATHS[ctx.route] or ctx.uri)
    trace.forward(ctx)
    ctx.proxied = true
end

-- balancer(): the request's replica. Called again when nginx retries, which it does only
-- for a replica that failed before anything of the request was sent to it (nginx never
-- resends a POST): that one counts a failure and another untried replica takes over.
function _M.balancer()
    local ctx = ngx.ctx
    local model = ctx.model_entry
    local r = ctx.replica
    if ctx.balanced then
        local state, code = balancer.get_last_failure()
        upstream.failed(model.name, r, (state or "failed") .. " " .. tostring(code or ""))
        upstream.release(ctx)
        local tried = ctx.tried or {}
        tried[r.name] = true
        ctx.tried = tried
        -- admitted already: any untried replica, full or not
        r = upstream.take(ctx, model, tried, admission.rank, ctx.key.admission,
            ctx.token_estimate, ctx.limit_req.tokens)
        if not r then
            return ngx_exit(502)
        end
        sent(ctx)
        idle.nudge(model, r)
    else
        ctx.balanced = true
        if upstream.is_out(model.name, r) and not ctx.pin then
            -- taken out while this request waited for its limits: choose again
            r = upstream.take(ctx, model, nil, admission.rank, ctx.key.admission,
                ctx.token_estimate, ctx.limit_req.tokens)
            sent(ctx)
            idle.nudge(model, r)
        end
        local more = #model.upstreams - 1
        if more > 0 and not ctx.pin then
            balancer.set_more_tries(more)
        end
    end
    local ok, err = balancer.set_current_peer(upstream.address(model.name, r), r.port)
    if not ok then
        ngx_log(ERR, "tokengate: set_current_peer ", r.name, ": ", err)
        return ngx_exit(500)
    end
end

-- is_json(content_type) -> true when the header value names a JSON body
local function is_json(ct)
    if type(ct) == "table" then
        ct = ct[1]
    end
    return ct ~= nil and find(ct, "json", 1, true) ~= nil
end

-- header_filter(): headers every answer carries; an error page nginx made itself (a
-- backend down or slow, a body that timed out) or a non-JSON error from the backend
-- becomes an OpenAI-shaped error (the body filter sends it); so does the backend's 4xx
-- JSON error, rewritten by the body filter (no Content-Length: its length changes).
function _M.header_filter()
    local ctx = ngx.ctx
    local h = ngx.header
    -- the usage event's request_id; vLLM also uses it in its response ids
    h["X-Request-Id"] = request.id(ctx)
    if ctx.trace then
        h["traceparent"] = trace.header(ctx)
    end
    if ctx.rate then
        local api = ctx.api
        if api and api.rate_headers then
            api.rate_headers(h, ctx.rate)
        else
            limits.headers(h, ctx.rate)
        end
    end
    local req = ctx.limit_req
    if req and req.budget then
        budget.headers(h, req.budget)
    end
    if ctx.token_estimate then
        h["X-Token-Count"] = ctx.token_estimate
        h["X-Token-Count-Source"] = ctx.count_source
    end
    if ctx.limits_tier then
        h["X-Tokengate-Limits"] = ctx.limits_tier
    end
    if ctx.max_tokens_capped_by then
        h["X-Tokengate-Max-Tokens-Capped"] = format("%d -> %d (%s cap)",
            ctx.max_tokens_requested, ctx.max_tokens_applied, ctx.max_tokens_capped_by)
    end
    if ctx.queue_ms then
        h["X-Tokengate-Queue-Ms"] = ctx.queue_ms
    end
    if ctx.replica then
        h["X-Tokengate-Upstream"] = ctx.replica.name
        if ctx.prefix_source then
            h["X-Tokengate-Expected-Cached-Tokens"] = ctx.prefix_expected
            h["X-Tokengate-Expected-Cached-Source"] = ctx.prefix_source
        end
    end
    local cors_cfg = config.get().edge.cors
    if cors_cfg.enabled and not ctx.preflight then
        cors.headers(h, cors_cfg)
    end
    local status = ngx.status
    if status >= 400 and not is_json(h["Content-Type"]) then
        if ctx.proxied and status == 504 and ngx_var.upstream_connect_time == "-" then
            status = 503 -- never connected: unavailable rather than slow
            ngx.status = status
        end
        local err = errors.nginx(status, ctx.proxied)
        local text = errors.render(ctx, err)
        ctx.replace_body, ctx.error = text, err.code
        h["Content-Type"] = "application/json"
        h["Content-Length"] = #text
        if ctx.proxied and status >= 502 and status <= 504 then
            h["Retry-After"] = tostring(config.get().edge.upstream_retry_after_s)
        end
    elseif ctx.proxied and status >= 400 then
        -- the backend refused or failed the request (vLLM's JSON error, a stream's too:
        -- vLLM refuses before the first chunk): the body filter answers it in OpenAI's
        -- shape
        ctx.upstream_error = {}
        h["Content-Length"] = nil
        status = errors.upstream_status(status)
        ngx.status = status
    elseif ctx.proxied then
        local ct = h["Content-Type"]
        if type(ct) == "table" then
            ct = ct[1]
        end
        if ct and find(ct, "text/event-stream", 1, true) then
            ctx.sse = true
            h["Content-Length"] = nil
        end
    end
    ctx.status_sent = status
end

-- upstream_error(ctx, chunk, eof) -> what to send of the backend's error body: nothing
-- until eof, then the whole body in OpenAI's shape (tokengate.errors.upstream; its code
-- or type becomes the usage event's error), or unchanged when it is no JSON error
-- object. A body above MAX_UPSTREAM_ERROR bytes is no error object vLLM writes (its
-- messages are bounded): it passes unchanged from there on.
local MAX_UPSTREAM_ERROR = 65536
local function upstream_error(ctx, chunk, eof)
    local parts = ctx.upstream_error
    parts[#parts + 1] = chunk
    parts.bytes = (parts.bytes or 0) + #chunk
    if not eof and parts.bytes <= MAX_UPSTREAM_ERROR then
        return ""
    end
    ctx.upstream_error = nil
    local text = concat(parts)
    local err = eof and errors.upstream(ctx.status_sent, text)
    if not err then
        return text
    end
    local api = ctx.api
    if api and api.upstream_error then
        err = api.upstream_error(ctx, err)
    end
    ctx.error = err.code or err.type
    return errors.render(ctx, err)
end

-- body_filter(): the replacement error body, the backend's error in OpenAI's shape, or
-- the usage watch (tokengate.usage).
function _M.body_filter()
    local ctx = ngx.ctx
    local chunk, eof = ngx.arg[1], ngx.arg[2]
    local replace, rewrite = ctx.replace_body, ctx.upstream_error
    if replace then
        ngx.arg[1] = eof and replace or ""
    elseif rewrite then
        ngx.arg[1] = upstream_error(ctx, chunk, eof)
    end
    if not ctx.proxied then
        return
    end
    if not ctx.t_first and chunk ~= "" then
        ctx.t_first = mono_ms()
    end
    if eof then
        ctx.eof = true
    end
    if replace or rewrite then
        return
    end
    if ctx.sse then
        ngx.arg[1] = usage.sse(ctx, chunk, eof)
    else
        usage.whole(ctx, chunk, eof)
    end
end

-- unauthenticated(ctx, status, aborted): the log phase of a request without a valid
-- API key (401, a blocked client's 429, what nginx refused): no usage event (the
-- ledger bills keys; a flood of random keys must not grow the usage file or Redis),
-- one status counter, and an access-log line for the first
-- edge.auth_failures.log_lines_per_s of each second (per worker).
local function unauthenticated(ctx, status, aborted)
    metrics.incr(ctx.unauthenticated or "unauthenticated_refused")
    metrics.request(ctx, status, nil, config.get().models)
    local doc = config.get()
    if doc.access_log.file == "" or
            not sampling.keep_unauthenticated(doc.edge.auth_failures.log_lines_per_s) then
        return
    end
    local ev = usage.record(ctx, status, aborted)
    ngx_var.tg_access_line = usage.line(ev, usage.access_fields(ctx, "unauthenticated",
        json.null))
    metrics.incr("access_log_lines")
    metrics.incr("unauthenticated_log_lines")
end

-- log(): settle the reservation to what is billed, then the usage event (written by the
-- location's access_log right after this handler: verified with Debian's nginx 1.22 +
-- lua 0.10.23 that access_log runs after log_by_lua and sees variables it set) and the
-- sampled access-log line.
function _M.log()
    local ctx = ngx.ctx
    local status = ctx.status_sent or ngx.status
    local aborted = usage.outcome(ctx, ngx.status, ngx_var.request_completion)
    if status >= 400 and status ~= 499 and not ctx.error then
        -- an answer no filter saw: nginx closes a client that stopped sending its body
        -- (408) without one
        ctx.error = errors.nginx(status, ctx.proxied).code
    end
    if ctx.preflight then
        -- no key, no usage event, not an authentication failure
        metrics.incr("cors_preflight_" .. ctx.preflight)
        return metrics.request(ctx, status, nil, config.get().models)
    end
    if not ctx.key then
        return unauthenticated(ctx, status, aborted)
    end
    if ctx.queue then
        queue.finish(ctx)
    end
    local ev = usage.record(ctx, status, aborted)
    if ctx.queue then
        queue.settle(ctx, config.get(), ev.prompt_tokens, ev.completion_tokens)
    end
    local req = ctx.limit_req
    -- the request's cost, worked out once for the key's budgets and its session's
    local need_cost = (req and req.budget) or (ctx.session_id and session.needs_cost(ctx.key))
    local cost = need_cost and ctx.model_entry and budget.cost(ctx.model_entry.cost,
        config.get().billing, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens,
        ev.system_tokens) or nil
    if req then
        limits.settle(req, ev.prompt_tokens + ev.completion_tokens, req.budget and cost,
            limits.charged(req, ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens))
    end
    if ctx.session_id then
        session.settle(ctx, ev.prompt_tokens + ev.completion_tokens,
            session.needs_cost(ctx.key) and cost or nil)
        if ctx.response_id and status < 400 then
            session.remember(ctx, ctx.response_id)
        end
    end
    drift.report(ctx, ev.count_drift)
    metrics.request(ctx, status, ev, config.get().models, ngx_var.upstream_connect_time)
    if ctx.replica then
        -- the last try's failure never reaches the balancer: count it here
        if ctx.error == "upstream_unavailable" or ctx.error == "upstream_timeout" then
            upstream.failed(ctx.model, ctx.replica, ctx.error)
        end
        upstream.release(ctx)
        local plan = ctx.prefix_plan
        if plan and ctx.proxied then
            -- the generated tokens' full blocks take the replica's cache too
            local p, bs = ev.prompt_tokens, plan.bs
            prefix.generated(ctx.model, ctx.replica,
                floor((p + ev.completion_tokens) / bs) - floor(p / bs))
        end
    end
    local line_usage = usage.line(ev)
    ngx_var.tg_usage_line = line_usage
    local al = config.get().access_log
    if al.file == "" then
        return
    end
    -- decided on the same rounded total_ms the event records
    local kept, tier, rate = sampling.keep(config.rules(), ev.request_id, status, ev.total_ms)
    if kept then
        ngx_var.tg_access_line = usage.line(ev, usage.access_fields(ctx, tier, rate))
        metrics.incr("access_log_lines")
    end
end

-- nginx_error(): content handler of /_tokengate/error, the error_page of what nginx
-- refuses before the edge's Lua runs (a bad request line, duplicate or conflicting
-- headers such as Content-Length with Transfer-Encoding, headers or URI too large, a
-- body above the backstop, an unknown path): the same OpenAI shape as every other
-- error. The internal redirect dropped ngx.ctx, so the key is looked up again: with a
-- valid one (an Authorization header nginx read before the line it refused; the first
-- of two) the request gets its usage event, whose endpoint is the client's path ("-"
-- when the request line was unreadable); without one it is counted as
-- unauthenticated_refused. Such requests never count towards blocking a client
-- (edge.auth_failures).
function _M.nginx_error()
    local ctx = ngx.ctx
    local path = match(ngx_var.request_uri or "", "^[^?]*")
    if path == "" then
        ctx.endpoint = "-"
    else
        local route = request.route(path)
        ctx.api = request.api(route, path)
        ctx.endpoint = request.endpoint(route, path)
    end
    local doc = config.get()
    ctx.key = auth.authenticate(doc.keys, ngx_var.http_authorization,
        ctx.api and ctx.api.key(ngx_var), doc.previous_keys)
    local status = ngx_var.arg_status == "494" and 494 or tonumber(ngx_var.status) or 500
    return send(ctx, errors.nginx(status, false))
end

-- status(): content handler of /tokengate/status on the loopback status server
-- (edge.status_listen): the metrics as JSON, plus whether the global tier and the
-- counter are skipped after a failure.
function _M.status()
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
            -- the replica's vLLM metrics; null while unknown (tokengate.admission)
            local kv = st.more
            json.set(o, "kv_cache_usage", kv and kv.kv_cache_usage or json.null)
            json.set(o, "num_requests_waiting", kv and kv.waiting or json.null)
            json.set(o, "num_requests_running", kv and kv.running or json.null)
            json.set(o, "finish_rate", kv and kv.finish_rate or json.null)
            json.set(m, rname, o)
        end
        json.set(ups, name, m)
    end
    json.set(extra, "upstreams", ups)
    return answer(200, metrics.json_text(extra))
end

-- prometheus(): content handler of /metrics on the status server: every edge metric in
-- Prometheus's text format, with the replicas' state read now (tokengate.upstream).
function _M.prometheus()
    local up, outstanding, blocks = {}, {}, {}
    local doc = config.get()
    for name, replicas in pairs(upstream.states(doc)) do
        local m = 'model="' .. metrics.value(name) .. '",replica="'
        for rname, st in pairs(replicas) do
            local labels = m .. metrics.value(rname) .. '"'
            up[labels] = st.out and 0 or 1
            outstanding[labels] = st.outstanding_tokens
        end
        local model = doc.models[name]
        if model.routing and model.routing.policy == "prefix" then
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
                                      tokengate_prefix_index_capacity_bytes =
                                          size and { [""] = size },
                                      tokengate_prefix_index_free_bytes =
                                          free and { [""] = free } })
    ngx.status = 200
    ngx.header["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
    ngx.header["Content-Length"] = #text
    ngx_print(text)
    return ngx_exit(200)
end

return _M
