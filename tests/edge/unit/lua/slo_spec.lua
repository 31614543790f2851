-- tokengate.slo and tokengate.upstream's policy slo: targets from the key, the model and
-- the request's headers (bad values refused), the prediction from the prefill queued
-- on each replica and its learned lines, the replica with the most headroom.

local t = ...
local slo = require "tokengate.slo"
local upstream = require "tokengate.upstream"
local prefix = require "tokengate.prefix"

local case, eq = t.case, t.eq
local DICT = "tokengate_limits"
local EDGE = { upstream_eject_s = 10, upstream_max_fails = 1, upstream_health_timeout_ms = 100,
               upstream_health_interval_ms = 0, upstream_resolve_interval_ms = 0,
               dns_servers = {} }

local function model(ttft, tpot)
    return { name = "m", routing = { policy = "slo", block_size = 16, load_weight = 0.25 },
             slo = { ttft_ms = ttft, tpot_ms = tpot },
             upstreams = { { name = "a:1", addr = "127.0.0.1", port = 1 },
                           { name = "b:2", addr = "127.0.0.2", port = 2 } } }
end

local function setup()
    assert(upstream.init_worker({ edge = EDGE }, DICT))
    assert(prefix.init(DICT, DICT))
    assert(slo.init_worker(DICT))
end

local function ctx_of(m, key)
    return { model = m.name, model_entry = m, key = key or { id = "k" } }
end

-- queue(m, r, tokens): a request of `tokens` uncached prompt tokens sent to replica r
-- (decided "met"); returns its ctx, whose slo.first(ctx) ends the prefill it queued
local function queue(m, r, tokens)
    local ctx = ctx_of(m)
    assert(slo.targets(ctx, {}))
    ctx.replica, ctx.token_estimate, ctx.prefix_expected = r, tokens, 0
    ctx.slo.decision = "met"
    slo.sent(ctx)
    return ctx
end

case("targets: the model's, then the key's, then the request's headers", function()
    setup()
    local m = model(500, 50)
    local ctx = ctx_of(m)
    assert(slo.targets(ctx, {}))
    eq(ctx.slo.ttft_ms, 500)
    eq(ctx.slo.tpot_ms, 50)
    eq(ctx.slo.class, "interactive")
    ctx = ctx_of(m, { id = "k", slo = { ttft_ms = 300 }, slo_class = "sheddable" })
    assert(slo.targets(ctx, { ["x-tokengate-slo-tpot-ms"] = "20" }))
    eq(ctx.slo.ttft_ms, 300)
    eq(ctx.slo.tpot_ms, 20)
    eq(ctx.slo.class, "sheddable")
end)

case("targets: a model routed otherwise gets none; its headers are still checked", function()
    setup()
    local m = model(500, 50)
    m.routing.policy = "prefix"
    local ctx = ctx_of(m)
    assert(slo.targets(ctx, { ["x-tokengate-slo-ttft-ms"] = "100" }))
    eq(ctx.slo, nil)
    local ok, err = slo.targets(ctx, { ["x-tokengate-slo-ttft-ms"] = "soon" })
    eq(ok, nil)
    eq(err.status, 400)
end)

case("targets: bad header values are 400 invalid_slo naming the header", function()
    setup()
    local m = model(500, 50)
    for _, v in ipairs({ "0", "-5", "1.5", "600001", "", "12ms" }) do
        local ok, err = slo.targets(ctx_of(m), { ["x-tokengate-slo-ttft-ms"] = v })
        eq(ok, nil)
        eq(err.status, 400)
        eq(err.code, "invalid_slo")
        eq(err.param, "X-Tokengate-SLO-TTFT-Ms")
    end
    local ok, err = slo.targets(ctx_of(m), { ["x-tokengate-slo-tpot-ms"] = { "5", "6" } })
    eq(ok, nil)
    eq(err.param, "X-Tokengate-SLO-TPOT-Ms")
    local _, e2 = slo.targets(ctx_of(m), { ["x-tokengate-slo-tpot-ms"] = "60001" })
    eq(e2.code, "invalid_slo")
end)

