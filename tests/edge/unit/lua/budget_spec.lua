-- tokengate.budget: the cost formula, nano-unit rounding, UTC day / month periods and the
-- shared-dict reservations of spend limits and token quotas, with the time given as now.
-- NOW is 2026-12-03T07:04:02.153Z: day 20790, hour 498967, month 683 since 1970-01.

local t = ...
local budget = require "tokengate.budget"

local case, eq = t.case, t.eq
local DICT = "tokengate_limits"
local NOW = 1796281442.153
local CAP = 2 ^ 60
local DAY_LEFT = 20791 * 86400 - NOW -- seconds to 2026-12-04T00:00:00Z

-- prices that are exact in binary, so every expected cost is one correctly rounded
-- division: USD per 1M tokens
local MODEL = { name = "m", cost = { input = 0.5, output = 2, cached = 0.125 } }
local function billing(exclude, threshold, rate)
    return { exclude_system_tokens = exclude or false,
             context_penalty = { threshold = threshold or 1e9, rate = rate or 0 } }
end
local DOC = { currency = "USD", billing = billing() }

local function setup()
    assert(budget.init(DICT))
    return ngx.shared[DICT]
end

-- key(budgets...) -> a compiled key "k1" with these budgets (tokengate.config's shape:
-- spend in the currency and spend_nano, tokens, model, period)
local function key(...)
    return { id = "k1", budgets = { ... } }
end
local function spend(amount, period, model)
    return { period = period or "day", spend = amount, spend_nano = amount * 1e9,
             model = model }
end
local function tokens(n, period, model)
    return { period = period or "day", tokens = n, model = model }
end

-- reserved(k, prompt, completion) -> the budget request of key k at NOW for that many
-- tokens (completion: 0 when nil), reserved: it must be admitted
local function reserved(k, prompt, completion)
    local bud = budget.request(k, MODEL, DOC, prompt, completion or 0, NOW)
    assert(budget.reserve(bud))
    return bud
end

-- ------------------------------------------------------------ cost and nano

case("init: a missing shared dict is named", function()
    eq({ budget.init("no_such_dict") }, { nil, "shared dict not found: no_such_dict" })
end)

case("cost: prompt at the input price, completion at the output price", function()
    eq(budget.cost(MODEL.cost, billing(), 1000, 500, 0, 0), 0.0015)
    eq(budget.cost(MODEL.cost, billing(), 0, 0, 0, 0), 0)
end)

case("cost: cached tokens at the cached price, never more than the prompt", function()
    eq(budget.cost(MODEL.cost, billing(), 1000, 0, 400, 0), 0.00035)
    eq(budget.cost(MODEL.cost, billing(), 1000, 0, 2000, 0), 0.000125)
end)

case("cost: excluded system tokens come off the cached ones first", function()
    -- 300 system tokens all cached: 100 cached and 600 input billed
    eq(budget.cost(MODEL.cost, billing(true), 1000, 0, 400, 300), 0.0003125)
    -- 500 system, 200 cached: 0 cached and 500 input billed
    eq(budget.cost(MODEL.cost, billing(true), 1000, 0, 200, 500), 0.00025)
    -- more system tokens than prompt tokens: nothing billed
    eq(budget.cost(MODEL.cost, billing(true), 1000, 0, 0, 5000), 0)
    -- not excluded: system tokens are ordinary input
    eq(budget.cost(MODEL.cost, billing(false), 1000, 0, 0, 300), 0.0005)
end)

case("cost: the context penalty scales uncached input above the threshold", function()
    local b = billing(false, 1000, 2 ^ -10)
    -- 1024 tokens above: factor 2
    eq(budget.cost(MODEL.cost, b, 2024, 0, 0, 0), 0.002024)
    eq(budget.cost(MODEL.cost, b, 2024, 0, 24, 0), 0.002003)
    -- at the threshold: factor 1
    eq(budget.cost(MODEL.cost, b, 1000, 0, 0, 0), 0.0005)
end)

