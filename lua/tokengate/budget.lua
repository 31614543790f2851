-- Budgets: spend limits and token quotas per key (or key and model) per UTC day or
-- month (keys.<id>.budgets, tokengate.config.Budget), in the lua_shared_dict of the
-- limits, shared by every worker of this edge. A shared dict survives `nginx -s reload`.
--
-- Admission reserves the request's worst case: its prompt at the input price with the
-- context penalty (no cache hit assumed, except the tokens a prefix-routed request's
-- replica is expected to hold: reprice) plus its whole completion budget (max_tokens
-- effective x n x prompts; not the TPM's output_reserve, which may be less) at the
-- output price; the response settles the real cost. Spend is counted in integer
-- nano-units of the currency (1e-9), each request's cost rounded up, so the counter is
-- never below the ledger's sum and integer adds stay exact. incr-then-check (as in
-- tokengate.local_limit): incr is atomic across workers and returns the total with
-- every concurrent reservation, so concurrent requests can never reserve past a budget.
-- Reservations are counted apart from settled spend, per hour of admission (see KINDS),
-- so one whose settlement never comes stops counting within two hours.
--
-- With global_limits.enabled the same reservation is then made in Redis
-- (tokengate.global_limit.reserve_budget, one atomic script for every edge; spend
-- survives restarts): these counters are this edge's share, Redis's the total, which
-- decides. Each answer also tells this edge what Redis holds beyond its own counters
-- (learn); when Redis fails, that and these counters decide (fallback), and a budget
-- Redis has not answered for since this nginx started (its shared dict is empty after a
-- restart) is refused until Redis answers, so restarts never reset the count.
--
-- cost() is the formula of tokengate.ledger.calculator.charge (its docstring is the
-- source; tests/edge/test_budgets.py checks the two agree). nano() rounds it; the sidecar only
-- adds the nano-units it is sent.

local ngx = ngx
local errors = require "tokengate.errors"
local shdict = require "tokengate.shdict"

local floor, ceil, min, max = math.floor, math.ceil, math.min, math.max
local os_date = os.date
local format = string.format
local tostring = tostring
local ngx_log, ERR = ngx.log, ngx.ERR

local _M = {}

local NANO = 1e9
local PER_TOKENS = 1e6 -- prices are per 1M tokens
local DAY = 86400
local HOUR = 3600
-- an in-flight bucket made in hour h lives past the end of h + 1, the last hour that
-- reads it
local IN_FLIGHT_TTL = 2 * HOUR
local TTL = { day = 2 * DAY, month = 33 * DAY } -- a period's counters outlive it
local NAMES = { day = "daily", month = "monthly" }
-- a level as messages name it ("team eng", "organization acme"), tokengate.limits too
local LEVEL_NAMES = { team = "team ", org = "organization " }
_M.LEVEL_NAMES = LEVEL_NAMES
local NONE = {} -- a key without levels

local dict

-- init(dict_name) -> true | nil, "shared dict not found: <name>"
function _M.init(dict_name)
    dict = shdict.get(dict_name)
    return shdict.found(dict, dict_name)
end

-- cost(weights, billing, prompt, completion, cached, system) -> currency units.
-- weights: the model's cost {input, output, cached} per 1M tokens; billing: the compiled
-- billing section {exclude_system_tokens, context_penalty = {threshold, rate}}; token
-- counts as in vLLM's usage (prompt includes cached).
function _M.cost(weights, billing, prompt, completion, cached, system)
    local c = min(cached, prompt)
    local excluded = billing.exclude_system_tokens and min(system, prompt) or 0
    local from_cached = min(excluded, c)
    local cached_billed = c - from_cached
    local input_billed = (prompt - c) - (excluded - from_cached)
    local pen = billing.context_penalty
    local factor = prompt > pen.threshold and 1.0 + pen.rate * (prompt - pen.threshold)
        or 1.0
    return (input_billed * factor * weights.input + completion * weights.output
        + cached_billed * weights.cached) / PER_TOKENS
end

-- A request's cost or tokens above every limit (spend at most 1e18 nano-units, tokens
-- 1e12: tokengate.config) count as CAP, still above them, so they stay exact integers
-- within the wire's uint64 and Redis's int64 (tokengate.pb refuses larger).
local CAP = 2 ^ 60

