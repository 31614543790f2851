"""A GPU's KV cache with vLLM's prefix caching, as the simulated replica keeps it.

Source: vLLM 0.32, ``vllm/v1/core/block_pool.py`` (``BlockPool``),
``vllm/v1/core/kv_cache_utils.py`` (``FreeKVCacheBlockQueue``) and
``vllm/v1/core/single_type_kv_cache_manager.py`` (``find_longest_cache_hit``,
``free``). What is kept of them:

- ``num_gpu_blocks`` blocks of ``block_size`` tokens; block 0 is vLLM's null block,
  never used, so ``num_gpu_blocks - 1`` hold tokens and the KV-cache usage is
  ``1 - free / (num_gpu_blocks - 1)``;
- a full block of a request is *cached* under its hash (``tokengate.prefix_hash``)
  once its tokens are scheduled; the map keeps every block under a hash (vLLM does not
  de-duplicate: a prompt whose last block is recomputed caches a second copy);
- the *free queue* holds every block no running request holds, in eviction order:
  freed blocks without a hash go to the front (reused first), freed cached blocks to
  the back (least recently used first); a request frees its blocks last block first;
- a hit is the longest run of leading hashes that are cached, at most
  ``max_blocks`` (``tokengate.prefix_hash.cacheable_blocks``); hit blocks are
  *touched*: taken out of the free queue while a request holds them;
- allocating takes blocks from the front of the free queue; a cached one loses its
  hash then (an eviction: one ``BlockRemoved`` per hash);
- a reset (``/reset_prefix_cache``) succeeds only when no request holds a block, and
  drops every hash (``AllBlocksCleared``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from tokenstorm.upstream.kv_events import (
    FULL_ATTENTION,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)

KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Block:
    """One KV-cache block: its id, the hash it is cached under (None: not cached) and
    how many running requests hold it."""

    __slots__ = ("block_id", "hash", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.hash: bytes | None = None
        self.ref_cnt = 0


class BlockPool:
    """The blocks, the hash map and the free queue (see the module's text).

    ``events`` collects the KV events of the changes since ``take_events``, in order
    (when ``record_events``): ``BlockStored`` events are added by ``cache`` (the caller
    says which blocks of a request it filled), ``BlockRemoved`` by evictions,
    ``AllBlocksCleared`` by ``reset``.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int,
                 record_events: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is vLLM's null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in blocks[1:])
        self.cached: dict[bytes, dict[int, Block]] = {}
        self.events: list[KVEvent] = []
        self.record_events = record_events

    @property
    def num_free(self) -> int:
        """Blocks in the free queue (cached ones included: they can be evicted)."""
        return len(self.free)

    @property
    def usage(self) -> float:
        """vLLM's ``vllm:kv_cache_usage_perc``: the held fraction, 0..1."""
        return 1.0 - len(self.free) / (self.num_gpu_blocks - 1)

    def longest_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[Block]:
        """The cached blocks of the longest run of leading ``hashes`` (at most
        ``max_blocks``), in order; the first cached block of a hash is taken."""
        hit: list[Block] = []
        cached = self.cached
        for h in hashes[:max_blocks]:
            blocks = cached.get(h)
            if not blocks:
                break
            hit.append(next(iter(blocks.values())))
        return hit

    def touch(self, blocks: Iterable[Block]) -> None:
        """A request holds ``blocks`` (hits): out of the free queue, one more holder."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[Block]:
        """``n`` blocks from the front of the free queue, evicting the cached ones among
        them; ValueError when fewer are free (the caller checks ``num_free``)."""
        if n > len(self.free):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            _, b = self.free.popitem(last=False)
            if b.hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: Block) -> None:
        h = b.hash
        assert h is not None
        blocks = self.cached.get(h)
        if blocks is not None and blocks.pop(b.block_id, None) is not None:
            if not blocks:
                del self.cached[h]
            if self.record_events:
                self.events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU,
                                                group_idx=0))
        b.hash = None

    def cache(self, blocks: Sequence[Block], hashes: Sequence[bytes],
              parent: bytes | None, token_ids: list[int],
              salt: str | None = None) -> None:
        """Cache the newly filled ``blocks`` of one request under ``hashes`` (as
        many), ``parent`` being the hash before the first (None at block 0) and
        ``token_ids`` their tokens; adds the ``BlockStored`` event. ``salt``: the
        request's cache_salt when ``blocks`` begins at its block 0."""
        if not blocks:
            return
        for b, h in zip(blocks, hashes):
            b.hash = h
            self.cached.setdefault(h, {})[b.block_id] = b
        if not self.record_events:
            return
        extra: list[tuple[str, ...] | None] = [None] * len(blocks)
        if salt and parent is None:
            extra[0] = (salt,)
        self.events.append(BlockStored(
            block_hashes=list(hashes), parent_block_hash=parent, token_ids=token_ids,
            block_size=self.block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
            extra_keys=list(extra), group_idx=0, kv_cache_spec_kind=FULL_ATTENTION))

    def release(self, blocks: Sequence[Block]) -> None:
        """A request lets go of ``blocks`` (its own order); as vLLM frees them, last
        block first: those that nobody holds any more join the free queue, uncached
        ones at the front, cached ones at the back."""
        first: list[Block] = []
        for b in reversed(blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.hash is None:
                    first.append(b)
                else:
                    self.free[b.block_id] = b
        for b in reversed(first):  # prepend_n keeps the list's order at the front
            self.free[b.block_id] = b
            self.free.move_to_end(b.block_id, last=False)

    def reset(self) -> bool:
        """Drop every hash (``/reset_prefix_cache``); False, changing nothing, while a
        request holds a block."""
        if len(self.free) != self.num_gpu_blocks - 1:
            return False
        for blocks in self.cached.values():
            for b in blocks.values():
                b.hash = None
        self.cached.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first."""
        ev, self.events = self.events, []
        return ev