case("nano: whole nano-units, rounded up, float noise forgiven", function()
    eq(budget.nano(0.0015), 1500000)
    eq(budget.nano(1e-9), 1)
    eq(budget.nano(1.5e-9), 2)
    eq(budget.nano(1e-7), 100) -- 1e-7 * 1e9 is 100.00000000000001
    t.ok(budget.nano(0) == 0, "nano(0) == 0") -- (-0: ceil(-1e-6))
    eq(budget.nano(1e9), 1e18)
end)

case("nano: NaN, infinities and huge costs count as 2^60", function()
    eq(budget.nano(0 / 0), CAP)
    eq(budget.nano(math.huge), CAP)
    eq(budget.nano(CAP / 1e9 * 2), CAP)
end)

-- ------------------------------------------------------------ request and periods

case("request: no budget, or none for this model, is nil", function()
    eq(budget.request(key(), MODEL, DOC, 10, 10, NOW), nil)
    eq(budget.request(key(spend(1, "day", "other")), MODEL, DOC, 10, 10, NOW), nil)
end)

case("request: a daily spend limit of every model", function()
    local k = key(spend(10))
    eq(budget.request(k, MODEL, DOC, 1000, 500, NOW), {
        key_id = "k1", currency = "USD", hour = 498967, cost = 1500000, tokens = 1500,
        prompt = 1000, completion = 500, scale = 1,
        items = { {
            b = k.budgets[1], left = DAY_LEFT, ends = "2026-12-04T00:00:00Z",
            name = "k1:*:day:20790", scope = "k1:*:day", counter = "*:day:20790",
            spend_limit_nano = 1e10, token_limit = 0, ttl_s = 172800 } } })
end)

case("reprice: expected cached tokens at the cached price, tokens unchanged", function()
    local bud = budget.request(key(spend(10)), MODEL, DOC, 1000, 500, NOW)
    -- 400 cached: 600 x 0.5 + 400 x 0.125 + 500 x 2 per 1M = 0.00135 USD
    budget.reprice(bud, MODEL.cost, DOC.billing, 400)
    eq({ bud.cost, bud.tokens }, { 1350000, 1500 })
    -- the context penalty stays on the uncached input, as the ledger prices it
    local pen = billing(false, 500, 0.001)
    budget.reprice(bud, MODEL.cost, pen, 400)
    eq(bud.cost, budget.nano(budget.cost(MODEL.cost, pen, 1000, 500, 400, 0)))
end)

case("request and reprice: a batch line's reservation at its price's scale", function()
    local bud = budget.request(key(spend(10)), MODEL, DOC, 1000, 500, NOW, 0.5)
    eq({ bud.cost, bud.tokens }, { 750000, 1500 })
    budget.reprice(bud, MODEL.cost, DOC.billing, 400)
    eq(bud.cost, 675000)
end)

case("request: a monthly token quota of one model, across the new year", function()
    local k = key(tokens(5000, "month", "m"), spend(1, "day", "other"))
    local bud = budget.request(k, MODEL, DOC, 1000, 500, NOW)
    eq(bud.items, { {
        b = k.budgets[1], left = 1798761600 - NOW, ends = "2027-01-01T00:00:00Z",
        name = "k1:m:month:683", scope = "k1:m:month", counter = "m:month:683",
        spend_limit_nano = 0, token_limit = 5000, ttl_s = 2851200 } })
end)

case("request: periods on a leap day", function()
    local at = 1835438400 -- 2028-02-29T12:00:00Z
    local bud = budget.request(key(spend(1, "day"), spend(1, "month")), MODEL, DOC, 1, 1, at)
    eq({ bud.items[1].counter, bud.items[1].left, bud.items[1].ends },
        { "*:day:21243", 43200, "2028-03-01T00:00:00Z" })
    eq({ bud.items[2].counter, bud.items[2].left, bud.items[2].ends },
        { "*:month:697", 43200, "2028-03-01T00:00:00Z" })
end)

case("request: the last millisecond of a day and of a month", function()
    local last = 1798761599.999 -- 2026-12-31T23:59:59.999Z
    local bud = budget.request(key(spend(1, "day"), spend(1, "month")), MODEL, DOC, 1, 1, last)
    eq({ bud.items[1].counter, bud.items[1].ends }, { "*:day:20818", "2027-01-01T00:00:00Z" })
    eq({ bud.items[2].counter, bud.items[2].ends }, { "*:month:683", "2027-01-01T00:00:00Z" })
    bud = budget.request(key(spend(1, "month")), MODEL, DOC, 1, 1, 1798761600)
    eq({ bud.items[1].counter, bud.items[1].left, bud.items[1].ends },
        { "*:month:684", 31 * 86400, "2027-02-01T00:00:00Z" })
end)