-- nano(cost) -> whole nano-units, rounded up, at most CAP (also for NaN, which no
-- comparison with min's catches: a counter that took one would stay NaN)
local function nano(cost)
    local n = ceil(cost * NANO - 1e-6)
    if not (n <= CAP) then
        return CAP
    end
    return n
end
_M.nano = nano

-- days_from_civil(y, m, d) -> days since 1970-01-01 (H. Hinnant's algorithm,
-- "chrono-Compatible Low-Level Date Algorithms")
local function days_from_civil(y, m, d)
    if m <= 2 then
        y = y - 1
    end
    local era = floor(y / 400)
    local yoe = y - era * 400
    local mp = (m + 9) % 12
    local doy = floor((153 * mp + 2) / 5) + d - 1
    local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
    return era * 146097 + doe - 719468
end

-- period(kind, now) -> id (days or months since the epoch), seconds until it ends,
-- its end as "YYYY-MM-DDT00:00:00Z"
local function period(kind, now)
    if kind == "day" then
        local id = floor(now / DAY)
        return id, (id + 1) * DAY - now, os_date("!%Y-%m-%dT00:00:00Z", (id + 1) * DAY)
    end
    local t = os_date("!*t", floor(now))
    local y, m = t.year, t.month + 1
    if m > 12 then
        y, m = y + 1, 1
    end
    local ends = days_from_civil(y, m, 1) * DAY
    return (t.year - 1970) * 12 + t.month - 1, ends - now,
        format("%04d-%02d-01T00:00:00Z", y, m)
end

-- add_items(items, owner, list, model, now, level): appends to items the budgets of
-- list (a key's, or a level's: its team's, its organization's) that a request of
-- model counts against (model nil: every one). owner: the key id or the level id ("team:eng"); level: nil for
-- the key, else the compiled level {level, name, id}. A level's counters are named
-- "<level id>/<model or *>:<period>:<id>" in Redis (tokengate.redis_keys.budget_keys
-- keeps them apart from any key's) and "<level id>:..." here: every member of the
-- level counts in the same ones.
local function add_items(items, owner, list, model, now, level)
    for i = 1, #list do
        local b = list[i]
        if not model or not b.model or b.model == model.name then
            local id, left, ends = period(b.period, now)
            local counter = (b.model or "*") .. ":" .. b.period .. ":" .. id
            -- counter, spend_limit_nano, token_limit, ttl_s: the Redis counter
            -- (tokengate.pb.budget_request)
            items[#items + 1] = {
                b = b, left = left, ends = ends, name = owner .. ":" .. counter,
                scope = owner .. ":" .. (b.model or "*") .. ":" .. b.period,
                counter = level and (owner .. "/" .. counter) or counter, level = level,
                spend_limit_nano = b.spend_nano or 0, token_limit = b.tokens or 0,
                ttl_s = TTL[b.period],
            }
        end
    end
end

-- items(key, now, model) -> the budgets of the key and of its levels ({b, level,
-- counter, left (s), ends, ...}) that a request of model counts against; model nil:
-- every one (the quota endpoint's).
function _M.items(key, now, model)
    local items = {}
    add_items(items, key.id, key.budgets, model, now, nil)
    local levels = key.levels or NONE
    for i = 1, #levels do
        add_items(items, levels[i].id, levels[i].budgets, model, now, levels[i])
    end
    return items
end

-- request(key, model, doc, prompt, completion, now) -> the request's budget
-- reservation | nil (no budget applies). key: the compiled key (budgets list, levels
-- with theirs: every level's budgets are reserved together, so the tightest applies);
-- model: the compiled model (name, cost); doc: the compiled configuration (billing,
-- currency); prompt: prompt tokens; completion: the most completion tokens it may
-- generate (all completions of all prompts); scale: the price's multiplier (a batch
-- line's cost.batch, as the ledger and the settlement price it; else 1).
function _M.request(key, model, doc, prompt, completion, now, scale)
    local items = _M.items(key, now, model)
    if #items == 0 then
        return nil
    end
    scale = scale or 1
    return {
        key_id = key.id, items = items, currency = doc.currency, hour = floor(now / HOUR),
        cost = nano(_M.cost(model.cost, doc.billing, prompt, completion, 0, 0) * scale),
        tokens = min(prompt + completion, CAP), prompt = prompt, completion = completion,
        scale = scale,
    }
end


-- reprice(bud, weights, billing, cached): the reservation (request()'s, not reserved
-- yet) prices `cached` of its prompt tokens at the cached rate: those the chosen
-- replica is expected to serve from its prefix cache (tokengate.prefix). Tokens stay:
-- a token quota counts a cached token like any other, as the ledger does.
function _M.reprice(bud, weights, billing, cached)
    bud.cost = nano(_M.cost(weights, billing, bud.prompt, bud.completion, cached, 0)
        * bud.scale)
end

-- add(name, delta, ttl) -> the counter's new value | nil (logged)
local function add(name, delta, ttl)
    local v, err = dict:incr(name, delta, 0, ttl)
    if not v then
        ngx_log(ERR, "tokengate budget: incr ", name, ": ", err)
    end
    return v
end

-- What an item limits, by kind: spend in nano-units (the request's bud.cost) or tokens
-- (bud.tokens). An item's total is its settled counter ("bs"/"bt" .. name, kept for the
-- period) plus what is in flight, reserved and not settled yet, counted per UTC hour of
-- admission ("fs"/"ft" .. hour .. ":" .. name) in the hour's bucket and the next
-- one's: a reservation whose settlement never comes (its nginx worker crashed) stops
-- counting within two hours, not at the end of the period (tokengate.limits.budget
-- keeps Redis's the same way).
-- known: the key of what Redis last said beyond this edge's own counters (see learn);
-- reply: the field of a BudgetUsage with Redis's total.
local KINDS = {
    { kind = "spend", settled = "bs", flight = "fs", limit = "spend_nano", amount = "cost",
      total = "spent", known = "ks", reply = "spent_nano" },
    { kind = "tokens", settled = "bt", flight = "ft", limit = "tokens", amount = "tokens",
      total = "used", known = "kt", reply = "tokens" },
}
-- the shared-dict key that says Redis answered for a budget (key, scope and period kind,
-- any period id) since this nginx started (see learn)
local HEARD = "kh"

-- in_flight(k, hour, name) -> the shared-dict key of k's bucket of hour for item name
local function in_flight(k, hour, name)
    return k.flight .. hour .. ":" .. name
end

-- take_back(bud): the whole reservation leaves its buckets
local function take_back(bud)
    for i = 1, #bud.items do
        local it = bud.items[i]
        for j = 1, #KINDS do
            local k = KINDS[j]
            if it.b[k.limit] then
                add(in_flight(k, bud.hour, it.name), -bud[k.amount], IN_FLIGHT_TTL)
            end
        end
    end
end

-- amount(n) -> nano-units n as currency text, to the nano-unit without trailing zeros
-- (77500 is "0.0000775", not 6 decimals' "0.000077"; 1e10 is "10")
local function amount(n)
    local text = format("%.9f", n / NANO)
    return (text:gsub("%.?0+$", ""))
end

-- rejection(bud, it, kind, used) -> the 429 insufficient_quota error; kind "unknown":
-- the 503 of a budget that cannot be checked (see fallback); kind "rebuilding": the 503
-- of a key whose spend a ledger is rebuilding (Redis lost its data)
local function rejection(bud, it, kind, used)
    local b = it.b
    local scope = b.model and ("model " .. b.model) or "every model"
    if kind == "rebuilding" then
        return errors.new(503, format("The budgets of key %s cannot be checked now: the "
            .. "billing ledger is rebuilding the key's spend after its store lost its data. "
            .. "Please try again in a few seconds.", bud.key_id), nil, "budget_unavailable",
            nil, { ["Retry-After"] = "1" })
    end
    local lv = it.level
    local who = lv and (LEVEL_NAMES[lv.level] .. lv.name .. " (key " .. bud.key_id .. ")")
        or ("key " .. bud.key_id)
    if kind == "unknown" then
        return errors.new(503, format("The %s budget of %s (%s) cannot be checked now: "
            .. "the global limits are unreachable and this gateway has not learned its "
            .. "spend from them since it started. Please try again in a few seconds.",
            NAMES[b.period], who, scope), nil, "budget_unavailable", nil,
            { ["Retry-After"] = "1" })
    end
    local what
    if kind == "spend" then
        what = format("%s spend limit of %s %s (%s): %s spent or reserved, this request "
            .. "may cost up to %s", NAMES[b.period], amount(b.spend_nano), bud.currency, scope,
            amount(used), amount(bud.cost))
    else
        what = format("%s token quota of %d tokens (%s): %d used or reserved, this request "
            .. "may use up to %d", NAMES[b.period], b.tokens, scope, used, bud.tokens)
    end
    local retry = max(1, ceil(it.left))
    return errors.new(429, format("You exceeded your current quota on %s: the %s. It "
        .. "resets at %s (in %ds).", who, what, it.ends, retry), nil,
        "insufficient_quota", "insufficient_quota", { ["Retry-After"] = tostring(retry),
        ["X-Tokengate-Limit-Level"] = lv and lv.level or "key" })
end

-- refusal(bud, index, kind, used) -> the 429 of items[index] refusing: kind "spend" |
-- "tokens", used: its total before this request (nano-units or tokens); kind
-- "unknown": the 503 of a budget fallback cannot check; kind "rebuilding": the 503 of
-- a key whose spend a ledger is rebuilding.
function _M.refusal(bud, index, kind, used)
    return rejection(bud, bud.items[index], kind, used)
end

-- reserve(bud) -> true | nil, err (429 insufficient_quota). Sets each item's spent /
-- used: the totals after this reservation, for the headers. incr-then-check: the
-- bucket's incr counts every concurrent reservation; a settlement moves its amount from
-- the bucket to the settled counter settled-first, so a reservation that reads the two
-- meanwhile counts it twice (the safe side), never not at all.
function _M.reserve(bud)
    local items, hour = bud.items, bud.hour
    local taken = {} -- buckets added to so far, with their amounts
    for i = 1, #items do
        local it = items[i]
        local name = it.name
        for j = 1, #KINDS do
            local k = KINDS[j]
            local limit = it.b[k.limit]
            if limit then
                local amount = bud[k.amount]
                local key = in_flight(k, hour, name)
                -- an amount that can never fit (or NaN) is refused without touching
                -- the counter: a huge amount added and taken back blurs it in doubles
                local fits = amount <= limit
                local v
                if fits then
                    v = add(key, amount, IN_FLIGHT_TTL)
                else
                    v = (dict:get(key) or 0) + amount
                end
                if v then
                    if fits then
                        taken[#taken + 1] = key
                        taken[#taken + 1] = amount
                    end
                    v = v + (dict:get(in_flight(k, hour - 1, name)) or 0)
                        + (dict:get(k.settled .. name) or 0)
                    if not (v <= limit) then -- (a NaN total refuses too)
                        for t = 1, #taken, 2 do
                            add(taken[t], -taken[t + 1], IN_FLIGHT_TTL)
                        end
                        return nil, rejection(bud, it, k.kind, v - amount)
                    end
                end
                it[k.total] = v or 0
            end
        end
    end
    bud.admitted = true
    return true
end

-- local_usage(it, now) -> {spent_nano, tokens, reserved_nano, reserved_tokens}: what
-- this edge's counters hold for item it (budget.items) now: settled, and in flight in
-- this hour's bucket and the last's (the quota endpoint without Redis).
function _M.local_usage(it, now)
    local hour = floor(now / HOUR)
    local u = {}
    for j = 1, #KINDS do
        local k = KINDS[j]
        u[k.kind] = dict:get(k.settled .. it.name) or 0
        u[k.kind .. "_reserved"] = (dict:get(in_flight(k, hour, it.name)) or 0)
            + (dict:get(in_flight(k, hour - 1, it.name)) or 0)
    end
    return { spent_nano = u.spend, tokens = u.tokens,
             reserved_nano = max(0, u.spend_reserved),
             reserved_tokens = max(0, u.tokens_reserved) }
end

-- uncommit(bud): a later tier (Redis's counters) refused: the reservation is taken back.
function _M.uncommit(bud)
    if bud.admitted then
        bud.admitted = nil
        take_back(bud)
    end
end

-- learn(bud, usage, admitted): Redis answered bud's reservation (admitted, or refused)
-- with usage, per item {spent_nano, tokens}: every edge's totals, after this reservation
-- when admitted, before it when refused. Keeps per item what Redis holds beyond this
-- edge's own counters (the other edges' spend, the ledger's bill of spend no counter
-- saw: "ks"/"kt" .. name, nano-units / tokens) for fallback, marks the budget heard
-- from, and when admitted sets each item's spent / used to Redis's totals (the headers).
function _M.learn(bud, usage, admitted)
    for i = 1, #bud.items do
        local it, u = bud.items[i], usage[i]
        local ttl = TTL[it.b.period]
        for j = 1, #KINDS do
            local k = KINDS[j]
            if it.b[k.limit] then
                local total = u[k.reply]
                if not admitted then
                    total = total + bud[k.amount]
                end
                -- it[k.total]: this edge's counters with this reservation (reserve).
                -- Never below 0: Redis lacks only what this edge admitted on its own
                -- and the ledger has not billed yet, which its counters hold.
                dict:set(k.known .. it.name, max(0, total - it[k.total]), ttl)
                if admitted then
                    it[k.total] = u[k.reply]
                end
            end
        end
        dict:set(HEARD .. it.scope, true, ttl)
    end
end

-- fallback(bud) -> nil (admitted) | refusal {index, kind, used} (as refusal takes it).
-- Redis did not answer bud's reservation (reserve admitted it on this edge's counters):
-- each item's total is this edge's counters plus what Redis last held beyond them
-- (learn), so one edge in fallback stops where Redis's count would have (give or take
-- the reservations that were on their way to Redis at its last answer), and an nginx
-- restart (empty shared dicts) does not start the count again from nothing: a budget
-- Redis has not answered for since this nginx started is refused (kind "unknown", 503)
-- until it does. A budget heard from whose item has nothing known (a new period began
-- since) adds 0. incr-then-check, as reserve: each total includes every reservation made
-- before it on this edge. Sets the admitted items' spent / used (the headers).
function _M.fallback(bud)
    local items = bud.items
    for i = 1, #items do
        local it = items[i]
        for j = 1, #KINDS do
            local k = KINDS[j]
            local limit = it.b[k.limit]
            if limit then
                local beyond = dict:get(k.known .. it.name)
                if beyond == nil then
                    if not dict:get(HEARD .. it.scope) then
                        return { index = i, kind = "unknown" }
                    end
                    beyond = 0
                end
                local total = it[k.total] + beyond
                if not (total <= limit) then
                    return { index = i, kind = k.kind, used = total - bud[k.amount] }
                end
            end
        end
    end
    for i = 1, #items do
        local it = items[i]
        for j = 1, #KINDS do
            local k = KINDS[j]
            if it.b[k.limit] then
                it[k.total] = it[k.total] + (dict:get(k.known .. it.name) or 0)
            end
        end
    end
    return nil
end

-- settle(bud, tokens, cost) -> the real cost in nano-units | nil (not admitted). The
-- request ended having used tokens (prompt + completion) that cost cost (currency units,
-- tokengate.ledger.calculator's formula): the period it was admitted in is charged the
-- real amounts, and its reservation leaves the hour's bucket.
function _M.settle(bud, tokens, cost)
    if not bud.admitted then
        return nil
    end
    bud.admitted = nil
    local real_cost = nano(cost)
    for i = 1, #bud.items do
        local it = bud.items[i]
        for j = 1, #KINDS do
            local k = KINDS[j]
            if it.b[k.limit] then
                add(k.settled .. it.name, k.amount == "cost" and real_cost or tokens,
                    TTL[it.b.period])
                add(in_flight(k, bud.hour, it.name), -bud[k.amount], IN_FLIGHT_TTL)
            end
        end
    end
    return real_cost
end

-- tightest(cur, left, b, reset) -> {left, b, reset}: cur, or budget b with left when
-- less is left in it (cur nil: none yet)
local function tightest(cur, left, b, reset)
    if not cur or left < cur.left then
        return { left = left, b = b, reset = reset }
    end
    return cur
end

-- headers(h, bud): x-budget-{limit,remaining,reset}-{spend,tokens} of the budget of
-- each kind with the least left after this request's reservation (spend in the
-- currency, 6 decimals; reset as seconds, whole).
function _M.headers(h, bud)
    local spend, tokens
    for i = 1, #bud.items do
        local it = bud.items[i]
        local b = it.b
        if b.spend_nano and it.spent then
            spend = tightest(spend, b.spend_nano - it.spent, b, it.left)
        end
        if b.tokens and it.used then
            tokens = tightest(tokens, b.tokens - it.used, b, it.left)
        end
    end
    if spend then
        h["x-budget-limit-spend"] = format("%.6f", spend.b.spend)
        h["x-budget-remaining-spend"] = format("%.6f", max(0, spend.left) / NANO)
        h["x-budget-reset-spend"] = tostring(ceil(spend.reset))
    end
    if tokens then
        h["x-budget-limit-tokens"] = tokens.b.tokens
        h["x-budget-remaining-tokens"] = max(0, tokens.left)
        h["x-budget-reset-tokens"] = tostring(ceil(tokens.reset))
    end
end

return _M
