-- The request lifecycle of the tokengate edge, one function per nginx phase. Each calls
-- the stage modules (tokengate.stages.*) in order; the logic (and the policy) lives
-- there and in the concern modules they call.
--
--   access:        a browser's preflight (tokengate.cors) is answered first; then
--                  read      who (key) and which route (tokengate.stages.read)
--                  validate  what (body, model, sanitized) and whose (the agent session)
--                  count     how much (prompt tokens, completion budget, reservation)
--                  route     where (a replica with room in its KV cache, else a queue or
--                            shed)
--                  admit     limits (every tier); the edge's own answer (count_tokens)
--                  route     awake (the replica takes it; held while it wakes from idle
--                            unload), then forward (the parsed body, its count, the
--                            normalized path)
--   balancer:      the request's replica (tokengate.stages.route), another one on a retry
--   header_filter: x-ratelimit-*, X-Token-Count and CORS on every answer; errors in the
--                  API's shape for what nginx itself, a non-JSON backend or the
--                  backend's own 4xx JSON produced (tokengate.stages.respond)
--   body_filter:   watch usage (SSE or JSON), drop what the client did not ask for
--   log:           settle the reservation with the usage billed, note a count drift
--                  (tokengate.stages.settle), write the usage event and, when sampled,
--                  the access-log line (tokengate.stages.event); a request without a
--                  valid API key writes no event: counted, and logged at a bounded rate
--
-- Every API runs the same stages; where APIs differ (key header, body, sanitizing,
-- budget, usage, errors, limit headers) the stages ask the route's API module, ctx.api
-- (tokengate.apis finds it, tokengate.api lists what a module provides); no stage
-- names an API. A route the edge answers from the count (an API's LOCAL: count_tokens,
-- input_tokens) is answered after the limits, never forwarded; a route without a body
-- (NO_BODY: the model list, a stored response) is the module's, and a stored response
-- goes to the replica that holds it (ctx.pin).
--
-- Every stage returns value | nil, err (tokengate.errors); errors.send answers err.
-- The request's state is ngx.ctx, every field of it declared in tokengate.state;
-- nothing here writes globals. The status server's handlers are tokengate.status, the
-- health probes tokengate.health.

local ngx = ngx
local config = require "tokengate.config"
local errors = require "tokengate.errors"
local auth = require "tokengate.auth"
local lockout = require "tokengate.lockout"
local count = require "tokengate.count"
local limits = require "tokengate.limits"
local metrics = require "tokengate.metrics"
local upstream = require "tokengate.upstream"
local prefix = require "tokengate.prefix"
local admission = require "tokengate.admission"
local queue = require "tokengate.queue"
local idle = require "tokengate.idle"
local usage = require "tokengate.usage"
local apis = require "tokengate.apis"
local cors = require "tokengate.cors"
local clock = require "tokengate.clock"
local trace = require "tokengate.trace"
local session = require "tokengate.session"
local slo = require "tokengate.slo"
local read = require "tokengate.stages.read"
local validate = require "tokengate.stages.validate"
local count_stage = require "tokengate.stages.count"
local route_stage = require "tokengate.stages.route"
local admit = require "tokengate.stages.admit"
local respond = require "tokengate.stages.respond"
local settle = require "tokengate.stages.settle"
local event = require "tokengate.stages.event"
local batch = require "tokengate.batch"
local reply = require "tokengate.reply"

local ngx_var, ngx_log, ERR = ngx.var, ngx.log, ngx.ERR
local mono_ms = clock.mono_ms
local match, gmatch = string.match, string.gmatch
local tonumber, pairs = tonumber, pairs

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

-- timer_watcher(): the handler of the timer every worker starts in init_worker. A
-- worker's first ngx.timer makes ngx_lua's timer watcher, a fake connection (fd -2) that
-- nginx closes when the worker is told to shut down (the pending timers then run
-- prematurely). The first timer of a worker made after that, as a settlement's drain in
-- the log phase of a request the worker still serves (the workers other than 0 start no
-- timer of their own), makes a watcher nothing closes: the worker exits with "[alert]
-- *0 open socket #-2 left in connection N" and "aborting" (seen on workers told to shut
-- down a second after a reload started them). ngx_lua makes the watcher once per worker
-- (ngx_http_lua_timer.c, ngx_http_lua_ngx_timer_helper: lmcf->watcher), so one made now
-- serves the worker's whole life.
local function timer_watcher()
end

-- init_worker(): per-worker state: the counter client and its cache, the limit tiers,
-- the status counters; ngx_lua's timer watcher (timer_watcher).
function _M.init_worker()
    local doc = config.get()
    local ok, err = ngx.timer.at(0, timer_watcher)
    if ok then
        ok, err = count.init_worker(doc.edge, counter_sockets, ngx.shared[DICT])
    else
        err = "timer watcher: " .. err
    end
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
        ok, err = slo.init_worker(DICT)
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

