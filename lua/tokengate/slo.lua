-- Latency targets (routing.policy slo): each request's TTFT and TPOT targets and class,
-- a prediction of both on every replica, and what is done when no replica is predicted
-- to meet them. Long for one thing: the targets, the prediction and its online fit,
-- which read and write the same shared-dict rings and must stay in one module.
--
-- Targets: the key's slo (ttft_ms, tpot_ms) over the model's, over the request's
-- X-Tokengate-SLO-TTFT-Ms / X-Tokengate-SLO-TPOT-Ms headers (whole ms within
-- TTFT_BOUNDS / TPOT_BOUNDS; anything else is a 400 in the API's shape); the class is
-- the key's slo_class: interactive (waits until a replica is predicted to meet its TTFT
-- target or the target has passed, then goes), sheddable (refused at once, 503
-- slo_unattainable with Retry-After), batch (only into spare capacity: a replica with no
-- prefill of other requests queued, predicted to meet half its targets; else refused the
-- same way).
--
-- Prediction, per replica r, for a request whose prompt r must compute `uncached`
-- tokens of (its prompt tokens less r's expected prefix hit, tokengate.prefix):
--   TTFT(r) = a0_r + a1_r * uncached + a3_r * left_r + a2_r * running_r
--   TPOT(r) = b0_r + b1_r * ahead + b2_r * running_r
--     ahead = left_r + uncached, the prefill work ahead of the request's first token;
--     left_r: of queued_r, the uncached prompt tokens this edge sent to r whose first byte has not
--     come back yet (a shared-dict count: incr when sent, decr at the first byte or at
--     the end), less what r has computed of them since its queue last moved (a first
--     byte came back, or work arrived at an empty queue: the shared anchor), at the
--     rate the fit gives a prompt's own tokens (1 / a1_r tokens per ms):
--       left_r = |queued_r - (now - anchor_r) / a1_r|
--     (past all of queued_r, r is late, and as late again is what a request sent now
--     should expect: the lateness counts as work still ahead);
--     vLLM's scheduler serves prefills first come, first served, chunked to its token
--     budget (vllm/v1/core/sched/scheduler.py), so the head of the queue is the one
--     being computed and a prompt queued for a while is partly done: counting all of
--     queued_r over-predicts every request behind a long prompt;
--     a request's own tokens and the queue's left have slopes of their own: left_r is
--     an estimate (where r is in its steps, when first bytes come back, the host), and
--     one slope over both read a fraction of the cost per token from it (a noisy
--     feature's slope shrinks towards 0): long documents were predicted about half
--     their TTFT;
--     running_r: the requests this edge has on r now, this one included (their decode
--     steps lengthen every step, vLLM's scheduler runs decodes first).
-- The coefficients are learned online from r's answers: at an answer's first byte the
-- (uncached, left, running) its request was predicted with and the TTFT the edge observed
-- (forward to first byte) update the TTFT plane; at its end its TPOT ((end - first
-- byte) / (completion tokens - 1)) updates the TPOT plane. (A TTFT learned at the end
-- came a whole answer late, seconds: the fit lagged the load it predicts, and a fresh
-- edge predicted by the prior alone until its first answers had ended.) Each plane is
-- a least-squares fit with exponential forgetting (DECAY per answer) that minimises
-- sum((predicted - observed)^2 / observed): each answer weighs 1 / observed, between
-- plain least squares (the long prompts' seconds decide and every short one is
-- over-predicted) and the relative error's 1 / observed^2 (the many short answers
-- decide the slope, and the few ms of noise in each of them hid the cost per token:
-- queues of 3,000 tokens and more were predicted 15 to 55 % short); its slopes drawn
-- towards a prior's (PRIORS). Every answer is published in a shared ring per
-- replica (OBS_RING answers) and each worker folds in the answers of the others when
-- it learns its own (the fits are per worker, their data is the edge's: no
-- read-modify-write across workers); a decision folds only while a fit is new. A
-- decision reads two or three numbers per replica (queued_r, anchor_r, running_r; its
-- cost is measured and reported, decision_us).
--
-- Headroom of r for targets (T, P): min((T - TTFT(r)) / T, (P - TPOT(r)) / P); the
-- replica with the most headroom wins (tokengate.upstream, policy slo). Whether it is
-- predicted to meet them (decide) counts T from the request's arrival at the edge.

local errors = require "tokengate.errors"
local json = require "tokengate.json"
local shdict = require "tokengate.shdict"
local clock = require "tokengate.clock"
local metrics = require "tokengate.metrics"
local semaphore = require "ngx.semaphore"

local mono_ms = clock.mono_ms
local tonumber, pairs, tostring = tonumber, pairs, tostring
local match = string.match
local floor, abs, ceil, min, max = math.floor, math.abs, math.ceil, math.min, math.max
local type, setmetatable = type, setmetatable
local null = json.null

local _M = {}

local TTFT_BOUNDS = { 1, 600000 } -- ms a request may ask for its first token
local TPOT_BOUNDS = { 1, 60000 } -- ms a request may ask between its tokens
_M.TTFT_BOUNDS, _M.TPOT_BOUNDS = TTFT_BOUNDS, TPOT_BOUNDS
local DECAY = 0.97 -- weight left to the past at each observation (about 33 remembered)
local OBS_RING = 64 -- answers per replica kept in the shared ring for the other workers
-- the prior: the fits' coefficients before any answer (ms; per token; per request):
-- TTFT 20 ms with one request running, plus 1 s per 20,000 tokens of prefill ahead
-- (its own uncached tokens and those queued before it alike), plus 0.3 ms per running
-- request; TPOT 10 ms alone, 30 ms with 64 running, 0.5 ms more per 1,000 tokens of
-- prefill ahead. Once answers come, the slopes are drawn towards the prior's by
-- PRIOR_SHARE of the answers' own weight in each direction (a ridge: it keeps the fit
-- solvable while a feature does not vary, and is small beside what varies)
local PRIORS = {
    ttft = { 19.7, 0.05, 0.05, 0.3 }, -- c0, own uncached tokens, queued left, running
    tpot = { 10 - 20 / 63, 0.0005, 20 / 63 }, -- c0, tokens ahead, running
}
local PRIOR_SHARE = 0.02
local CLASSES = { interactive = true, sheddable = true, batch = true }
_M.CLASSES = CLASSES
local LEARNED = 8 -- TTFT answers a replica's fit learns before its predictions may hold
-- or refuse a request (headroom_left)
local WAIT_POLL_S = 0.01 -- how often a waiting interactive request looks again at the
-- latest (a first byte or an end in its own worker wakes it at once)
local NONE = {}
local wake -- this worker's semaphore of waiting interactive requests

-- number(v) -> v when it is a number, else nil (json null)
local function number(v)
    return type(v) == "number" and v or nil
end

local dict -- the upstream module's shared dict (queued prefill tokens per replica)
-- this worker's state per replica, keyed by the compiled replica's table (the same table
-- for the worker's life: a reload starts new workers): {ttft = fit, tpot = fit, qkey,
-- akey, okey: its shared-dict keys (queued tokens, anchor, answers ring), seen: the
-- last answer of the ring folded into the fits}; a fit keeps its solved coefficients
-- until its next answer
local replicas = setmetatable({}, { __mode = "k" })

-- init_worker(dict_name) -> true | nil, err
function _M.init_worker(dict_name)
    local err
    dict, err = shdict.get(dict_name)
    if not dict then
        return nil, err
    end
    wake = semaphore.new()
    return true
end

-- fit_new(kind) -> an empty least-squares fit of y = c0 + c1 x1 + ... + ck xk, k =
-- #PRIORS[kind] - 1 features, as its weighted sums: n (weight), s[i] (x_i), sy, sxx[i][j]
-- (x_i x_j), sxy[i] (x_i y); answers: how many observe() added; c: its coefficients
-- c[0..k] once solved (nil until then, and after each answer)
local function fit_new(kind)
    local k = #PRIORS[kind] - 1
    local f = { kind = kind, k = k, n = 0, sy = 0, s = {}, sxy = {}, sxx = {}, answers = 0 }
    for i = 1, k do
        f.s[i], f.sxy[i], f.sxx[i] = 0, 0, {}
        for j = 1, k do
            f.sxx[i][j] = 0
        end
    end
    return f
end

local A = {} -- solve()'s augmented normal equations (reused: no table per answer)

-- solve(f) -> f.c: the prior's coefficients before any answer, then the least-squares
-- fit of f's answers (normal equations, Gauss-Jordan elimination with partial pivoting)
-- with each slope drawn towards the prior's by PRIOR_SHARE of its feature's own weight
-- (a ridge; a feature that never varied from 0 keeps the prior's slope); slopes
-- clipped at 0 (more work ahead or more requests running never make a request faster),
-- then the intercept refitted, at least 0
local function solve(f)
    local p, k = PRIORS[f.kind], f.k
    local c = f.c_store or {}
    f.c_store = c
    if f.n <= 0 then
        for i = 0, k do
            c[i] = p[i + 1]
        end
        return c
    end
    -- rows 0..k, columns 0..k and k+1 (the right-hand side)
    for i = 0, k do
        local row = A[i] or {}
        A[i] = row
        for j = 0, k do
            if i == 0 and j == 0 then
                row[j] = f.n
            elseif i == 0 then
                row[j] = f.s[j]
            elseif j == 0 then
                row[j] = f.s[i]
            else
                row[j] = f.sxx[i][j]
            end
        end
        row[k + 1] = i == 0 and f.sy or f.sxy[i]
        if i > 0 then
            local r = PRIOR_SHARE * f.sxx[i][i] + 1e-9 * f.n
            row[i] = row[i] + r
            row[k + 1] = row[k + 1] + r * p[i + 1]
        end
    end
    for col = 0, k do
        local piv = col
        for i = col + 1, k do
            if abs(A[i][col]) > abs(A[piv][col]) then
                piv = i
            end
        end
        if A[piv][col] == 0 then
            for i = 0, k do
                c[i] = p[i + 1]
            end
            return c
        end
        A[col], A[piv] = A[piv], A[col]
        local rc = A[col]
        for i = 0, k do
            if i ~= col then
                local ri = A[i]
                local m = ri[col] / rc[col]
                if m ~= 0 then
                    for j = col, k + 1 do
                        ri[j] = ri[j] - m * rc[j]
                    end
                end
            end
        end
    end
    local c0 = f.sy
    for i = 1, k do
        local ci = A[i][k + 1] / A[i][i]
        if ci < 0 then
            ci = 0
        end
        c[i] = ci
        c0 = c0 - ci * f.s[i]
    end
    c0 = c0 / f.n
    c[0] = c0 > 0 and c0 or 0
    return c
end

-- state_of(model, r) -> this worker's state of replica r of model (replicas above)
local function state_of(model, r)
    local st = replicas[r]
    if not st then
        local tail = model .. "\0" .. r.name
        st = { ttft = fit_new("ttft"), tpot = fit_new("tpot"), qkey = "slq:" .. tail,
               akey = "sla:" .. tail, okey = "slo:" .. tail .. "\0", nkey = "sln:" .. tail,
               seen = 0 }
        replicas[r] = st
    end
    return st
end

-- coef(f) -> f's coefficients (a table c[0..k]), solved again only after an answer
-- changed f
local function coef(f)
    if not f.c then
        f.c = solve(f)
    end
    return f.c
end

local X = {} -- observe()'s features (reused)

-- observe(f, y, x1, x2, x3): one answer y (> 0) at features x1..xk (f.k of them), of
-- weight 1 / y, the past weighed down by DECAY
local function observe(f, y, x1, x2, x3)
    local d, k = DECAY, f.k
    local w = 1 / y
    X[1], X[2], X[3] = x1, x2, x3
    f.answers = f.answers + 1
    f.n, f.sy = f.n * d + w, f.sy * d + w * y
    local s, sxy, sxx = f.s, f.sxy, f.sxx
    for i = 1, k do
        local xi = X[i]
        s[i], sxy[i] = s[i] * d + w * xi, sxy[i] * d + w * xi * y
        local row = sxx[i]
        for j = 1, k do
            row[j] = row[j] * d + w * xi * X[j]
        end
    end
    f.c = nil
end

-- fold(st, upto): the answers of r's ring after st.seen, up to sequence number upto,
-- into this worker's fits (an answer overwritten before it was read is skipped), then
-- the fits solved
local function fold(st, upto)
    local okey = st.okey
    for seq = max(st.seen + 1, upto - OBS_RING + 1), upto do
        local v = dict:get(okey .. seq % OBS_RING)
        local s, own, left, running, ttft, tpot =
            match(v or "", "^(%d+) (%S+) (%S+) (%S+) (%S+) (%S+)$")
        if s and tonumber(s) == seq then
            own, left, running = tonumber(own), tonumber(left), tonumber(running)
            ttft, tpot = tonumber(ttft), tonumber(tpot)
            if ttft > 0 then
                observe(st.ttft, ttft, own, left, running)
            end
            if tpot > 0 then
                observe(st.tpot, tpot, own + left, running)
            end
        end
    end
    st.seen = upto
    -- solved here, at an answer, not in the next decision
    coef(st.ttft)
    coef(st.tpot)
end

-- learn(st, t, ttft, tpot): one answer of r (ms; 0: none: a first byte brings its
-- TTFT, the end its TPOT) of the request of ctx.slo t (its uncached tokens, the work
-- ahead and the running requests it was predicted with) into the shared ring, then
-- every answer of the ring this worker has not seen into its fits
local function learn(st, t, ttft, tpot)
    local own = t.uncached or 0
    local left = max(0, floor((t.ahead or own) - own))
    local seq = dict:incr(st.nkey, 1, 0)
    dict:set(st.okey .. seq % OBS_RING, seq .. " " .. own .. " " .. left .. " "
        .. (t.running or 1) .. " " .. ttft .. " " .. tpot)
    fold(st, seq)
end

-- queued(model, r) -> prefill tokens sent to r whose first token has not come back
function _M.queued(model, r)
    return dict and dict:get(state_of(model, r).qkey) or 0
end

-- state(model, r) -> this worker's state of replica r of model, for predict_state()
-- (the same table for the worker's life)
_M.state = state_of

-- predict_state(st, uncached, running, now) -> TTFT ms, TPOT ms, work ahead (tokens:
-- left_r + uncached, module comment) of a request whose prompt the replica of state st
-- (state()) computes `uncached` tokens of, with `running` requests on it (this one
-- included) at `now` (mono_ms()): predict()'s, for a decision that keeps st. Reads
-- queued_r, and anchor_r while queued_r > 0; the fits were solved when they learned
-- (a fit of fewer than LEARNED answers folds the ring first).
local function predict_state(st, uncached, running, now)
    local f, g = st.ttft, st.tpot
    if f.answers < LEARNED and dict then
        -- the answers the other workers published: a worker that served nothing yet
        -- learned nothing (only while the fit is new; then it folds at answers only)
        fold(st, dict:get(st.nkey) or 0)
    end
    local a = f.c or coef(f)
    local a1 = a[1]
    local left = dict and dict:get(st.qkey) or 0
    if left > 0 and a1 > 0 then
        local since = dict:get(st.akey)
        if since then
            -- the queue's work done at the fit's rate; past all of it, the replica is
            -- late (a stall, a preemption, steps longer than learned) and as late again
            -- is what a request sent now should expect: the lateness counts as work
            -- still ahead (without it, a stalled replica looked idle and drew every
            -- request until its first byte came back)
            left = abs(left - (now - since) / a1)
        end
    end
    local ahead = left + uncached
    local b = g.c or coef(g)
    return a[0] + a1 * uncached + a[2] * left + a[3] * running,
        b[0] + b[1] * ahead + b[2] * running, ahead
end
_M.predict_state = predict_state

-- predict(model, r, uncached, running, now) -> TTFT ms, TPOT ms, work ahead (tokens:
-- left_r + uncached, module comment) of a request whose prompt r computes `uncached`
-- tokens of, with `running` requests on r (this one included); now: mono_ms() if the
-- caller has it
function _M.predict(model, r, uncached, running, now)
    return predict_state(state_of(model, r), uncached, running, now or mono_ms())
end

-- backlog_s(model, replicas, running) -> seconds: the TTFT predicted now for a request
-- with nothing to prefill of its own, averaged over `replicas` (those not out): the
-- prefill queued on each and its running requests, in the time the replica's fit says
-- they cost (this worker's fits). running(r) -> requests on r. nil for no replica.
function _M.backlog_s(model, replicas, running)
    local sum, n = 0, 0
    for i = 1, #replicas do
        local r = replicas[i]
        sum = sum + _M.predict(model, r, 0, running(r) + 1)
        n = n + 1
    end
    return n > 0 and sum / n / 1000 or nil
end

-- headroom(ttft, tpot, t) -> the smaller of the two targets' shares left over (1: no
-- time used; below 0: a target missed) for targets t = {ttft_ms, tpot_ms}
function _M.headroom(ttft, tpot, t)
    return min((t.ttft_ms - ttft) / t.ttft_ms, (t.tpot_ms - tpot) / t.tpot_ms)
end

-- header_ms(v, bounds, name) -> whole ms | nil (no header) | false, err (bad value)
local function header_ms(v, bounds, name)
    if v == nil then
        return nil
    end
    if type(v) == "table" then
        return false, errors.new(400, "Send " .. name .. " once.", name, "invalid_slo")
    end
    local n = match(v, "^%s*(%d+)%s*$")
    n = n and tonumber(n)
    if not n or n < bounds[1] or n > bounds[2] then
        return false, errors.new(400, name .. " must be a whole number of milliseconds from "
            .. bounds[1] .. " to " .. bounds[2] .. "; got " .. errors.clip(tostring(v)) .. ".",
            name, "invalid_slo")
    end
    return n
end

-- targets(ctx, headers) -> true | nil, err (400 invalid_slo): ctx.slo = {ttft_ms,
-- tpot_ms, class} for a model routed by policy slo (the key's over the model's, the
-- request's headers over both); a model without targets anywhere has none (ctx.slo
-- stays nil: routed least outstanding). headers: ngx.req.get_headers()'s table.
function _M.targets(ctx, headers)
    local model, key = ctx.model_entry, ctx.key
    local ttft, err = header_ms(headers["x-tokengate-slo-ttft-ms"], TTFT_BOUNDS,
        "X-Tokengate-SLO-TTFT-Ms")
    if ttft == false then
        return nil, err
    end
    local tpot
    tpot, err = header_ms(headers["x-tokengate-slo-tpot-ms"], TPOT_BOUNDS,
        "X-Tokengate-SLO-TPOT-Ms")
    if tpot == false then
        return nil, err
    end
    local routing = model.routing
    if not (routing and routing.policy == "slo") then
        return true
    end
    -- (null in the compiled file is cjson's null, not nil)
    local ks, ms = key.slo, model.slo
    ks = type(ks) == "table" and ks or NONE
    ms = type(ms) == "table" and ms or NONE
    ttft = ttft or number(ks.ttft_ms) or number(ms.ttft_ms)
    tpot = tpot or number(ks.tpot_ms) or number(ms.tpot_ms)
    if ttft or tpot then
        -- a target not set anywhere is its bound's top for the decisions, and nil in
        -- what the request is told (header(), finish())
        ctx.slo = { ttft_ms = ttft or TTFT_BOUNDS[2], tpot_ms = tpot or TPOT_BOUNDS[2],
                    ttft_set = ttft ~= nil, tpot_set = tpot ~= nil,
                    class = CLASSES[key.slo_class] and key.slo_class or "interactive" }
    end
    return true
end

-- unattainable(ctx, ttft) -> the 503 of a request refused by its class: no replica is
-- predicted to meet its targets; Retry-After: the predicted TTFT beyond the target, s
local function unattainable(ctx, ttft)
    local t = ctx.slo
    local s = max(1, ceil((ttft - t.ttft_ms) / 1000))
    return errors.new(503, "No replica of model " .. errors.clip(ctx.model) .. " is "
        .. "predicted to meet this request's latency targets now (first token in "
        .. floor(ttft + 0.5) .. " ms against " .. t.ttft_ms .. " ms; " .. t.class
        .. " requests are not queued). Please retry after " .. s .. " s.", nil,
        "slo_unattainable", nil, { ["Retry-After"] = tostring(s) })
end

-- chosen(t, r, ttft, tpot, ahead, running): the prediction tokengate.upstream made for
-- the replica it chose (policy slo), kept in the request's targets t for decide()
function _M.chosen(t, r, ttft, tpot, ahead, running)
    t.on, t.p_ttft, t.p_tpot, t.p_ahead, t.p_running = r, ttft, tpot, ahead, running
end

-- prediction(ctx, r, running) -> TTFT ms, TPOT ms, ahead tokens, running requests for
-- replica r: the one its choice made (chosen()), else predicted now
local function prediction(ctx, r, running)
    local t = ctx.slo
    if t.on == r then
        return t.p_ttft, t.p_tpot, t.p_ahead, t.p_running
    end
    local n = running(ctx.model, r)
    local ttft, tpot, ahead = _M.predict(ctx.model, r,
        (ctx.token_estimate or 0) - (ctx.prefix_expected or 0), n)
    return ttft, tpot, ahead, n
end

-- headroom_left(ctx, r, ttft, tpot, deadline) -> the headroom (headroom()) of
-- predictions ttft, tpot (ms) on replica r against ctx.slo's targets, the TTFT target
-- being the time left until deadline (mono ms: the target from the request's arrival
-- at the edge, ctx.t0) at the choice that predicted them (ctx.slo.chose_at): below 0
-- for a predicted miss. 1 while r's TTFT fit (this worker's) has learned fewer than
-- LEARNED answers: the prior is a guess of no particular GPU (twice as slow as
-- `make bench-slo`'s simulated H100s, where the first interactive requests of a fresh
-- edge waited out their targets on it and then went anyway); its answers teach the
-- fit.
local function headroom_left(ctx, r, ttft, tpot, deadline)
    if state_of(ctx.model, r).ttft.answers < LEARNED then
        return 1
    end
    local t = ctx.slo
    -- the time of the choice that made the prediction (tokengate.upstream's), if any
    local left = deadline - (t.chose_at or mono_ms())
    if left <= 0 then
        return -1
    end
    return min((left - ttft) / left, (t.tpot_ms - tpot) / t.tpot_ms)
end

-- decide(ctx, choose, running) -> true | nil, err: the class's answer to the prediction
-- for ctx.replica (choose(ctx) -> replica | nil: takes the best one again and holds it
-- in ctx.replica; running(model_name, r) -> requests on r, this one included).
-- decision_us: the policy's choice (tokengate.upstream's, policy slo: from its start
-- to the prediction of the chosen replica in hand, shared dict reads of the choice
-- included; ctx.slo.decision_ms, added up over the choices before this decision: one
-- made again after a race or while held for room (tokengate.stages.route) too, not the
-- looks of a waiting request), without
-- the counting every policy does after it (the requests and tokens held on the
-- replica); predict_us (ctx.slo.predict_ms): the predictions alone, every replica of
-- every choice. A replica is predicted to miss by headroom_left(). A waiting
-- interactive request looks again when a first byte or an end in its worker wakes it,
-- at the latest after WAIT_POLL_S. Sets ctx.slo's decision ("met" |
-- "waited" | "late" | "refused"), predicted_ttft_ms, predicted_tpot_ms, ahead (tokens),
-- running, decision_us.
function _M.decide(ctx, choose, running)
    local t = ctx.slo
    local r = ctx.replica
    local ttft, tpot, ahead, n = prediction(ctx, r, running)
    t.decision_us = floor((t.decision_ms or 0) * 1000 + 0.5)
    local deadline = (ctx.t0 or mono_ms()) + t.ttft_ms
    local h = headroom_left(ctx, r, ttft, tpot, deadline)
    local decision = "met"
    -- spare capacity for batch: no prefill of others queued on the replica (a long
    -- prompt there delays every interactive request behind it) and half its targets left
    if h < 0 or t.class == "batch" and (h < 0.5 or _M.queued(ctx.model, r) > 0) then
        if t.class ~= "interactive" then
            t.decision, t.predicted_ttft_ms, t.predicted_tpot_ms = "refused", ttft, tpot
            return nil, unattainable(ctx, ttft)
        end
        -- interactive: wait until some replica is predicted to meet the target, or the
        -- target has passed
        decision = "late"
        while mono_ms() < deadline do
            wake:wait(WAIT_POLL_S)
            r = choose(ctx)
            if not r then
                return nil, errors.new(503, "No replica of model " .. errors.clip(ctx.model)
                    .. " has an address any more.", nil, "upstream_unavailable")
            end
            ttft, tpot, ahead, n = prediction(ctx, r, running)
            if headroom_left(ctx, r, ttft, tpot, deadline) >= 0 then
                decision = "waited"
                break
            end
        end
    end
    t.decision, t.predicted_ttft_ms, t.predicted_tpot_ms = decision, ttft, tpot
    t.ahead, t.running = ahead, n
    return true
end

-- header(t) -> X-Tokengate-SLO's value for ctx.slo t: "<class>; <decision>;
-- ttft=<predicted>/<target>; tpot=<predicted>/<target>" (ms, whole; "/<target>" left
-- out for a target set nowhere)
function _M.header(t)
    local pt, pp = t.predicted_ttft_ms, t.predicted_tpot_ms
    if not pt then
        return t.class .. "; " .. t.decision
    end
    return t.class .. "; " .. t.decision
        .. "; ttft=" .. floor(pt + 0.5) .. (t.ttft_set and "/" .. t.ttft_ms or "")
        .. "; tpot=" .. floor(pp + 0.5) .. (t.tpot_set and "/" .. t.tpot_ms or "")
end

-- sent(ctx): the request goes to its replica now: its uncached tokens join the
-- replica's queued prefill work until its first byte (first) or its end (finish); work
-- that finds the queue empty starts it (the anchor).
function _M.sent(ctx)
    local t = ctx.slo
    if not (t and t.decision and ctx.replica) or t.queued then
        return
    end
    local n = max(0, floor((ctx.token_estimate or 0) - (ctx.prefix_expected or 0)))
    local now = mono_ms()
    t.queued, t.queued_on, t.t_sent, t.uncached = n, ctx.replica, now, n
    local st = state_of(ctx.model, ctx.replica)
    if dict:incr(st.qkey, n, 0) == n then
        dict:set(st.akey, now)
    end
end

-- woken(): the waiting interactive requests of this worker look again now
local function woken()
    local waiting = -wake:count()
    if waiting > 0 then
        wake:post(waiting)
    end
end

-- dequeue(ctx, t): the request's uncached tokens leave its replica's queued prefill
-- work (once); the replica's queue has moved (the anchor) and the waiting requests of
-- this worker look again. -> the replica's state, nil when nothing was queued.
local function dequeue(ctx, t)
    if not (t and t.queued) then
        return nil
    end
    local st = state_of(ctx.model, t.queued_on)
    dict:incr(st.qkey, -t.queued, 0)
    dict:set(st.akey, mono_ms())
    t.queued = false
    woken()
    return st
end

-- first(ctx, answered): the answer's first byte (ctx.t_first set): the request's
-- prefill is done (dequeue). answered: the replica answered the request (2xx, not an
-- error the edge rewrites): then its TTFT (forward to first byte, ms) is learned by the
-- replica's TTFT fit (learn(): every worker's) and its prediction error observed.
function _M.first(ctx, answered)
    local t = ctx.slo
    local st = dequeue(ctx, t)
    if not (st and answered and ctx.t_first and t.t_sent) then
        return
    end
    local ttft = ctx.t_first - t.t_sent
    if t.predicted_ttft_ms and ttft > 0 then
        metrics.slo_error(ctx.model, t.queued_on.name, (t.predicted_ttft_ms - ttft) / ttft)
    end
    -- 0.001 ms: an answer at once still weighs 1 / y within bounds
    learn(st, t, max(ttft, 0.001), 0)
