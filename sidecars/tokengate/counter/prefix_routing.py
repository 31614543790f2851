"""Prefix-cache routing in the counter: a prompt's KV-cache block hashes, as its
replicas compute them, and the prompt tokens each replica's prefix cache holds now.

When a model's ``routing.policy`` is ``prefix``, ``ModelCounter.count`` gives the
prompt's token ids to ``PrefixRouter.route``, which returns what ``CountReply`` carries
(proto/tokengate/v1/counter.proto, fields 9-11):

- ``block_hashes``: for each full block of ``block_size`` tokens, in prompt order, the
  first ``prefix_hash.PREFIX_BYTES`` bytes of its chained hash (``prefix_hash``, the one
  implementation of vLLM's ``hash_block_tokens`` chain), concatenated;
- ``prefix_hits``: (upstream, cached tokens) for each replica whose KV events the worker
  follows and which is live (``kv_index``): the blocks it holds from the first on, at most
  ``prefix_hash.cacheable_blocks(prompt tokens, block_size)`` (vLLM always computes the
  prompt's last token), times ``block_size``; what vLLM would report as
  ``prompt_tokens_details.cached_tokens`` for the prompt sent there now.

The chain costs a hash of a pickled tuple per block, computed by ``prefix_hash.chain``
(about 1.8 us a block on a 2-core VM: 110 us for a cold 1k-token prompt at 16 tokens a
block, a third of its encode). Conversations resend their history, so the chain is
cached: per group of ``GROUP`` blocks (the key: the parent's hash and the group's token
ids as bytes, one dict lookup), then per block for the blocks after the last full group.
Groups sit at fixed offsets from the prompt's start, so a prompt that grows finds every
group of its earlier version. After the first miss nothing is looked up: a later key
holds the missed link, so it is cached only where a generation change split the two
puts (then it is put again). A cold 1k-token prompt costs 150 us (184 us when every
block was looked up and hashed one by one); one all cached, 11 us.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Generic, TypeVar

from tokengate import prefix_hash
from tokengate.config.models import Routing
from tokengate.counter.kv_index import KEY_BYTES, ModelIndex

GROUP = 16  # blocks per entry of the group cache
_ID_BYTES = 4  # array("I"): the token ids as bytes, the caches' keys
_PREFIX = prefix_hash.PREFIX_BYTES

V = TypeVar("V")


class _Generations(Generic[V]):
    """A bounded map for the chain's caches: two generations of dicts, the young one
    filled until its keys hold ``max_bytes``, then made the old one (the old one
    dropped); a key found in the old one moves to the young one. Each dict operation is
    one C call under the GIL: safe across the worker's threads."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self.young: dict[bytes, V] = {}  # read directly by BlockChain.hashes
        self._old: dict[bytes, V] = {}
        self._bytes = 0

    def get(self, key: bytes) -> V | None:
        got = self.young.get(key)
        if got is None:
            got = self._old.get(key)
            if got is not None:
                self.put(key, got)
        return got

    def put(self, key: bytes, value: V) -> None:
        self.young[key] = value
        self._bytes += len(key)
        if self._bytes > self._max_bytes:
            self._old, self.young, self._bytes = self.young, {}, 0


# a block's (hash, its first PREFIX_BYTES bytes, its index key)
_Link = tuple[bytes, bytes, bytes]
# a group's (last block's hash, first PREFIX_BYTES bytes of each hash, index keys)
_GroupLinks = tuple[bytes, bytes, tuple[bytes, ...]]