case("request: tokens and cost above every limit count as 2^60", function()
    local bud = budget.request(key(spend(1)), MODEL, DOC, 1e12, 1e24, NOW)
    eq({ bud.cost, bud.tokens }, { CAP, CAP })
end)

-- ------------------------------------------------------------ reserve and settle

case("reserve: within the limits, totals set for the headers", function()
    local dict = setup()
    local bud = budget.request(key(spend(10), tokens(5000)), MODEL, DOC, 1000, 500, NOW)
    eq({ budget.reserve(bud) }, { true })
    eq({ bud.items[1].spent, bud.items[2].used, bud.admitted }, { 1500000, 1500, true })
    eq(dict:get("fs498967:k1:*:day:20790"), 1500000)
    eq(dict:get("ft498967:k1:*:day:20790"), 1500)
end)

case("reserve: a token quota refuses the request that would pass it", function()
    local dict = setup()
    local k = key(tokens(2000))
    reserved(k, 1000)
    local bud = budget.request(k, MODEL, DOC, 800, 300, NOW)
    local ok, err = budget.reserve(bud)
    eq(ok, nil)
    local retry = tostring(math.ceil(DAY_LEFT))
    eq(err, { status = 429, type = "insufficient_quota", code = "insufficient_quota",
        message = "You exceeded your current quota on key k1: the daily token quota of 2000 "
            .. "tokens (every model): 1000 used or reserved, this request may use up to 1100. "
            .. "It resets at 2026-12-04T00:00:00Z (in " .. retry .. "s).",
        headers = { ["Retry-After"] = retry, ["X-Tokengate-Limit-Level"] = "key" } })
    eq(dict:get("ft498967:k1:*:day:20790"), 1000)
    eq(bud.admitted, nil)
end)

case("reserve: a spend limit's message gives amounts to the nano-unit", function()
    setup()
    local k = key(spend(0.0000775, "month", "m"))
    local bud = reserved(k, 100, 10) -- 70 USD per 1M: 70000 nano
    local _, err = budget.reserve(budget.request(k, MODEL, DOC, 100, 10, NOW))
    eq(err.message, "You exceeded your current quota on key k1: the monthly spend limit of "
        .. "0.0000775 USD (model m): 0.00007 spent or reserved, this request may cost up "
        .. "to 0.00007. It resets at 2027-01-01T00:00:00Z (in "
        .. math.ceil(1798761600 - NOW) .. "s).")
end)

case("reserve: whole currency amounts are written without decimals", function()
    setup()
    local k = key(spend(10))
    local _, err = budget.reserve(budget.request(k, MODEL, DOC, 4e6, 5e6, NOW)) -- 12 USD
    eq(err.message, "You exceeded your current quota on key k1: the daily spend limit of 10 "
        .. "USD (every model): 0 spent or reserved, this request may cost up to 12. It resets "
        .. "at 2026-12-04T00:00:00Z (in " .. math.ceil(DAY_LEFT) .. "s).")
end)

case("reserve: an amount that can never fit leaves the counter untouched", function()
    local dict = setup()
    local bud = budget.request(key(tokens(100)), MODEL, DOC, 1e12, 1e24, NOW)
    local ok = budget.reserve(bud)
    eq(ok, nil)
    eq(dict:get("ft498967:k1:*:day:20790"), nil)
end)

case("reserve: the previous hour's bucket and the settled spend count", function()
    local dict = setup()
    dict:set("ft498966:k1:*:day:20790", 600)
    dict:set("bt" .. "k1:*:day:20790", 300)
    local k = key(tokens(1000))
    local bud = reserved(k, 100)
    eq(bud.items[1].used, 1000)
    eq((budget.reserve(budget.request(k, MODEL, DOC, 1, 0, NOW))), nil)
    -- two hours on, the old bucket is no longer read
    eq(budget.reserve(budget.request(k, MODEL, DOC, 500, 0, NOW + 7200)), true)
end)

