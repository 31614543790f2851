-- Access stage "route" and the balancer: where the request goes. A replica with room
-- (tokengate.upstream, tokengate.admission), chosen before anything is reserved, else a
-- wait in the key's queue (tokengate.queue) or a 503; the replica woken from idle unload
-- once the request is admitted (tokengate.idle); then the request forwarded: its count
-- in X-Token-Count, its body, the path the edge matched. The balancer phase hands nginx
-- that replica, and another one on a retry.

local ngx = ngx
local errors = require "tokengate.errors"
local metrics = require "tokengate.metrics"
local upstream = require "tokengate.upstream"
local admission = require "tokengate.admission"
local prefix = require "tokengate.prefix"
local queue = require "tokengate.queue"
local slo = require "tokengate.slo"
local idle = require "tokengate.idle"
local budget = require "tokengate.budget"
local apis = require "tokengate.apis"
local body_mod = require "tokengate.body"
local json = require "tokengate.json"
local trace = require "tokengate.trace"
local clock = require "tokengate.clock"
local balancer = require "ngx.balancer"

local ngx_req, ngx_log, ngx_exit, ERR = ngx.req, ngx.log, ngx.exit, ngx.ERR
local ngx_now, ngx_sleep, ngx_update_time = ngx.now, ngx.sleep, ngx.update_time
local mono_ms = clock.mono_ms
local json_set = json.set
local tostring, type = tostring, type
local floor, max = math.floor, math.max

local NO_HEADERS = {} -- a request without target headers (read only)
local HOLD_POLL_S = 0.002 -- a held request looks for room this often (an engine step
                          -- of an 8B model on an H100 is about 7 ms)

-- choose(ctx) -> replica | nil: tokengate.slo.decide's choice again of a request that
-- waits for its targets (not pinned: any replica). Not a closure per request: a
-- closure's creation stops LuaJIT's trace of the access phase.
local function choose(ctx)
    return upstream.take(ctx, ctx.model_entry, nil, admission.rank, ctx.key.admission,
        ctx.token_estimate or 0, ctx.limit_req.tokens)
end

local _M = {}

-- hold(ctx, model, tried, prompt, tokens) -> replica, rank | nil: a request whose best
-- replica is full waits up to its priority's hold_ms (edge.admission.priorities) for
-- one with room, looking again every HOLD_POLL_S, holding no replica meanwhile; then
-- the best replica and its rank (FULL when none freed). A batch line held here takes a
-- seat or a prefill lane (tokengate.admission) within a poll of its freeing, where a
-- 503 sends it back to tokengate-batch for a round trip and a pause; its priority's
-- bounds still apply, so the priorities above keep their room. nil: no replica has an
-- address any more.
local function hold(ctx, model, tried, prompt, tokens)
    local level = ctx.key.admission
    local ms = level.hold_ms
    local r, rank = ctx.replica, admission.FULL
    if type(ms) ~= "number" or ms <= 0 then
        return r, rank
    end
    metrics.incr("admission_held")
    local deadline = ngx_now() + ms / 1000
    repeat
        upstream.release(ctx, true)
        ngx_sleep(HOLD_POLL_S)
        ngx_update_time()
        r, rank = upstream.take(ctx, model, tried, admission.rank, level, prompt, tokens)
    until not r or rank ~= admission.FULL or ngx_now() >= deadline
    return r, rank
end

-- unavailable(model, why) -> the 503 of a model none of whose replicas has an address
local function unavailable(model, why)
    return errors.new(503, "No replica of model " .. model.name .. " has an " .. why
        .. " Please retry.", nil, "upstream_unavailable", nil, { ["Retry-After"] = "5" })
end