-- The access stages, in order: each (ctx, doc) -> true | nil, err.
local STAGES = {
    read.key, read.route,
    validate.body, validate.session,
    count_stage.prompt,
    -- a batch line's check (tokengate.batch) ends here, answered with its count
    function(ctx)
        if batch.checking(ctx) then
            return reply.send(200, batch.check_answer(ctx))
        end
        return true
    end,
    route_stage.replica,
    admit.reserve, admit.answer,
    route_stage.awake,
}

-- access(): everything before the request is forwarded; ends the request with an
-- error in its API's shape, or returns to let proxy_pass forward the sanitized body.
function _M.access()
    local ctx = ngx.ctx
    ctx.t0 = mono_ms()
    local doc = config.get()
    local uri = ngx_var.uri -- the client's path: set_uri (route.forward) changes $uri
    ctx.uri = uri
    local route, id = apis.route(uri)
    local api = apis.api(route, uri)
    ctx.route, ctx.model_id, ctx.api = route, id, api
    ctx.endpoint = apis.endpoint(api, route, uri)
    session.from_headers(ctx)
    -- a browser's preflight carries no key: answered before any is asked for
    cors.preflight(ctx, doc.edge.cors, apis.ALLOW[route], uri)
    trace.start(ctx, doc.tracing)
    for i = 1, #STAGES do
        local ok, err = STAGES[i](ctx, doc)
        if not ok then
            return send(ctx, err)
        end
    end
    route_stage.forward(ctx)
end

-- files(): the access phase of /v1/files and /v1/batches: a browser's preflight
-- answered first (the Batch API's methods), then the key read like every route's, then
-- forwarded to the batch service (tokengate.batch.files_access).
function _M.files()
    local ctx = ngx.ctx
    ctx.t0 = mono_ms()
    local doc = config.get()
    local uri = ngx_var.uri
    ctx.uri = uri
    ctx.api = apis.api(nil, uri)
    ctx.endpoint = uri
    cors.preflight(ctx, doc.edge.cors, batch.ALLOW, uri)
    local key, err = read.key(ctx, doc)
    if key then
        key, err = batch.files_access(ctx, doc, key)
    end
    if not key then
        return send(ctx, err)
    end
end

-- files_headers(): the CORS headers of a Batch API answer (tokengate.cors), as on
-- every route's.
function _M.files_headers()
    cors.headers(ngx.ctx, ngx.header, config.get().edge.cors)
end

-- files_log(): the log phase of /v1/files and /v1/batches: a preflight, or a request
-- refused for its key, counted as on every route (no usage event: nothing there is
-- metered).
function _M.files_log()
    local ctx = ngx.ctx
    if ctx.preflight then
        metrics.incr("cors_preflight_" .. ctx.preflight)
    elseif ctx.unauthenticated then
        metrics.incr(ctx.unauthenticated)
    end
end

-- balancer(): the request's replica (tokengate.stages.route.balance).
function _M.balancer()
    return route_stage.balance(ngx.ctx)
end

-- header_filter(): headers every answer carries, errors in the API's shape
-- (tokengate.stages.respond.headers).
function _M.header_filter()
    return respond.headers(ngx.ctx)
end

-- body_filter(): the replacement error body, the backend's error in the API's shape, or
-- the usage watch (tokengate.stages.respond.body).
function _M.body_filter()
    local out = respond.body(ngx.ctx, ngx.arg[1], ngx.arg[2])
    if out then
        ngx.arg[1] = out
    end
end

-- log(): settle the reservation to what is billed (tokengate.stages.settle), then the
-- usage event and the sampled access-log line (tokengate.stages.event).
function _M.log()
    local ctx = ngx.ctx
    if not ctx.endpoint then
        -- a request whose access phase never ran
        local uri = ngx_var.uri
        local route = apis.route(uri)
        ctx.endpoint = apis.endpoint(apis.api(route, uri), route, uri)
    end
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
        return event.unauthenticated(ctx, status, aborted)
    end
    if batch.checking(ctx) then
        -- a batch line's check: nothing reserved, nothing billed
        return metrics.request(ctx, status, nil, config.get().models)
    end
    settle.finish(ctx)
    local ev = usage.record(ctx, status, aborted)
    ev.slo = slo.finish(ctx, ev.completion_tokens) or ev.slo
    settle.settle(ctx, ev, status)
    event.write(ctx, ev, status)
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
        local route = apis.route(path)
        ctx.api = apis.api(route, path)
        ctx.endpoint = apis.endpoint(ctx.api, route, path)
    end
    local doc = config.get()
    ctx.key = auth.authenticate(doc.keys, ngx_var.http_authorization,
        ctx.api and ctx.api.key(ngx_var), doc.previous_keys)
    local status = ngx_var.arg_status == "494" and 494 or tonumber(ngx_var.status) or 500
    return send(ctx, errors.nginx(status, false))
end

return _M