case("reserve: a later item's refusal takes back the earlier items'", function()
    local dict = setup()
    local bud = budget.request(key(spend(10), tokens(100)), MODEL, DOC, 100, 1, NOW)
    eq(budget.reserve(bud), nil)
    eq(dict:get("fs498967:k1:*:day:20790"), 0)
    eq(dict:get("ft498967:k1:*:day:20790"), nil)
end)

case("uncommit takes the reservation back, once", function()
    local dict = setup()
    local bud = reserved(key(tokens(1000)), 100)
    budget.uncommit(bud)
    budget.uncommit(bud)
    eq(dict:get("ft498967:k1:*:day:20790"), 0)
end)

case("settle: the real amounts move to the settled counters", function()
    local dict = setup()
    local bud = reserved(key(spend(10), tokens(5000)), 1000, 500)
    eq(budget.settle(bud, 1100, 0.00055), 550000)
    eq(dict:get("fs498967:k1:*:day:20790"), 0)
    eq(dict:get("bs" .. "k1:*:day:20790"), 550000)
    eq(dict:get("bt" .. "k1:*:day:20790"), 1100)
    eq(budget.settle(bud, 1100, 0.00055), nil) -- settled once only
end)

case("settle: a request never admitted settles nothing", function()
    local dict = setup()
    local bud = budget.request(key(spend(10)), MODEL, DOC, 1000, 500, NOW)
    eq(budget.settle(bud, 1, 1), nil)
    eq(dict:get("bs" .. "k1:*:day:20790"), nil)
end)

-- ------------------------------------------------------------ learn and fallback

case("fallback: a budget Redis never answered for is refused as unknown", function()
    setup()
    local bud = reserved(key(tokens(1000)), 100)
    eq(budget.fallback(bud), { index = 1, kind = "unknown" })
    local err = budget.refusal(bud, 1, "unknown")
    eq({ err.status, err.code, err.type, err.headers }, { 503, "budget_unavailable",
        "server_error", { ["Retry-After"] = "1" } })
end)

case("learn then fallback: what Redis holds beyond this edge counts", function()
    local dict = setup()
    local k = key(tokens(1000))
    local bud = reserved(k, 100)
    -- Redis: 700 used by every edge with this reservation
    budget.learn(bud, { { spent_nano = 0, tokens = 700 } }, true)
    eq(dict:get("kt" .. "k1:*:day:20790"), 600)
    eq(bud.items[1].used, 700)
    local next_bud = reserved(k, 200) -- this edge: 300
    eq(budget.fallback(next_bud), nil)
    eq(next_bud.items[1].used, 900)
    local third = reserved(k, 200) -- this edge: 500, + 600 beyond
    eq(budget.fallback(third), { index = 1, kind = "tokens", used = 900 })
end)

case("learn: a refusal's totals are before the reservation", function()
    local dict = setup()
    local bud = reserved(key(tokens(1000)), 100)
    budget.learn(bud, { { spent_nano = 0, tokens = 950 } }, false)
    eq(dict:get("kt" .. "k1:*:day:20790"), 950)
    eq(bud.items[1].used, 100)
end)

case("learn: what is beyond is never below 0", function()
    local dict = setup()
    local bud = reserved(key(tokens(1000)), 100)
    budget.learn(bud, { { spent_nano = 0, tokens = 40 } }, true)
    eq(dict:get("kt" .. "k1:*:day:20790"), 0)
end)

-- ------------------------------------------------------------ headers

case("headers: the budget of each kind with the least left", function()
    setup()
    local k = key(spend(10), spend(1, "month"), tokens(5000), tokens(2000, "month"))
    local bud = reserved(k, 1000, 500)
    local h = {}
    budget.headers(h, bud)
    eq(h, {
        ["x-budget-limit-spend"] = "1.000000", ["x-budget-remaining-spend"] = "0.998500",
        ["x-budget-reset-spend"] = tostring(math.ceil(1798761600 - NOW)),
        ["x-budget-limit-tokens"] = 2000, ["x-budget-remaining-tokens"] = 500,
        ["x-budget-reset-tokens"] = tostring(math.ceil(1798761600 - NOW)) })
end)