-- engine_priority(ctx, body): the request's vLLM priority is the edge's, never the
-- client's: vLLM (--scheduling-policy priority) admits a lower value first and preempts
-- the highest when its KV cache runs short, so a client's own value could jump every
-- queue. A model whose replicas run that policy (models.<name>.scheduling_policy) gets
-- the vllm_priority of the request's admission priority (a batch line's:
-- batch.priority's) when it is not 0, vLLM's default; any other request goes without
-- one (vLLM 0.32 reads and ignores it under fcfs). Only for routes whose vLLM request
-- model defines the field (the API module's FIELDS).
local function engine_priority(ctx, body)
    local fields = ctx.api.FIELDS[ctx.route]
    if not (fields and fields.priority) then
        return
    end
    local p = ctx.model_entry.scheduling_policy == "priority"
        and ctx.key.admission.vllm_priority or 0
    if p == 0 then
        if body.priority == nil then
            return
        end
        p = nil
    end
    json_set(body, "priority", p)
    body_mod.changed(body)
end

-- replica(ctx, doc) -> true | nil, err (503, 429): the replica that will serve the
-- request, chosen before anything is reserved: one with room in its KV cache for the
-- key's priority and below the model's max_concurrency, else one whose metrics are
-- unknown (tokengate.admission); when the best is full, the request is held up to
-- its priority's hold_ms (hold()), then shed (503 overloaded, Retry-After), or with
-- edge.queue.enabled waits in its key's queue (tokengate.queue: also while other
-- requests of its model wait) and takes a replica when dispatched. The replica carries the request's tokens from here (upstream.take),
-- so the requests that arrive while this one waits for its limits see it. A request
-- pinned to a replica (ctx.pin: the one that holds the stored response it names) goes
-- there, full or not. A budget reservation prices the prompt tokens the replica is
-- expected to serve from its prefix cache (ctx.prefix_expected, routing.policy prefix)
-- at the model's cached rate. Then the body gets the edits that need the replica or
-- that the counter does not read (the API module's placed: chat's and completions'
-- stream options, the Responses API's response id naming the replica; the vLLM
-- priority, engine_priority). A request with
-- latency targets (routing.policy slo, tokengate.slo) is then answered by its class when
-- no replica is predicted to meet them: an interactive one waits, a sheddable or batch
-- one is refused (503 slo_unattainable).
function _M.replica(ctx, doc)
    if ctx.local_answer then
        return true -- answered by the edge: no replica
    end
    local model = ctx.model_entry
    local pin = ctx.pin
    local prompt, tokens = ctx.token_estimate or 0, ctx.limit_req.tokens
    local tried = pin and upstream.others(model, pin)
    -- the request's own targets: every header read (get_headers(0): past the 100 a
    -- plain call reads, or a bad value behind 100 others went unchecked), only when one
    -- of the two is there ($http_*: no table built for the others)
    local v = ngx.var
    local targeted, terr = slo.targets(ctx, (v.http_x_tokengate_slo_ttft_ms
        or v.http_x_tokengate_slo_tpot_ms) and ngx_req.get_headers(0) or NO_HEADERS)
    if not targeted then
        return nil, terr
    end
    local r, rank = upstream.take(ctx, model, tried, admission.rank, ctx.key.admission,
        prompt, tokens)
    if not r then
        return nil, unavailable(model, "address yet (its host names did not resolve).")
    end
    local queueing = not ctx.no_body and queue.enabled(doc)
    if queueing then
        ctx.queue_ms = 0 -- X-Tokengate-Queue-Ms on every answer while queueing is on
    elseif rank == admission.FULL and not ctx.no_body then
        r, rank = hold(ctx, model, tried, prompt, tokens)
        if not r then
            return nil, unavailable(model, "address any more.")
        end
    end
    if not ctx.no_body
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
            return nil, unavailable(model, "address any more.")
        end
    end
    if rank == admission.HEADROOM then
        metrics.incr("admission_headroom")
    end
    if ctx.slo and not pin then
        local sok, serr = slo.decide(ctx, choose, upstream.in_flight)
        if not sok then
            upstream.release(ctx, true)
            return nil, serr
        end
    end
    admission.sent(model.name, ctx.replica, ctx.key.admission, prompt)
    local bud = ctx.limit_req.budget
    if bud and ctx.prefix_expected and ctx.prefix_expected > 0 then
        -- the tokens the replica is expected to serve from its prefix cache are priced
        -- at the cached rate; the settlement prices what vLLM reports
        budget.reprice(bud, model.cost, doc.billing, ctx.prefix_expected)
    end
    if ctx.body then
        ctx.api.placed(ctx, ctx.body)
        engine_priority(ctx, ctx.body)
    end
    return true
end

-- awake(ctx) -> true | nil, err (503 model_waking): the request waits while its replica
-- wakes from idle unload (tokengate.idle).
function _M.awake(ctx)
    return idle.hold(ctx)
end

-- sent(ctx): the request goes to ctx.replica: its prompt's blocks are recorded there
-- (tokengate.prefix.sent; policy prefix, a count with block hashes).
local function sent(ctx)
    local plan = ctx.prefix_plan
    if plan and ctx.replica then
        prefix.sent(ctx.model, ctx.replica, plan, floor((ctx.prefix_expected or 0) / plan.bs))
    end
end

-- forward(ctx): the request, admitted, goes to its replica: the body the edge parsed
-- (the client's bytes when the edge changed nothing, else its encoding after the last
-- change: tokengate.body.text), with its count, to the path the edge matched
-- (proxy_pass without a URI would send the client's raw request line).
function _M.forward(ctx)
    sent(ctx)
    slo.sent(ctx)
    ngx_req.set_header("X-Token-Count", ctx.token_estimate)
    ngx_req.set_header("X-Token-Count-Source", ctx.count_source)
    -- whose request it is, for the replica's engine record (tokengate_vllm.edge): a
    -- record whose usage event never comes (a worker killed mid-stream) is billed to
    -- this key by the ledger. Set, never passed on: a client's own value is replaced.
    ngx_req.set_header("X-Tokengate-Key", ctx.key.id)
    ngx_req.set_header("X-Tokengate-Endpoint", ctx.endpoint)
    local body = ctx.body
    if body then
        local text, encoded = body_mod.text(body)
        if encoded then
            ngx_req.set_body_data(text)
        end
    end
    -- a stored response's path is the client's, normalized (its id was checked)
    ngx_req.set_uri(apis.PATHS[ctx.route] or ctx.uri)
    trace.forward(ctx)
    ctx.proxied = true
end

-- balance(ctx): the balancer phase: the request's replica. Called again when nginx
-- retries, which it does only for a replica that failed before anything of the request
-- was sent to it (nginx never resends a POST): that one counts a failure and another
-- untried replica takes over.
function _M.balance(ctx)
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

return _M
