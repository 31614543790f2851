-- tokengate.local_limit: the sliding-window RPM / TPM counters of one edge, with the
-- time given as now. T0 is the start of a minute window: 1796281440 s is minute
-- 29938024 since the epoch (2026-12-03T07:04:00Z).

local t = ...
local local_limit = require "tokengate.local_limit"

local case, eq = t.case, t.eq
local DICT = "tokengate_limits"
local T0, W0 = 1796281440, 29938024

local function setup()
    assert(local_limit.init(DICT))
    return ngx.shared[DICT]
end

-- state(fields) -> a state as peek / incoming return it, fields over these defaults
local function state(fields)
    local st = { window = W0, rpm = 3, tpm = 1000, remaining_requests = 3,
                 remaining_tokens = 1000, reset_requests = 0, reset_tokens = 0 }
    for k, v in pairs(fields) do
        st[k] = v
    end
    return st
end

local LIMITS = { rpm = 3, tpm = 1000 }

-- admit(tokens, now, limits) -> incoming's answer for bucket "k", as a list
local function admit(tokens, now, limits)
    local req = { bucket = "k", limits = limits or LIMITS, tokens = tokens }
    return { local_limit.incoming(req, now) }, req
end

case("init: a missing shared dict is named", function()
    eq({ local_limit.init("no_such_dict") }, { nil, "shared dict not found: no_such_dict" })
    eq({ local_limit.init(DICT) }, { true })
end)

case("the window is 60 s, numbered in minutes since the epoch", function()
    setup()
    eq(local_limit.WINDOW, 60)
    eq(local_limit.peek("k", LIMITS, T0).window, W0)
    eq(local_limit.peek("k", LIMITS, T0 + 59.999).window, W0)
    eq(local_limit.peek("k", LIMITS, T0 + 60).window, W0 + 1)
    eq(local_limit.peek("k", LIMITS, T0 - 0.001).window, W0 - 1)
    eq(local_limit.peek("k", LIMITS, 0).window, 0)
end)

case("peek of an empty bucket: everything remains, nothing to reset", function()
    setup()
    eq(local_limit.peek("k", LIMITS, T0 + 30), state({}))
end)

case("an admission counts one request and its tokens in the current window", function()
    local dict = setup()
    local got, req = admit(400, T0 + 15)
    eq(got, { state({ remaining_requests = 2, remaining_tokens = 600, reset_requests = 105,
                      reset_tokens = 105 }) })
    eq(req.window, W0)
    eq(dict:get("r" .. W0 .. ":k"), 1)
    eq(dict:get("t" .. W0 .. ":k"), 400)
    eq(dict:ttl("r" .. W0 .. ":k") > 124, true)
end)

case("buckets do not share counts", function()
    setup()
    admit(400, T0)
    eq(local_limit.peek("k@m", LIMITS, T0), state({}))
end)

case("the previous window weighs by how much of it still overlaps the last 60 s", function()
    setup()
    admit(400, T0 + 10)
    admit(400, T0 + 20) -- window W0: 2 requests, 800 tokens
    -- a quarter into the next window: used = 800 * 0.75 = 600, 2 * 0.75 = 1.5
    eq(local_limit.peek("k", LIMITS, T0 + 75), state({ window = W0 + 1,
        remaining_requests = 1, remaining_tokens = 400, reset_requests = 45,
        reset_tokens = 45 }))
    -- two windows on, nothing counts any more
    eq(local_limit.peek("k", LIMITS, T0 + 120), state({ window = W0 + 2 }))
end)

case("requests over the RPM limit are refused and take their increment back", function()
    local dict = setup()
    admit(1, T0)
    admit(1, T0 + 1)
    admit(1, T0 + 2)
    local got = admit(1, T0 + 15)
    -- next window, a quarter in: 3 * (1 - 0.25 - g) + 1 <= 3 when g >= 1/3 of it:
    -- 45 s + 20 s
    eq(got, { nil, state({ remaining_requests = 0, remaining_tokens = 997,
        reset_requests = 105, reset_tokens = 105, reject = "requests", retry_after = 65 }) })
    eq(dict:get("r" .. W0 .. ":k"), 3)
    eq(dict:get("t" .. W0 .. ":k"), 3)
end)