case("prediction: the prior line, then the prefill queued on the replica", function()
    setup()
    local m = model(500, 50)
    local a = m.upstreams[1]
    local ttft, tpot, ahead = slo.predict("m", a, 2000, 1)
    eq(ahead, 2000)
    eq(math.floor(ttft + 0.5), 120)   -- 20 ms + 2,000 / 20,000 s
    eq(math.floor(tpot * 1000 + 0.5), 11000)   -- 10 ms, plus 0.5 ms per 1,000 ahead
    local ctx = queue(m, a, 18000)
    eq(slo.queued("m", a), 18000)
    ttft = slo.predict("m", a, 2000, 1)
    eq(math.floor(ttft + 0.5), 1020)
    slo.first(ctx)
    eq(slo.queued("m", a), 0)
    slo.first(ctx)   -- once only
    eq(slo.queued("m", a), 0)
end)

-- sent(m, r, ahead, ttft): one request of `ahead` tokens sent to r, predicted with
-- them ahead and 1 running, its first byte `ttft` ms after it was sent; returns its ctx
local function sent(m, r, ahead, ttft)
    local ctx = ctx_of(m)
    assert(slo.targets(ctx, {}))
    ctx.replica, ctx.token_estimate, ctx.prefix_expected = r, ahead, 0
    ctx.slo.decision, ctx.slo.ahead, ctx.slo.running = "met", ahead, 1
    slo.sent(ctx)
    ctx.slo.t_sent, ctx.t_first = 0, ttft
    return ctx
end

-- answer(m, r, ahead, ttft): sent(...) and answered with one token
local function answer(m, r, ahead, ttft)
    local ctx = sent(m, r, ahead, ttft)
    slo.first(ctx, true)
    slo.finish(ctx, 1)
end

case("prediction: learned from what the replica answered", function()
    setup()
    local m = model(500, 50)
    local b = m.upstreams[2]
    -- a replica twice as slow as the prior: 40 ms + 1 s per 10,000 tokens
    for i = 1, 60 do
        local ahead = (i % 6) * 2000
        answer(m, b, ahead, 40 + ahead / 10)
    end
    local ttft = slo.predict("m", b, 5000, 1)
    eq(math.abs(ttft - 540) < 11, true)   -- within 2 %: the prior's pull is small
end)

case("prediction: a prompt's own tokens are learned apart from the queue's estimate", function()
    setup()
    local m = model(500, 50)
    local b = m.upstreams[2]
    -- TTFT 30 ms + 0.1 ms per own uncached token; the queued work the edge estimated
    -- ahead of each (0 to 18,000 tokens) told nothing: one slope over both read a
    -- fraction of the cost per token and put a long prompt's TTFT far short
    for i = 1, 60 do
        local own = 300 + (i % 5) * 400
        local ctx = sent(m, b, own, 30 + own / 10)
        ctx.slo.ahead = own + (i % 7) * 3000
        slo.first(ctx, true)
        slo.finish(ctx, 1)
    end
    local ttft = slo.predict("m", b, 12000, 1)
    eq(math.abs(ttft - 1230) < 37, true)   -- within 3 %
end)

case("prediction: prefill queued for a while is partly done, a late queue counts", function()
    setup()
    local m = model(500, 50)
    local a = m.upstreams[1]
    local ctx = queue(m, a, 18000)
    -- the queue started 450 ms ago: 9,000 of its tokens done at the prior's 20 per ms
    ngx.shared[DICT]:set("sla:m\0a:1", require("tokengate.clock").mono_ms() - 450)
    local ttft, _, ahead = slo.predict("m", a, 2000, 1)
    eq(math.floor(ahead / 10 + 0.5), 1100)
    eq(math.floor(ttft + 0.5), 570)   -- 20 ms + 11,000 / 20,000 s
    -- 1,350 ms: all 18,000 done by 900 ms and no first byte yet: late by 450 ms, and a
    -- request sent now expects as late again (9,000 tokens still ahead)
    ngx.shared[DICT]:set("sla:m\0a:1", require("tokengate.clock").mono_ms() - 1350)
    ttft, _, ahead = slo.predict("m", a, 2000, 1)
    eq(math.floor(ahead / 10 + 0.5), 1100)
    slo.first(ctx)
    eq(slo.queued("m", a), 0)
end)

