-- A request's rate limits across tiers, composed the way lua-resty-limit-traffic's
-- traffic.combine composes limiters: every tier is asked in order (incoming); when one
-- refuses, the tiers that had admitted take their reservation back (uncommit); when the
-- response ends, every tier that admitted settles to the real usage (settle).
--
-- Tiers: tokengate.local_limit (the shared-dict window of this edge, always first) and,
-- with global_limits.enabled, tokengate.global_limit (the window all edges share in
-- Redis). A tier that fails (the global sidecar down) is skipped: the tiers before it
-- decide. The x-ratelimit-* headers show the last tier that decided.
--
-- What a request reserves (DESIGN contract 3): RPM 1 and TPM
--     prompt + n x prompts x min(max_tokens_effective, model.output_reserve)
-- settled at the end by (prompt + completion) - reserved. Prompt tokens served from
-- vLLM's prefix cache count cached_tokens_weight (0..1; the key's, else the model's)
-- each: admission takes the weight off the tokens the chosen replica is expected to
-- hold (weigh: tokengate.prefix's expectation, 0 without one) and settlement charges
-- (prompt - cached) + weight x cached + completion with vLLM's reported cached_tokens
-- (charged); every tier settles to that same number. A key's budgets
-- (tokengate.budget, req.budget) are reserved after every rate tier admitted, in the
-- edge's counters and then, with global limits, in Redis's (which decide for all
-- edges; when they fail the edge's counters decide, counted from Redis's last answer,
-- and a budget Redis never answered for since nginx started is refused: 503
-- budget_unavailable), and settled with the real cost in both; a settlement that fails
-- is made by the ledger from the usage event (tokengate/ledger/budgets.py).

local ngx = ngx
local errors = require "tokengate.errors"
local local_limit = require "tokengate.local_limit"
local global_limit = require "tokengate.global_limit"
local budget = require "tokengate.budget"
local clock = require "tokengate.clock"

-- the windows' clock: ngx.now on a production edge (tokengate.clock says how tests move it)
local window_now = clock.window_now
local format = string.format
local tostring = tostring
local ceil, floor, min = math.ceil, math.floor, math.min

local _M = {}

local TIERS = { local_limit }
local global_budgets = false -- budgets are reserved in Redis too (global_limits.enabled)

-- init_worker(doc, hop_address, dict_name) -> true | nil, err. doc: the compiled config;
-- dict_name: the lua_shared_dict of the windows and the breakers.
function _M.init_worker(doc, hop_address, dict_name)
    local ok, err = local_limit.init(dict_name)
    if ok then
        ok, err = budget.init(dict_name)
    end
    if not ok then
        return nil, err
    end
    TIERS = { local_limit }
    global_budgets = doc.global_limits.enabled == true
    if global_budgets then
        ok, err = global_limit.init_worker(doc.edge, hop_address, ngx.shared[dict_name])
        if not ok then
            return nil, "global limits: " .. err
        end
        TIERS[2] = global_limit
    end
    return true
end

-- request(key, model, request_id) -> req: the limits a request is held to, before its
-- size is known. key: the compiled key {id, rpm, tpm, models}; model: a served model
-- name or nil (not known yet: model() names it once the body is read). A key's
-- per-model override replaces its limits for that model, in a window of its own
-- ("<key id>@<model>").
function _M.request(key, model, request_id)
    local req = { key_id = key.id, request_id = request_id, tokens = 0,
                  windows = key.windows }
    _M.model(req, key, model)
    return req
end

-- model(req, key, model): the request's model, known once its body is read (or its
-- stored response found): the key's limits for it (per-model override, window). The
-- same req: a request builds its limits once.
function _M.model(req, key, model)
    local override = model and key.models[model]
    req.model, req.per_model = model, override ~= nil
    req.bucket = override and (key.id .. "@" .. model) or key.id
    req.limits = override or key
end

-- peek(req) -> the local window's state without admitting anything (the headers of an
-- answer that is not admitted).
function _M.peek(req)
    return local_limit.peek(req.bucket, req.limits, window_now())
end

-- reservation(req, prompt, prompts, completion, n, output_reserve) -> TPM tokens: sets
-- req.tokens, req.prompt and req.out_reserve. prompt: prompt tokens; prompts: prompts in
-- the request (completions lists); completion: the completion budget (tokens); n:
-- completions asked for; output_reserve: the model's reserve per completion (tokens).
function _M.reservation(req, prompt, prompts, completion, n, output_reserve)
    local out = min(completion, output_reserve) * n * prompts
    req.prompt, req.out_reserve, req.tokens = prompt, out, prompt + out
    return req.tokens
