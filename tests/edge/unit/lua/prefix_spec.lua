-- tokengate.prefix: the request's plan from the counter's reply, the recording grid, and
-- the approximate index: what was sent where, held oldest-out-first within a replica's
-- capacity, looked up as the leading blocks held.

local t = ...
local prefix = require "tokengate.prefix"

local case, eq = t.case, t.eq
local DICT = "tokengate_limits" -- the harness's dict (the edge's is tokengate_prefix)
local ROUTING = { policy = "prefix", block_size = 16, load_weight = 1 }
local A = { name = "10.0.0.1:8000" }
local B = { name = "10.0.0.2:8000" }

local function setup()
    assert(prefix.init(DICT, DICT))
end

-- chain(n, from, tag) -> n block hashes of 8 bytes: blocks 1..from-1 are the shared
-- ones ("%08d"), the rest are the chain's own (tag .. "%07d")
local function chain(n, from, tag)
    local out = {}
    for i = 1, n do
        out[i] = (from and i >= from) and string.format("%s%07d", tag, i)
            or string.format("%08d", i)
    end
    return table.concat(out)
end

-- reply(hashes, hits) -> a count_reply's fields the plan reads
local function reply(hashes, hits)
    return { block_hashes = hashes, block_size = 16, prefix_hits = hits or {} }
end

-- plan of a prompt of `blocks` full blocks and one token more (the cap is every block)
local function plan_of(hashes)
    local n = #hashes / 8
    return prefix.plan(reply(hashes), n * 16 + 1, ROUTING)
end

-- ------------------------------------------------------------ plan and grid

case("plan: nil without hashes or hits; the cap leaves the prompt's last token", function()
    eq(prefix.plan(nil, 100, ROUTING), nil)
    eq(prefix.plan(reply(""), 100, ROUTING), nil)
    local p = prefix.plan(reply(chain(4)), 64, ROUTING)
    -- 64 tokens, 4 full blocks: vLLM computes the last token, so 3 blocks at most
    eq({ p.n, p.cap, p.bs, p.hits }, { 4, 3, 16, nil })
    eq(prefix.plan(reply(chain(4)), 65, ROUTING).cap, 4)
    eq(prefix.plan(reply(chain(1)), 1, ROUTING).cap, 0)
end)

case("plan: hits by replica name; a reply without a block size takes the model's", function()
    local p = prefix.plan({ block_hashes = "", block_size = 0, prefix_hits = {
        { upstream = A.name, cached_tokens = 32 }, { upstream = B.name, cached_tokens = 0 } } },
        40, { block_size = 32 })
    eq({ p.n, p.cap, p.bs, p.hits }, { 0, 0, 32, { [A.name] = 32, [B.name] = 0 } })
end)

