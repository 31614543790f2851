-- tokengate.upstream: the replica a request goes to under each routing.policy
-- (least_outstanding, round_robin, prefix: cost = (prompt - hit) + load_weight x
-- outstanding), after the rank and awake-before-asleep precedence; the rank itself
-- (tokengate.admission) and whether it is steady for a priority level.

local t = ...
local upstream = require "tokengate.upstream"
local prefix = require "tokengate.prefix"
local admission = require "tokengate.admission"

local case, eq = t.case, t.eq
local DICT = "tokengate_limits"
local EDGE = { upstream_eject_s = 10, upstream_max_fails = 1, upstream_health_timeout_ms = 100,
               upstream_health_interval_ms = 0, upstream_resolve_interval_ms = 0,
               dns_servers = {},
               admission = { metrics_interval_ms = 0, metrics_timeout_ms = 500,
                             metrics_stale_ms = 3000, small_prompt_tokens = 512,
                             small_prompt_headroom = 0.04, max_retry_after_s = 30 } }

-- model(policy, weight) -> a compiled model of two replicas a and b (fresh tables: the
-- index keys each replica's table)
local function model(policy, weight)
    return { name = "m", routing = { policy = policy, block_size = 16, load_weight = weight or 1 },
             upstreams = { { name = "a:1", addr = "127.0.0.1", port = 1 },
                           { name = "b:2", addr = "127.0.0.2", port = 2 } } }
end

local function setup()
    assert(upstream.init_worker({ edge = EDGE }, DICT))
    assert(prefix.init(DICT, DICT))
end

-- load(m, r, tokens): r serves requests of `tokens` outstanding tokens
local function load(m, r, tokens)
    upstream.take({}, m, upstream.others(m, r), nil, nil, 1, tokens)
end

-- hits(m, a, b) -> a plan whose counter reply gives a and b tokens of prefix hits
local function hits(m, a, b)
    return { hashes = "", n = 0, cap = 0, bs = 16,
             hits = { [m.upstreams[1].name] = a, [m.upstreams[2].name] = b } }
end

-- pick(m, prompt, plan, rank) -> the name of the replica a new request takes, its ctx
local function pick(m, prompt, plan, rank)
    local ctx = { prefix_plan = plan }
    local r = upstream.take(ctx, m, nil, rank, nil, prompt, prompt + 10)
    upstream.release(ctx, true)
    return r.name, ctx
end

case("least_outstanding: the fewest outstanding tokens; take counts them", function()
    setup()
    local m = model("least_outstanding")
    load(m, m.upstreams[1], 500)
    eq(upstream.outstanding("m", m.upstreams[1]), 500)
    eq((pick(m, 100)), "b:2")
    load(m, m.upstreams[2], 600)
    eq((pick(m, 100)), "a:1")
end)

case("a model without routing is least_outstanding", function()
    setup()
    local m = model("least_outstanding")
    m.routing = nil
    load(m, m.upstreams[2], 5)
    eq((pick(m, 100)), "a:1")
end)

case("round_robin: each replica in turn, whatever its load", function()
    setup()
    local m = model("round_robin")
    load(m, m.upstreams[1], 10000)
    local got = {}
    for i = 1, 6 do
        got[i] = (pick(m, 100))
    end
    eq(got[1] ~= got[2] and got[2] ~= got[3] and got[3] == got[5] and got[4] == got[6], true)
end)

case("round_robin: the rank still comes first", function()
    setup()
    local m = model("round_robin")
    local function rank(_, r) return r.name == "a:1" and 4 or 1 end -- a is FULL
    for _ = 1, 3 do
        eq((pick(m, 100, nil, rank)), "b:2")
    end
end)

case("prefix: cost = (prompt - hit) + load_weight x outstanding", function()
    setup()
    local m = model("prefix")
    local a = m.upstreams[1]
    -- prompt 1000, a holds 800: a costs 200 + outstanding(a), b 1000
    local plan = hits(m, 800, 0)
    load(m, a, 500) -- a: 700 < 1000
    local name, ctx = pick(m, 1000, plan)
    eq({ name, ctx.prefix_expected, ctx.prefix_source }, { "a:1", 800, "events" })
    load(m, a, 400) -- a: 200 + 900 = 1100 > 1000: the prefix spreads
    name, ctx = pick(m, 1000, plan)
    eq({ name, ctx.prefix_expected, ctx.prefix_source }, { "b:2", 0, "events" })
    -- a load weight of 0.5: 200 + 450 = 650 < 1000
    m.routing.load_weight = 0.5
    eq((pick(m, 1000, plan)), "a:1")
end)

case("prefix: equal costs fall to the rotation, as least_outstanding", function()
    setup()
    local m = model("prefix")
    local plan = hits(m, 0, 0)
    local seen = {}
    for _ = 1, 4 do
        seen[(pick(m, 100, plan))] = true
    end
    eq(seen, { ["a:1"] = true, ["b:2"] = true })
end)

case("prefix: without a plan (no hashes) the fewest outstanding tokens", function()
    setup()
    local m = model("prefix")
    load(m, m.upstreams[1], 50)
    local name, ctx = pick(m, 100, nil)
    eq({ name, ctx.prefix_expected, ctx.prefix_source }, { "b:2", nil, nil })
end)

case("prefix: rank and awake come before the hit", function()
    setup()
    local m = model("prefix")
    local plan = hits(m, 900, 0)
    local function rank(_, r) return r.name == "a:1" and 4 or 1 end
    eq((pick(m, 1000, plan, rank)), "b:2")
    upstream.mark_asleep("m", m.upstreams[1], true)
    eq((pick(m, 1000, plan)), "b:2")
end)

case("prefix: the approximate index sends a shared prefix where it went before", function()
    setup()
    local m = model("prefix")
    local hashes = {}
    for i = 1, 40 do
        hashes[i] = string.format("%08d", i)
    end
    local plan = prefix.plan({ block_hashes = table.concat(hashes), block_size = 16,
                               prefix_hits = {} }, 700, m.routing)
    local first, ctx = pick(m, 700, plan)
    eq({ ctx.prefix_expected, ctx.prefix_source }, { 0, "approximate" })
    local r = first == "a:1" and m.upstreams[1] or m.upstreams[2]
    prefix.sent("m", r, plan, 0)
    for _ = 1, 3 do
        local name
        name, ctx = pick(m, 700, plan)
        -- 40 blocks of the 43 full ones are held: 640 tokens
        eq({ name, ctx.prefix_expected, ctx.prefix_source }, { first, 640, "approximate" })
    end
    -- a replica taken out forgets what it held
    upstream.failed("m", r, "test")
    local name
    name, ctx = pick(m, 700, plan)
    eq({ name ~= first, ctx.prefix_expected }, { true, 0 })
end)

local R = { name = "a:1", addr = "127.0.0.1", port = 1 } -- the replica ranked below

-- metrics(kv, waiting, running): what worker 0 last read of R's /metrics
local function metrics(kv, waiting, running)
    local d = ngx.shared[DICT]
    d:set(upstream.key("kv:", "m", R), kv)
    d:set(upstream.key("wait:", "m", R), waiting)
    d:set(upstream.key("run:", "m", R), running)
    d:set(upstream.key("runat:", "m", R), 0)
end

-- rank(level, prompt) -> {rank, steady}
local function rank(level, prompt)
    return { admission.rank("m", R, level, prompt) }
end

case("rank: unknown, full by its queue and room are steady for the level", function()
    setup()
    assert(admission.init_worker({ edge = EDGE, models = {} }, DICT))
    local level = { kv_cache_threshold = 0.9, max_waiting = 4 }
    eq(rank(level, 100), { admission.UNKNOWN, true })
    metrics(0.5, 5, 10)
    eq(rank(level, 100), { admission.FULL, true })
    metrics(0.5, 0, 10)
    eq(rank(level, 100), { admission.ROOM, true })
end)

case("rank: what depends on the prompt or the requests in flight is not steady", function()
    setup()
    assert(admission.init_worker({ edge = EDGE, models = {} }, DICT))
    local level = { kv_cache_threshold = 0.9, max_waiting = 4 }
    metrics(0.92, 0, 10)
    eq(rank(level, 100), { admission.HEADROOM, false })     -- a small prompt only
    eq(rank(level, 5000), { admission.FULL, false })
    local seats = { kv_cache_threshold = 0.9, max_waiting = 4, max_running = 12 }
    metrics(0.5, 0, 10)
    eq(rank(seats, 100), { admission.ROOM, false })          -- 2 more and it is full
    metrics(0.5, 0, 12)
    eq(rank(seats, 100), { admission.FULL, false })
    -- a paced priority: its prefill lane is taken and freed by the requests sent
    local paced = { kv_cache_threshold = 0.9, max_waiting = 4, max_prefill_tokens = 2000 }
    metrics(0.5, 0, 10)
    eq(rank(paced, 100), { admission.ROOM, false })
    ngx.shared[DICT]:set(upstream.key("lane:", "m", R), true)
    eq(rank(paced, 100), { admission.FULL, false })
end)