end

-- finish(ctx, completion) -> the usage event's slo object | nil: the queued count let
-- go of if no byte came (dequeue: nothing learned), the observed TPOT (ms) learned by
-- the replica's TPOT fit (an answer of at least 2 completion tokens); observed TTFT
-- (forward to first byte, ms) and TPOT and their predictions in the object; the
-- waiting requests of this worker look again (a request ended).
function _M.finish(ctx, completion)
    local t = ctx.slo
    if not t then
        return nil
    end
    dequeue(ctx, t)
    local ev = { class = t.class, decision = t.decision,
                 ttft_target_ms = t.ttft_set and t.ttft_ms or null,
                 tpot_target_ms = t.tpot_set and t.tpot_ms or null, decision_us = t.decision_us,
                 predict_us = t.predict_ms and floor(t.predict_ms * 1000 + 0.5) }
    if t.predicted_ttft_ms then
        ev.predicted_ttft_ms = floor(t.predicted_ttft_ms * 1000 + 0.5) / 1000
        ev.predicted_tpot_ms = floor(t.predicted_tpot_ms * 1000 + 0.5) / 1000
        ev.ahead_tokens, ev.running = t.ahead and floor(t.ahead + 0.5), t.running
    end
    local r = t.queued_on
    if r and ctx.t_first and t.t_sent then
        ev.observed_ttft_ms = floor((ctx.t_first - t.t_sent) * 1000 + 0.5) / 1000
        if completion and completion >= 2 then
            local tpot = (mono_ms() - ctx.t_first) / (completion - 1)
            ev.observed_tpot_ms = floor(tpot * 1000 + 0.5) / 1000
            learn(state_of(ctx.model, r), t, 0, tpot)
        end
    end
    woken()
    return ev
end

return _M