case("tokens over the TPM limit are refused and take both increments back", function()
    local dict = setup()
    admit(900, T0)
    local got = admit(200, T0 + 30)
    -- next window: 900 * (1 - g) + 200 <= 1000 when g >= 1/9: 30 s + 6.67 s
    eq(got, { nil, state({ remaining_requests = 2, remaining_tokens = 100,
        reset_requests = 90, reset_tokens = 90, reject = "tokens", retry_after = 37 }) })
    eq(dict:get("r" .. W0 .. ":k"), 1)
    eq(dict:get("t" .. W0 .. ":k"), 900)
end)

case("retry_after within the window, once the previous window slid out enough", function()
    setup()
    admit(800, T0 - 30) -- the previous window
    -- a quarter in: 800 * 0.75 = 600 used; 500 more fit once 800 * (1 - f) <= 500,
    -- f = 0.375: 7.5 s later, rounded up
    local got = admit(500, T0 + 15)
    eq(got[2].reject, "tokens")
    eq(got[2].retry_after, 8)
    eq(got[2].remaining_tokens, 400)
    eq(got[2].reset_tokens, 45)
    -- and it is admitted then
    eq(admit(500, T0 + 22.5)[1].remaining_tokens, 0)
end)

case("retry_after is at least 1 s and whole", function()
    setup()
    admit(800, T0 - 30)
    -- 800 * (1 - f) + 500 <= 1000 from f = 0.375; asked at f = 0.37 (0.3 s before)
    local got = admit(500, T0 + 22.2)
    eq(got[2].reject, "tokens")
    eq(got[2].retry_after, 1)
end)

case("a request above the TPM limit alone is refused without counting", function()
    local dict = setup()
    admit(10, T0)
    local got = admit(1001, T0 + 6)
    eq(got, { nil, state({ remaining_requests = 2, remaining_tokens = 990,
        reset_requests = 114, reset_tokens = 114, reject = "tokens", alone = true,
        retry_after = 60 }) })
    eq(dict:get("r" .. W0 .. ":k"), 1)
end)

case("a request of exactly the TPM limit fits an empty window", function()
    setup()
    eq(admit(1000, T0)[1].remaining_tokens, 0)
end)

case("settle corrects the admitted window by actual - reserved", function()
    local dict = setup()
    local _, req = admit(500, T0 + 59)
    local_limit.settle(req, 120) -- returns 380 tokens
    eq(dict:get("t" .. W0 .. ":k"), 120)
    local_limit.settle(req, 620) -- 120 more than reserved
    eq(dict:get("t" .. W0 .. ":k"), 240)
    -- settled after the window ended: still the admitted window's count, which weighs
    -- 59/60 a second into the next one: 1000 - 240 * 59 / 60
    eq(local_limit.peek("k", LIMITS, T0 + 61).remaining_tokens, 764)
end)

case("settle with no difference writes nothing", function()
    local dict = setup()
    local req = { bucket = "k", window = W0, tokens = 50 }
    local_limit.settle(req, 50)
    eq(dict:get("t" .. W0 .. ":k"), nil)
end)

case("uncommit takes back one request and the reservation", function()
    local dict = setup()
    admit(100, T0)
    local _, req = admit(300, T0 + 1)
    local_limit.uncommit(req)
    eq(dict:get("r" .. W0 .. ":k"), 1)
    eq(dict:get("t" .. W0 .. ":k"), 100)
end)