end

-- weighted(cached, weight) -> the TPM tokens cached prompt tokens count (whole tokens)
local function weighted(cached, weight)
    return floor(cached * weight + 0.5)
end

-- cached_weight(key, model) -> the weight of one prefix-cache hit in TPM windows, 0..1:
-- keys.<k>.cached_tokens_weight, else models.<m>.cached_tokens_weight (the schema's
-- default is 0; a model without the field, compiled before it existed, counts hits in
-- full: 1)
function _M.cached_weight(key, model)
    local w = key.cached_tokens_weight
    if w == nil then
        w = model.cached_tokens_weight or 1
    end
    return w
end

-- weigh(req, weight, expected): before reserve, with the prompt tokens the chosen
-- replica is expected to serve from its prefix cache (tokens; nil or 0: none
-- expected): req.tokens counts them weight each instead of 1 (an expectation above
-- the prompt counts as the prompt). Sets req.cached_weight, which charged() uses.
function _M.weigh(req, weight, expected)
    req.cached_weight = weight
    if expected and expected > 0 and weight < 1 then
        local hit = min(expected, req.prompt or 0)
        req.tokens = req.tokens - (hit - weighted(hit, weight))
    end
end

-- charged(req, prompt, cached, completion) -> the TPM tokens the request used: prompt
-- tokens (cached ones, vLLM's usage cached_tokens, at req.cached_weight each) plus
-- completion tokens. Without weigh() every token counts 1.
function _M.charged(req, prompt, cached, completion)
    local w = req.cached_weight or 1
    local hit = min(cached or 0, prompt)
    return prompt - hit + weighted(hit, w) + completion
end

-- holder(req, st) -> who a state's window belongs to, as error messages name it:
-- "key <id>", "team <name>", "organization <name>" (st.level: tokengate.local_limit)
local function holder(req, st)
    local lv = st.level
    if lv then
        return budget.LEVEL_NAMES[lv.level] .. lv.name
    end
    return "key " .. req.key_id
end

-- rejection(req, st) -> the 429 (errors.new shape) of a refused state: which limit of
-- which level (the message, and X-Tokengate-Limit-Level: key | team | org),
-- Retry-After in whole seconds, and a request that alone exceeds the TPM limit is told
-- that retrying cannot help (x-should-retry: false) unless its prompt count is only the
-- estimate (req.estimated): then 503 count_unavailable, Retry-After 1.
local function rejection(req, st)
    local retry = st.retry_after
    local who = holder(req, st)
    local level = st.level and st.level.level or "key"
    local msg
    if st.reject == "requests" then
        msg = format("Rate limit reached for requests per minute (RPM) on %s: limit %d, "
            .. "remaining %d. Please try again in %ds.", who, st.rpm,
            st.remaining_requests, retry)
    elseif st.alone and req.estimated then
        -- The prompt's size is an over-count (the counter did not answer): the request
        -- may well fit, so this is not the final "too large" verdict.
        return errors.new(503, format("The prompt could not be counted in time (the "
            .. "estimate, %d tokens, is an upper bound and exceeds %s's limit of %d "
            .. "tokens per minute). Please try again.", req.prompt, who, st.tpm),
            nil, "count_unavailable", nil, { ["Retry-After"] = "1" })
    elseif st.alone then
        msg = format("Request too large for %s: it needs %d tokens (%d prompt + %d "
            .. "reserved for the completion) but the limit is %d tokens per minute, so "
            .. "retrying cannot help. Reduce the prompt or max_tokens.", who,
            req.tokens, req.tokens - req.out_reserve, req.out_reserve, st.tpm)
        -- Retry-After stays (every 429 has one); x-should-retry: false keeps the
        -- official openai clients from retrying what can never fit.
        return errors.new(429, msg, nil, "rate_limit_exceeded", st.reject,
            { ["Retry-After"] = tostring(retry), ["x-should-retry"] = "false",
              ["X-Tokengate-Limit-Level"] = level })
    else
        msg = format("Rate limit reached for tokens per minute (TPM) on %s: limit %d, "
            .. "remaining %d, requested %d (%d prompt + %d reserved for the completion). "
            .. "Please try again in %ds.", who, st.tpm, st.remaining_tokens,
            req.tokens, req.tokens - req.out_reserve, req.out_reserve, retry)
    end
    return errors.new(429, msg, nil, "rate_limit_exceeded", st.reject,
        { ["Retry-After"] = tostring(retry), ["X-Tokengate-Limit-Level"] = level })
end

-- reserve(req) -> true | nil, err (429)
--   Reserves req.tokens (and one request) in every tier. req.state, req.tier: the state
--   (x-ratelimit-* headers) and name ("local" | "global") of the tier that decided: the
--   last that admitted, or the one that refused. Admitted: req.admitted lists the tiers
--   to settle. Refused: what earlier tiers admitted is taken back.
function _M.reserve(req)
    local now = window_now()
    local admitted, n = {}, 0
    for i = 1, #TIERS do
        local t = TIERS[i]
        local st, refused = t.incoming(req, now)
        if st then
            n = n + 1
            admitted[n] = t
            req.state, req.tier = st, t.name
        elseif refused then
            for j = n, 1, -1 do
                admitted[j].uncommit(req)
            end
            req.state, req.tier = refused, t.name
            return nil, rejection(req, refused)
        end
    end
    local bud = req.budget
    if bud then
        local ok, err = budget.reserve(bud)
        if ok and global_budgets then
            -- admitted, or failed (nil, nil: the edge's counters decided), or refused
            local _, refusal = global_limit.reserve_budget(bud, req.request_id)
            if refusal then
                budget.uncommit(bud)
                ok, err = nil, budget.refusal(bud, refusal.index, refusal.kind, refusal.used)
            end
        end
        if not ok then
            for j = n, 1, -1 do
                admitted[j].uncommit(req)
            end
            return nil, err
        end
    end
    req.admitted = admitted
    return true
end

-- settle(req, actual, cost, charged): the request ended having used actual tokens
-- (prompt + completion) that cost cost (currency units; needed only with req.budget);
-- every tier that admitted it corrects its window to charged (charged(): cached prompt
-- tokens weighted; nil: actual), and its budgets their spend and tokens to actual
-- (budgets do not weigh cache hits: they bill them at the model's cached price).
function _M.settle(req, actual, cost, charged)
    local admitted = req.admitted
    if not admitted then
        return
    end
    for i = 1, #admitted do
        admitted[i].settle(req, charged or actual)
    end
    local bud = req.budget
    if bud then
        local real = budget.settle(bud, actual, cost)
        if real and global_budgets then
            global_limit.settle_budget(bud, req.request_id, actual, real)
        end
    end
end

-- duration(s) -> "250ms", "1.2s", "59s", "6m0s" (OpenAI's x-ratelimit-reset-* format).
-- s: seconds; each unit rounds up, and a value that rounds up to the next unit is
-- written in it: (0.999, 1) s is "1s" as (59.9, 60) s is "1m0s", never "1000ms" or "60s".
function _M.duration(s)
    if s <= 0 then
        return "0s"
    elseif s < 1 then
        local ms = ceil(s * 1000)
        if ms < 1000 then
            return format("%dms", ms)
        end
    end
    local t = ceil(s * 10) / 10
    if t < 60 then
        local txt = format("%.1f", t)
        return (txt:gsub("%.0$", "")) .. "s"
    end
    local whole = ceil(s)
    return format("%dm%ds", floor(whole / 60), whole % 60)
end

-- headers(h, st): writes x-ratelimit-{limit,remaining,reset}-{requests,tokens} into the
-- response header table h (ngx.header) from a state {rpm, tpm, remaining_requests,
-- remaining_tokens, reset_requests (s), reset_tokens (s)}.
function _M.headers(h, st)
    h["x-ratelimit-limit-requests"] = st.rpm
    h["x-ratelimit-limit-tokens"] = st.tpm
    h["x-ratelimit-remaining-requests"] = st.remaining_requests
    h["x-ratelimit-remaining-tokens"] = st.remaining_tokens
    h["x-ratelimit-reset-requests"] = _M.duration(st.reset_requests)
    h["x-ratelimit-reset-tokens"] = _M.duration(st.reset_tokens)
end

-- global_backing_off() -> true while the global tier is skipped after a failure
function _M.global_backing_off()
    return global_limit.backing_off()
end

return _M