class BlockChain:
    """The chained block hashes of prompts for one model's replicas (``block_size``,
    ``algo``, ``seed``: their ``--block-size``, ``--prefix-caching-hash-algo`` and
    ``PYTHONHASHSEED``), cached. ``max_bytes``: token-id bytes each of the two caches
    keeps per generation (16 MiB: 4M tokens of history)."""

    def __init__(self, block_size: int, algo: str = "sha256", seed: str | None = None,
                 max_bytes: int = 16 << 20) -> None:
        self.block_size = block_size
        self._algo = algo
        self._root = prefix_hash.none_hash(algo, seed)  # ValueError for another algorithm
        self._groups: _Generations[_GroupLinks] = _Generations(max_bytes)
        self._blocks: _Generations[_Link] = _Generations(max_bytes)

    def hashes(self, ids: array[int], cache_salt: str | None = None
               ) -> tuple[bytes, list[bytes]]:
        """(``block_hashes`` of the reply: ``PREFIX_BYTES`` bytes per full block of
        ``ids``, the prompt's token ids; the blocks' index keys, ``kv_index.key_of`` of
        each hash). ``cache_salt``: the request's (block 0's extra keys)."""
        bs, algo = self.block_size, self._algo
        step = bs * _ID_BYTES
        data = ids.tobytes()
        n_blocks = len(ids) // bs
        salt = b"\0" + cache_salt.encode("utf-8", "surrogatepass") if cache_salt else b""
        extra = prefix_hash.salt_keys(cache_salt)
        parent = self._root
        prefixes: list[bytes] = []
        keys: list[bytes] = []
        block = 0
        # after a miss every later entry misses too (its key holds the missed link), so
        # the rest is computed without looking: a cold prompt costs its links and puts
        missed = False
        rest: Iterator[bytes] | None = None  # the links after the first block missed
        if n_blocks >= GROUP:
            gstep = GROUP * step
            young, groups, put = self._groups.young.get, self._groups.get, self._groups.put
            for off in range(0, n_blocks // GROUP * gstep, gstep):
                key = parent + data[off:off + gstep]
                if block == 0 and salt:
                    key += salt
                got = None if missed else young(key) or groups(key)
                if got is None:
                    missed = True
                    links = prefix_hash.chain(algo, parent, data, block, GROUP, bs,
                                              extra if block == 0 else None)
                    got = (links[-1], b"".join([h[:_PREFIX] for h in links]),
                           tuple([h[-KEY_BYTES:] for h in links]))
                    put(key, got)
                parent = got[0]
                prefixes.append(got[1])
                keys.extend(got[2])
                block += GROUP
        young_block, get, put_block = self._blocks.young.get, self._blocks.get, self._blocks.put
        for b in range(block, n_blocks):
            off = b * step
            key = parent + data[off:off + step]
            if b == 0 and salt:
                key += salt
            link = None if missed else young_block(key) or get(key)
            if link is None:
                if rest is None:
                    missed = True
                    rest = iter(prefix_hash.chain(algo, parent, data, b, n_blocks - b, bs,
                                                  extra if b == 0 else None))
                h = next(rest)
                link = (h, h[:_PREFIX], h[-KEY_BYTES:])
                put_block(key, link)
            parent = link[0]
            prefixes.append(link[1])
            keys.append(link[2])
        return b"".join(prefixes), keys


class PrefixRouter:
    """One prefix-routed model's part of each count: its ``BlockChain`` and, in a
    counter worker, the ``ModelIndex`` of the replicas whose events it follows (None
    elsewhere, e.g. ``tokengate doctor``: no hits)."""

    def __init__(self, routing: Routing, index: ModelIndex | None = None) -> None:
        self.block_size = routing.block_size
        self.chain = BlockChain(routing.block_size, routing.hash_algo, routing.hash_seed)
        self.index = index

    def route(self, ids: array[int], cache_salt: str | None
              ) -> tuple[bytes, tuple[tuple[str, int], ...]]:
        """(``block_hashes``, ``prefix_hits``: (upstream, cached tokens) per live
        replica) of a prompt of token ids ``ids``."""
        blob, keys = self.chain.hashes(ids, cache_salt)
        if self.index is None:
            return blob, ()
        most = prefix_hash.cacheable_blocks(len(ids), self.block_size)
        return blob, tuple(self.index.hits(keys, most, self.block_size))