case("remaining counts are floored, never negative", function()
    local dict = setup()
    dict:set("t" .. (W0 - 1) .. ":k", 1001)
    dict:set("r" .. (W0 - 1) .. ":k", 4)
    local st = local_limit.peek("k", LIMITS, T0) -- f = 0: 1001 and 4 used
    eq(st.remaining_tokens, 0)
    eq(st.remaining_requests, 0)
    -- f = 0.00625 (0.375 s in, exact in binary): 1000 * 0.99375 = 993.75 used
    dict:set("t" .. (W0 - 1) .. ":k", 1000)
    eq(local_limit.peek("k", LIMITS, T0 + 0.375).remaining_tokens, 6)
    eq(local_limit.peek("k", LIMITS, T0 + 30).remaining_tokens, 500)
end)

case("reset: 2 - f windows with a current count, 1 - f with only a previous one", function()
    local dict = setup()
    dict:set("r" .. (W0 - 1) .. ":k", 1)
    local st = local_limit.peek("k", LIMITS, T0 + 12)
    eq({ st.reset_requests, st.reset_tokens }, { 48, 0 })
    dict:set("t" .. W0 .. ":k", 1)
    st = local_limit.peek("k", LIMITS, T0 + 12)
    eq({ st.reset_requests, st.reset_tokens }, { 48, 108 })
end)

case("concurrent admissions never pass the limit (incr-then-check)", function()
    setup()
    local admitted = 0
    for i = 1, 10 do
        if admit(1, T0 + i / 10)[1] then
            admitted = admitted + 1
        end
    end
    eq(admitted, 3)
end)

-- a key of a team of an organization: the levels' windows (tokengate.config.teams)
local TEAM = { id = "team:t", level = "team", name = "t", rpm = 100, tpm = 500 }
local ORG = { id = "org:o", level = "org", name = "o", rpm = 2, tpm = 10000 }

local function admit_levels(tokens, now)
    local req = { bucket = "k", limits = LIMITS, tokens = tokens, windows = { TEAM, ORG } }
    return { local_limit.incoming(req, now) }, req
end

case("levels: every window counts the admission, the tightest one answers", function()
    local dict = setup()
    local got, req = admit_levels(400, T0 + 15)
    eq(got[1].level, TEAM)
    eq(got[1].remaining_tokens, 100)
    eq(req.window, W0)
    eq({ dict:get("r" .. W0 .. ":k"), dict:get("r" .. W0 .. ":team:t"),
         dict:get("r" .. W0 .. ":org:o") }, { 1, 1, 1 })
    eq({ dict:get("t" .. W0 .. ":k"), dict:get("t" .. W0 .. ":team:t"),
         dict:get("t" .. W0 .. ":org:o") }, { 400, 400, 400 })
    local_limit.settle(req, 300)
    eq({ dict:get("t" .. W0 .. ":k"), dict:get("t" .. W0 .. ":team:t"),
         dict:get("t" .. W0 .. ":org:o") }, { 300, 300, 300 })
end)

case("levels: a level that refuses is named, and the windows before it take it back",
    function()
        local dict = setup()
        admit_levels(100, T0 + 15)
        admit_levels(100, T0 + 16)
        -- the organization's RPM of 2 is spent; the key's and the team's still fit
        local got = admit_levels(100, T0 + 17)
        eq(got[1], nil)
        eq({ got[2].level, got[2].reject, got[2].rpm }, { ORG, "requests", 2 })
        eq({ dict:get("r" .. W0 .. ":k"), dict:get("r" .. W0 .. ":team:t"),
             dict:get("r" .. W0 .. ":org:o") }, { 2, 2, 2 })
        eq({ dict:get("t" .. W0 .. ":k"), dict:get("t" .. W0 .. ":team:t") }, { 200, 200 })
    end)

case("levels: uncommit takes the admission back from every window", function()
    local dict = setup()
    local _, req = admit_levels(50, T0 + 15)
    local_limit.uncommit(req)
    eq({ dict:get("r" .. W0 .. ":k"), dict:get("r" .. W0 .. ":team:t"),
         dict:get("r" .. W0 .. ":org:o") }, { 0, 0, 0 })
    eq({ dict:get("t" .. W0 .. ":k"), dict:get("t" .. W0 .. ":team:t"),
         dict:get("t" .. W0 .. ":org:o") }, { 0, 0, 0 })
end)
