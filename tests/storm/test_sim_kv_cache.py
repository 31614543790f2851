"""The simulated replica's KV cache (``tokenstorm.upstream.kv_cache``): vLLM's block
pool rules, one case each (unit tests, no process). The same rules are checked end to
end against a real vLLM server in test_sim_replica.py."""

from __future__ import annotations

import pytest
from tokengate import prefix_hash
from tokenstorm.upstream.kv_cache import BlockPool
from tokenstorm.upstream.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit

BS = 4


def hashes(tokens: list[int]) -> list[bytes]:
    return prefix_hash.block_hashes(tokens, BS)


def run(pool: BlockPool, tokens: list[int]) -> int:
    """One request of ``tokens`` that generates one token (vLLM's order: hit, allocate,
    cache the full blocks, finish, free); returns its hit in tokens."""
    hs = hashes(tokens)
    hit = pool.longest_hit(hs, prefix_hash.cacheable_blocks(len(tokens), BS))
    pool.touch(hit)
    blocks = hit + pool.allocate(-(-len(tokens) // BS) - len(hit))
    k, full = len(hit), len(tokens) // BS
    pool.cache(blocks[k:full], hs[k:full], hs[k - 1] if k else None,
               tokens[k * BS:full * BS])
    pool.release(blocks)
    return k * BS


def removed(pool: BlockPool) -> list[bytes]:
    return [h for e in pool.take_events() if isinstance(e, BlockRemoved)
            for h in e.block_hashes]


def test_a_repeated_prompt_hits_its_full_blocks_but_the_last_token() -> None:
    pool = BlockPool(num_gpu_blocks=20, block_size=BS)
    a = list(range(100, 110))            # 10 tokens: 2 full blocks
    assert run(pool, a) == 0
    stored = pool.take_events()
    assert stored == [BlockStored(block_hashes=hashes(a), parent_block_hash=None,
                                  token_ids=a[:8], block_size=BS, lora_id=None, medium="GPU",
                                  lora_name=None, extra_keys=[None, None], group_idx=0,
                                  kv_cache_spec_kind="full_attention")]
    assert run(pool, a) == 8
    assert pool.take_events() == []      # nothing new filled
    exact = list(range(200, 208))        # 8 tokens: the last block is always recomputed
    run(pool, exact)
    pool.take_events()
    assert run(pool, exact) == 4
    again = pool.take_events()           # the recomputed block is cached a second time
    assert again == [BlockStored(block_hashes=[hashes(exact)[1]],
                                 parent_block_hash=hashes(exact)[0], token_ids=exact[4:],
                                 block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                                 extra_keys=[None], group_idx=0,
                                 kv_cache_spec_kind="full_attention")]
    assert len(pool.cached[hashes(exact)[1]]) == 2


def test_eviction_takes_the_least_recently_freed_blocks_tail_first() -> None:
    pool = BlockPool(num_gpu_blocks=10, block_size=BS)  # 9 usable blocks
    a, b, c = ([k * 1000 + i for i in range(12)] for k in (1, 2, 3))  # 3 blocks each
    for p in (a, b, c):
        run(pool, p)
    assert removed(pool) == []
    assert pool.usage == 0.0 and pool.num_free == 9
    d = [4000 + i for i in range(8)]     # 2 blocks: evicts a's last two blocks first
    assert run(pool, d) == 0
    assert removed(pool) == [hashes(a)[2], hashes(a)[1]]
    assert run(pool, a) == 4             # a's first block is still cached
    # a recomputes its two evicted blocks: b's last two go, tail first again
    assert removed(pool) == [hashes(b)[2], hashes(b)[1]]


def test_held_blocks_are_never_evicted_and_block_a_reset() -> None:
    pool = BlockPool(num_gpu_blocks=4, block_size=BS)   # 3 usable blocks
    a = list(range(8))
    hs = hashes(a)
    held = pool.allocate(2)
    pool.cache(held, hs, None, a)
    assert pool.num_free == 1 and pool.usage == 1 - 1 / 3  # vLLM: 1 - free / usable
    assert pool.reset() is False         # a request holds blocks
    pool.release(held)
    assert pool.usage == 0.0
    pool.take_events()
    assert pool.reset() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.longest_hit(hs, 2) == []