case("prediction: the answers other workers published are learned too", function()
    setup()
    local m = model(500, 50)
    local b = m.upstreams[2]
    local d = ngx.shared[DICT]
    -- 59 answers of another worker in the replica's ring: 40 ms + 1 s per 10,000 tokens
    for i = 1, 59 do
        local ahead = (i % 6) * 2000
        local seq = d:incr("sln:m\0b:2", 1, 0)
        -- its own uncached tokens, none queued before it, 1 running, TTFT, no TPOT
        d:set("slo:m\0b:2\0" .. seq % 64, seq .. " " .. ahead .. " 0 1 "
            .. (40 + ahead / 10) .. " 0")
    end
    answer(m, b, 0, 40)
    eq(d:get("sln:m\0b:2"), 60)
    local ttft = slo.predict("m", b, 5000, 1)
    eq(math.abs(ttft - 540) < 11, true)
end)

case("policy slo: the replica with the most headroom, prefix hits counted", function()
    setup()
    local m = model(500, 50)
    local ctx = ctx_of(m)
    assert(slo.targets(ctx, {}))
    -- 16,000 prefill tokens queued on a: b wins an uncached 4,000-token prompt
    local q = queue(m, m.upstreams[1], 16000)
    local r = upstream.take(ctx, m, nil, nil, nil, 4000, 4100)
    eq(r.name, "b:2")
    upstream.release(ctx, true)
    -- b is busier still; a holds 3,900 of the prompt's tokens in its prefix cache
    local q2 = queue(m, m.upstreams[2], 15000)
    ctx.prefix_plan = { hashes = "", n = 0, cap = 0, bs = 16,
                        hits = { ["a:1"] = 3900, ["b:2"] = 0 } }
    r = upstream.take(ctx, m, nil, nil, nil, 4000, 4100)
    eq(r.name, "a:1")
    eq(ctx.prefix_expected, 3900)
    upstream.release(ctx, true)
    slo.first(q)
    slo.first(q2)
end)

case("prediction: a TTFT is learned at the first byte, not from an error's", function()
    setup()
    local m = model(500, 50)
    local b, d = m.upstreams[2], ngx.shared[DICT]
    local ctx = sent(m, b, 1000, 70)
    slo.first(ctx, true)
    eq(d:get("sln:m\0b:2"), 1)           -- in the ring before the answer ends
    eq(slo.queued("m", b), 0)
    slo.finish(ctx, 1)                      -- one token: no TPOT, nothing more
    eq(d:get("sln:m\0b:2"), 1)
    local err = sent(m, b, 1000, 3)
    slo.first(err, false)                   -- a 4xx the edge rewrites: not an answer
    eq(d:get("sln:m\0b:2"), 1)
    eq(slo.queued("m", b), 0)
    slo.finish(err, nil)
end)

case("policy slo: a replica this worker ejects or finds out is avoided at once", function()
    setup()
    -- twice: b ejected by this worker's failure count; b marked out by another worker,
    -- which this worker's copy of b learns from a fresh read (the balancer's)
    for _, how in ipairs({ "failed", "marked" }) do
        local m = model(500, 50)
        local a, b = m.upstreams[1], m.upstreams[2]
        -- b is the better one: 16,000 prefill tokens queued on a
        local q = queue(m, a, 16000)
        local ctx = ctx_of(m)
        assert(slo.targets(ctx, {}))
        eq(upstream.take(ctx, m, nil, nil, nil, 4000, 4100).name, "b:2")
        upstream.release(ctx, true)
        if how == "failed" then
            upstream.failed("m", b, "test") -- upstream_max_fails 1: out
        else
            ngx.shared[DICT]:set(upstream.key("out:", "m", b), true)
            eq(upstream.is_out("m", b), true)
        end
        eq(upstream.take(ctx, m, nil, nil, nil, 4000, 4100).name, "a:1")
        upstream.release(ctx, true)
        slo.first(q)
        ngx.shared[DICT]:flush_all()
    end
end)

case("the header says the class, the decision and predicted against target", function()
    eq(slo.header({ class = "interactive", decision = "waited", ttft_ms = 400, tpot_ms = 50,
                    ttft_set = true, tpot_set = true,
                    predicted_ttft_ms = 312.4, predicted_tpot_ms = 21.6 }),
       "interactive; waited; ttft=312/400; tpot=22/50")
    -- a target set nowhere is left out (its bound's top stands in for the decisions)
    eq(slo.header({ class = "interactive", decision = "met", ttft_ms = 400, tpot_ms = 60000,
                    ttft_set = true, tpot_set = false,
                    predicted_ttft_ms = 312.4, predicted_tpot_ms = 21.6 }),
       "interactive; met; ttft=312/400; tpot=22")
    eq(slo.header({ class = "sheddable", decision = "refused", ttft_set = true }),
       "sheddable; refused")
end)