case("grid: every block to 64, every 4th to 512, every 16th beyond", function()
    local G = prefix.GRID
    eq({ G.dense, G.mid, G.step1, G.step2 }, { 64, 512, 4, 16 })
    local want = {}
    for i = 1, 64 do want[#want + 1] = i end
    for i = 68, 512, 4 do want[#want + 1] = i end
    for i = 528, 3000, 16 do want[#want + 1] = i end
    local got = {}
    for j = 1, prefix.grid_count(3000) do got[j] = prefix.grid_pos(j) end
    eq(got, want)
    -- grid_count(c): the grid points <= c, for every c
    local j = 0
    for c = 1, 3000 do
        if want[j + 1] == c then j = j + 1 end
        if prefix.grid_count(c) ~= j then
            t.fail("grid_count(" .. c .. ") = " .. prefix.grid_count(c) .. ", want " .. j)
        end
    end
end)

-- ------------------------------------------------------------ the approximate index

case("nothing sent: no hit; events hits are taken as the counter gives them", function()
    setup()
    local p = plan_of(chain(10))
    eq({ prefix.expected("m", A, p) }, { 0, "approximate" })
    p.hits = { [A.name] = 48 }
    eq({ prefix.expected("m", A, p) }, { 48, "events" })
    eq({ prefix.expected("m", B, p) }, { 0, "approximate" })
end)

case("sent: the same prompt again hits its cap on that replica only", function()
    setup()
    local p = plan_of(chain(10))
    eq(prefix.sent("m", A, p, 0), 10)
    eq({ prefix.expected("m", A, p) }, { 160, "approximate" })
    eq(prefix.held_blocks("m", B, p), 0)
    eq(prefix.held_blocks("other-model", { name = A.name }, p), 0)
    -- 160 tokens exactly: the last block holds the last token, never a hit
    eq(prefix.held_blocks("m", A, prefix.plan(reply(chain(10)), 160, ROUTING)), 9)
end)

case("a shared prefix: the leading blocks held, at grid resolution beyond 64", function()
    setup()
    prefix.sent("m", A, plan_of(chain(1000)), 0)
    -- shares blocks 1..40: all of them
    eq(prefix.held_blocks("m", A, plan_of(chain(100, 41, "x"))), 40)
    -- shares 1..301: the grid point 300 (every 4th from 64)
    eq(prefix.held_blocks("m", A, plan_of(chain(400, 302, "y"))), 300)
    -- shares 1..900: the grid point 896 (every 16th from 512)
    eq(prefix.held_blocks("m", A, plan_of(chain(2000, 901, "z"))), 896)
    -- longer than what was sent, same start: what was sent, at the grid (its last
    -- block, 1000, is recorded but is not the longer prompt's cap)
    eq(prefix.held_blocks("m", A, plan_of(chain(1500))), 992)
    -- a prompt that is the sent one cut at its block 700: the grid point 688
    eq(prefix.held_blocks("m", A, plan_of(chain(700))), 688)
    -- the whole prompt again: its last block is recorded, so the whole
    eq(prefix.held_blocks("m", A, plan_of(chain(1000))), 1000)
end)

case("a long prompt writes its grid and its last block, no more", function()
    setup()
    local dict = ngx.shared[DICT]
    local before = #dict:get_keys(0)
    prefix.sent("m", A, plan_of(chain(8000)), 0)
    -- 64 + 112 + (8000 - 512) / 16 = 644 blocks (8000 is on the grid), and the sequence
    eq(#dict:get_keys(0) - before, 644 + 1)
end)

case("capacity: oldest out first, a request's tail before its head", function()
    setup()
    prefix.set_capacity("m", A, 100)
    eq(prefix.capacity_blocks("m", A), 100)
    eq(prefix.capacity_blocks("m", B), prefix.DEFAULT_CAPACITY_BLOCKS)
    local a, b = plan_of(chain(50, 1, "a")), plan_of(chain(60, 1, "b"))
    prefix.sent("m", A, a, 0) -- sequence 50: a's blocks 1..50 hold 50..1
    prefix.sent("m", A, b, 0) -- 110: b's hold 110..51, 40 blocks of a left (> 10)
    eq({ prefix.held_blocks("m", A, a), prefix.held_blocks("m", A, b) }, { 40, 60 })
    -- a again: its 40 held blocks are old (below 110 - 50), so they move ahead of b
    -- with its 10 new ones: 160..111, and b is pushed by all 50 (> 60: 50 left), as
    -- in an LRU list of 100 blocks
    prefix.sent("m", A, a, 40)
    eq({ prefix.held_blocks("m", A, a), prefix.held_blocks("m", A, b) }, { 50, 50 })
    -- 30 generated blocks later: 20 of b's remain, a's all
    prefix.generated("m", A, 30)
    eq({ prefix.held_blocks("m", A, a), prefix.held_blocks("m", A, b) }, { 50, 20 })
end)

case("a hot prefix sent again and again ages nothing else", function()
    setup()
    prefix.set_capacity("m", A, 100)
    local hot, cold = plan_of(chain(30)), plan_of(chain(40, 1, "c"))
    prefix.sent("m", A, cold, 0) -- 40..1
    prefix.sent("m", A, hot, 0) -- 70..41
    for _ = 1, 20 do
        prefix.sent("m", A, hot, prefix.held_blocks("m", A, hot))
    end
    eq({ prefix.held_blocks("m", A, hot), prefix.held_blocks("m", A, cold) }, { 30, 40 })
    -- the hot one with 10 new blocks at its end: only those take numbers
    local longer = plan_of(chain(40, 31, "l"))
    eq(prefix.held_blocks("m", A, longer), 30)
    eq(prefix.sent("m", A, longer, 30), 80)
end)

case("forget: a replica taken out or put to sleep holds nothing", function()
    setup()
    local p = plan_of(chain(20))
    prefix.sent("m", A, p, 0)
    prefix.sent("m", B, p, 0)
    prefix.forget("m", A)
    eq({ prefix.held_blocks("m", A, p), prefix.held_blocks("m", B, p) }, { 0, 20 })
    -- sent again afterwards: held again
    prefix.sent("m", A, p, 0)
    eq(prefix.held_blocks("m", A, p), 20)
end)

case("no dict of blocks: no hit, nothing recorded, no error", function()
    eq({ prefix.init(DICT, "no_such_state") }, { nil, "shared dict not found: no_such_state" })
    -- an nginx configuration without tokengate_prefix: the index is empty
    eq({ prefix.init("no_such_dict", DICT) }, { nil, "shared dict not found: no_such_dict" })
    local p = plan_of(chain(10))
    eq({ prefix.sent("m", A, p, 0), prefix.held_blocks("m", A, p) }, { nil, 0 })
    prefix.generated("m", A, 5)
    prefix.forget("m", A)
    eq({ prefix.capacity_blocks("m", A), prefix.memory() }, { 8192, nil })
end)
