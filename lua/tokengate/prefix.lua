-- Prefix-cache routing: how many of a prompt's tokens a replica is expected to serve
-- from its prefix cache, and the edge's approximate index of what it sent where.
--
-- vLLM caches a prompt's full KV blocks of block_size tokens under chained block hashes
-- (vllm/v1/core/kv_cache_utils.py: hash_block_tokens); a later prompt that starts with
-- the same blocks skips their prefill, and usage.prompt_tokens_details.cached_tokens
-- says how many tokens it skipped (whole blocks, never the prompt's last token:
-- vllm/v1/core/kv_cache_manager.py, max_cache_hit_length = num_tokens - 1). With the
-- model's routing.policy "prefix" the counter returns, with the count, the prompt's
-- chain (the first 8 bytes of each block's hash) and, for every replica whose KV events
-- it follows (routing.kv_events), the tokens that replica holds now (prefix_hits:
-- precise, source "events"). For a replica without such an entry the edge asks its own
-- index (source "approximate"); tokengate.upstream weighs the hit against the load.
--
-- The approximate index (every worker's requests), per replica r, in the shared dict
-- of the replicas' state (tokengate_limits: never crowded out by the blocks):
--   "pxs:" .. tag     r's sequence: the blocks the index has put in r's cache so far
--   "pxc:" .. tag     r's capacity, blocks: num_gpu_blocks of vllm:cache_config_info
--                     (tokengate.admission's metrics read), else DEFAULT_CAPACITY_BLOCKS
-- and in the lua_shared_dict tokengate_prefix:
--   "b" .. tag .. h   the sequence when block h (8 bytes) was last sent to r
-- (tag: 6 bytes of SHA-256 of "<model>\0<replica name>", computed once per replica).
-- Record (sent): when a request is forwarded to r, its blocks advance r's sequence and
-- take its numbers, the first block the highest (vLLM evicts the least recently used
-- block first, and frees a request's blocks tail first): the new blocks, and the held
-- ones that were not used recently; the held ones in the recent half of the capacity
-- all take the top number (a hot prefix does not age the rest of the cache, just as in
-- vLLM a block reused takes no new one). When the request ends, its generated tokens'
-- full blocks advance the sequence too (generated): they take cache blocks as well. A
-- block is held while its sequence > r's sequence - r's capacity: oldest out first.
-- A replica taken out (failed, health probe) or put to sleep is forgotten (its
-- sequence jumps by its capacity): a restarted or slept vLLM has an empty cache.
-- Lookup: the leading blocks held, at most (prompt_tokens - 1) // block_size.
--
-- Bounds: a prompt's blocks are recorded on a grid (every block up to block DENSE,
-- every STEP1-th up to block MID, every STEP2-th beyond) plus its last full block, so
-- a prompt of 8,000 blocks (128k tokens at 16) writes about 650 entries; a lookup
-- binary-searches the grid (about 10 reads per replica), since the blocks a replica
-- holds of one chain form a prefix of it (a block's hash covers every token before it,
-- and vLLM frees a request's blocks tail first: vllm/v1/core/
-- single_type_kv_cache_manager.py). The cost: a hit that ends between two grid points
-- counts only up to the lower one (at most STEP2 - 1 blocks short). Memory is the
-- shared dict's: when it is full, set() evicts its least recently used entries (about
-- 128 bytes each with the dict's slabs: 32 MB hold about 250,000 blocks).

local digest = require "tokengate.digest"
local shdict = require "tokengate.shdict"

local sub = string.sub
local floor, min, max = math.floor, math.min, math.max

local _M = {}

local HASH_BYTES = 8 -- bytes of each block hash in CountReply.block_hashes
local TAG_BYTES = 6
-- a replica whose vLLM has not told its num_gpu_blocks (not read yet, or no vLLM
-- metrics): 8,192 blocks = 131,072 tokens of 16, the order of one GPU's KV cache for a
-- 30B-class model
local DEFAULT_CAPACITY_BLOCKS = 8192
_M.DEFAULT_CAPACITY_BLOCKS = DEFAULT_CAPACITY_BLOCKS

-- the grid of recorded blocks (1-based block numbers)
local DENSE, MID, STEP1, STEP2 = 64, 512, 4, 16
local MID_J = DENSE + (MID - DENSE) / STEP1 -- grid points up to block MID
_M.GRID = { dense = DENSE, mid = MID, step1 = STEP1, step2 = STEP2 }

local dict -- the blocks
local state -- the replicas' sequences and capacities

-- init(dict_name, state_name) -> true | nil, err: the blocks in dict_name, the
-- replicas' sequences and capacities in state_name. Without the blocks' dict (an nginx
-- configuration from before it) it returns nil, err and the index stays empty: every
-- approximate hit is 0 (the edge logs it once for a prefix-routed model, phases.lua).
function _M.init(dict_name, state_name)
    local err
    state, err = shdict.get(state_name)
    if not state then
        return nil, err
    end
    dict = shdict.get(dict_name)
    return shdict.found(dict, dict_name)
end

-- tag(model_name, r) -> the replica's tag, TAG_BYTES raw bytes
local tag = digest.replica_tag(TAG_BYTES)

-- grid_count(c) -> the number of grid points <= block c
local function grid_count(c)
    if c <= DENSE then
        return c
    elseif c <= MID then
        return DENSE + floor((c - DENSE) / STEP1)
    end
    return MID_J + floor((c - MID) / STEP2)
end

-- grid_pos(j) -> the block number of the j-th grid point (0 for j = 0)
local function grid_pos(j)
    if j <= DENSE then
        return j
    elseif j <= MID_J then
        return DENSE + (j - DENSE) * STEP1
    end
    return MID + (j - MID_J) * STEP2
end
_M.grid_count, _M.grid_pos = grid_count, grid_pos

-- on_grid(i) -> true when block i is a grid point
local function on_grid(i)
    if i <= DENSE then
        return true
    elseif i <= MID then
        return (i - DENSE) % STEP1 == 0
    end
    return (i - MID) % STEP2 == 0
end

-- plan(reply, prompt, routing) -> the request's prefix plan | nil: {hashes (bytes), n
-- (full blocks), cap (blocks a hit may cover: min(n, (prompt - 1) // block_size)), bs
-- (tokens a block), hits = {[replica name] = cached tokens} | nil (no replica's events)}.
-- reply: tokengate.pb.count_reply's; prompt: prompt tokens; routing: the model's
-- compiled routing (block_size when the reply has none). nil when the reply carries
-- neither hashes nor hits (an estimate, embeddings, a prompt shorter than a block with
-- no events): the choice is then least outstanding.
function _M.plan(reply, prompt, routing)
    if not reply then
        return nil
    end
    local hashes, list = reply.block_hashes, reply.prefix_hits
    local n = floor(#hashes / HASH_BYTES)
    if n == 0 and #list == 0 then
        return nil
    end
    local bs = reply.block_size > 0 and reply.block_size or routing.block_size
    local hits
    if #list > 0 then
        hits = {}
        for i = 1, #list do
            hits[list[i].upstream] = list[i].cached_tokens
        end
    end
    return { hashes = hashes, n = n, bs = bs, hits = hits,
             cap = min(n, floor(max(prompt - 1, 0) / bs)) }
end

-- block(plan, i) -> the 8-byte hash of block i (1-based)
local function block(plan, i)
    return sub(plan.hashes, (i - 1) * HASH_BYTES + 1, i * HASH_BYTES)
end

-- capacity(model_name, r) -> r's KV cache, blocks
local function capacity(t)
    return state:get("pxc:" .. t) or DEFAULT_CAPACITY_BLOCKS
end

-- leading(pre, plan, c, oldest) -> the leading blocks of plan, at most c, whose
-- entries under pre (the replica's "b" .. tag) have a sequence > oldest: c itself when
-- its block has, else the last such grid point below it (binary search: those grid
-- points form a prefix, see the top).
local function leading(pre, plan, c, oldest)
    local v = dict:get(pre .. block(plan, c))
    if v and v > oldest then
        return c
    end
    local lo, hi = 0, grid_count(c)
    if grid_pos(hi) == c then
        hi = hi - 1
    end
    while lo < hi do
        local mid = floor((lo + hi + 1) / 2)
        v = dict:get(pre .. block(plan, grid_pos(mid)))
        if v and v > oldest then
            lo = mid
        else
            hi = mid - 1
        end
    end
    return grid_pos(lo)
end

-- held_blocks(model_name, r, plan) -> the leading blocks of plan that the index says
-- r holds (0..plan.cap).
function _M.held_blocks(model_name, r, plan)
    local c = plan.cap
    if c == 0 or not dict then
        return 0
    end
    local t = tag(model_name, r)
    local top = state:get("pxs:" .. t)
    if not top then
        return 0 -- nothing was sent to r
    end
    return leading("b" .. t, plan, c, top - capacity(t))
end

-- expected(model_name, r, plan) -> tokens r is expected to serve from its prefix cache,
-- "events" (the counter's prefix_hits entry for r) | "approximate" (the edge's index).
function _M.expected(model_name, r, plan)
    local hits = plan.hits
    local h = hits and hits[r.name]
    if h then
        return h, "events"
    end
    return _M.held_blocks(model_name, r, plan) * plan.bs, "approximate"
end

-- sent(model_name, r, plan, held) -> r's new sequence: the request was forwarded to r
-- with its first `held` blocks already there (expected() / block size). Of the held
-- blocks, the leading ones in the recent half of r's capacity stay where they are in
-- the order (they take r's top sequence: their move hardly changes any other block's
-- turn); the others, old ones reused and new ones, advance r's sequence by their number
-- and take those numbers, the first of them the highest: the tail goes first, as in
-- vLLM, and the held grid points stay a prefix. An old block reused moves ahead of
-- every block used after it, as in an LRU list; a hot prefix moves nothing.
function _M.sent(model_name, r, plan, held)
    local n = plan.n
    if n == 0 or not dict then
        return nil
    end
    local t = tag(model_name, r)
    local pre = "b" .. t
    local fresh = 0
    held = min(held, n)
    if held > 0 then
        local now = state:get("pxs:" .. t)
        if now then
            fresh = leading(pre, plan, held, now - capacity(t) / 2)
        end
    end
    local top = state:incr("pxs:" .. t, n - fresh, 0)
    if not top then
        return nil -- the dict is out of memory: nothing recorded
    end
    local base = top + fresh + 1 -- block i > fresh: base - i
    for i = 1, min(n, DENSE) do
        dict:set(pre .. block(plan, i), i <= fresh and top or base - i)
    end
    if n > DENSE then
        for j = DENSE + 1, grid_count(n) do
            local i = grid_pos(j)
            dict:set(pre .. block(plan, i), i <= fresh and top or base - i)
        end
        if not on_grid(n) then
            dict:set(pre .. block(plan, n), n <= fresh and top or base - n)
        end
    end
    return top
end

-- generated(model_name, r, blocks): a request on r ended having filled `blocks` more
-- full blocks with generated tokens (they take r's cache too).
function _M.generated(model_name, r, blocks)
    if dict and blocks > 0 then
        state:incr("pxs:" .. tag(model_name, r), blocks, 0)
    end
end

-- forget(model_name, r): everything the index holds for r is old from now on (r was
-- taken out or put to sleep: its vLLM may have restarted, its cache is gone).
function _M.forget(model_name, r)
    if dict then
        local t = tag(model_name, r)
        if state:get("pxs:" .. t) then
            state:incr("pxs:" .. t, capacity(t), 0)
        end
    end
end

-- set_capacity(model_name, r, blocks): r's KV cache, blocks (vLLM's num_gpu_blocks).
function _M.set_capacity(model_name, r, blocks)
    if dict and blocks and blocks > 0 then
        state:set("pxc:" .. tag(model_name, r), blocks)
    end
end

-- capacity_blocks(model_name, r) -> r's KV cache as the index counts it, blocks
function _M.capacity_blocks(model_name, r)
    return dict and capacity(tag(model_name, r)) or DEFAULT_CAPACITY_BLOCKS
end

-- memory() -> the shared dict's capacity and free bytes (free: whole free pages;
-- ngx.shared.DICT:free_space), nil before init
function _M.memory()
    if not dict then
        return nil
    end
    return dict:capacity(), dict:free_space()
end

return _M
