"""vLLM's prefix-cache block hashes, computed outside vLLM: the chain a replica gives
a prompt's full KV-cache blocks, so that the counter (which holds the prompt's token
ids) can say which replica already holds them, and a simulated replica can cache by
the same keys.

Source: vLLM 0.32, ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``,
``init_none_hash``, ``get_request_block_hasher``, ``generate_block_hash_extra_keys``)
and ``vllm/utils/hashing.py`` (``sha256``: SHA-256 of the pickle, highest protocol;
``sha256_cbor``: SHA-256 of canonical CBOR).

- Only full blocks of ``block_size`` tokens are hashed (``--block-size``; a partial
  last block is never cached).
- Block i's hash is ``H((parent, tuple(token_ids of block i), extra_keys))``, the
  parent being block i-1's hash, and for block 0 ``NONE_HASH = H(seed)``.
- ``seed`` is ``PYTHONHASHSEED`` of the replica when set, else the fixed string
  ``"vllm-none-hash"`` (for the cryptographic algorithms; the xxhash ones take a
  random seed per process unless PYTHONHASHSEED is set, so are not supported here).
- ``extra_keys`` is None for a text prompt without LoRA, images or prompt embeddings;
  a request's ``cache_salt`` adds ``(("cache_salt", salt),)`` to block 0 only.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import struct
from array import array
from collections.abc import Callable, Sequence
from typing import Any

# --prefix-caching-hash-algo values whose hashes another process can reproduce
ALGOS = ("sha256", "sha256_cbor")
DEFAULT_SEED = "vllm-none-hash"   # kv_cache_utils.DEFAULT_NONE_HASH_SEED
DEFAULT_BLOCK_SIZE = 16           # vLLM's --block-size default (CacheConfig)
PREFIX_BYTES = 8                  # bytes of each hash the counter returns to the edge


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # only for this algorithm (vLLM depends on it)

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """The function of ``--prefix-caching-hash-algo`` ``algo`` (one of ``ALGOS``);
    ValueError for any other."""
    if algo == "sha256":
        return _sha256
    if algo == "sha256_cbor":
        return _sha256_cbor
    raise ValueError(f"prefix-caching hash algorithm {algo!r} is not reproducible "
                     f"outside the replica; use one of {', '.join(ALGOS)}")


def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """The parent hash of a prompt's first block (``NONE_HASH``): H(seed), 32 bytes.
    ``seed``: the replica's PYTHONHASHSEED, None when it has none."""
    return hash_function(algo)(DEFAULT_SEED if seed is None else seed)


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                 algo: str = "sha256", seed: str | None = None,
                 cache_salt: str | None = None) -> list[bytes]:
    """The hashes (32 bytes each) of the full blocks of ``token_ids``, in order, as a
    replica with these settings computes them; [] when the prompt is shorter than one
    block. ``cache_salt``: the request's ``cache_salt`` field (None or "": none)."""
    data = array("I", token_ids).tobytes()
    return chain(algo, none_hash(algo, seed), data, 0, len(token_ids) // block_size,
                 block_size, salt_keys(cache_salt))


@functools.cache
def _unpack_block(block_size: int) -> Callable[[bytes, int], tuple[int, ...]]:
    # a block's token ids, as the tuple vLLM hashes, from array("I") bytes at an offset
    return struct.Struct(f"={block_size}I").unpack_from


def chain(algo: str, parent: bytes, data: bytes, first: int, count: int, block_size: int,
          first_extra: tuple[Any, ...] | None = None) -> list[bytes]:
    """The hashes of ``count`` full blocks from block ``first`` of a prompt whose token
    ids are ``data`` (``array("I").tobytes()``: 4 bytes per id), ``parent`` being block
    ``first - 1``'s hash (``none_hash`` for block 0); ``first_extra``: block ``first``'s
    extra keys (``salt_keys`` for block 0, else None). Each link is vLLM's
    ``hash_block_tokens`` (this module's opening comment), all in one loop: the block's
    tuple read straight from the bytes, SHA-256 of its pickle inlined; about 1.8 us a
    block on a 2-core VM, against 3 us with a call, a slice and a tuple per block."""
    unpack = _unpack_block(block_size)
    step = block_size * 4
    out: list[bytes] = []
    start, end = first * step, (first + count) * step
    if count <= 0:
        return out
    if first_extra is not None or algo != "sha256":
        fn = hash_function(algo)
        parent = fn((parent, unpack(data, start), first_extra))
        out.append(parent)
        for off in range(start + step, end, step):
            parent = fn((parent, unpack(data, off), None))
            out.append(parent)
        return out
    dumps, sha256, proto = pickle.dumps, hashlib.sha256, pickle.HIGHEST_PROTOCOL
    append = out.append
    for off in range(start, end, step):
        parent = sha256(dumps((parent, unpack(data, off), None), proto)).digest()
        append(parent)
    return out


def salt_keys(cache_salt: str | None) -> tuple[Any, ...] | None:
    """Block 0's extra keys for a request's ``cache_salt`` (None or "": none)
    (``generate_block_hash_extra_keys``)."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """The most blocks of a ``num_tokens`` prompt that a replica can serve from its
    prefix cache: vLLM always computes the last prompt token, so a hit covers at most
    ``num_tokens - 1`` tokens (``KVCacheManager.get_computed_blocks``:
    ``max_cache_hit_length = request.num_tokens - 1``), in whole blocks."""
    return max(num_tokens - 1, 0) // block_size
