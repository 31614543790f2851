"""The counter's block hashes against vLLM's own code, in this process (vLLM is installed
in the test environment; the counter never imports it): ``tokengate.prefix_hash`` against
``hash_block_tokens`` and ``init_none_hash`` (both reproducible algorithms, a cache salt,
a PYTHONHASHSEED), the counter's cached chain (``prefix_routing.BlockChain``) against
``prefix_hash``, the index's key against vLLM's int form of a hash, and the index's
decoding of KV-event batches encoded by vLLM's own types."""

from __future__ import annotations

import random
from array import array
from typing import Any

import msgspec
import pytest
from tokengate import prefix_hash
from tokengate.counter import kv_index
from tokengate.counter.prefix_routing import GROUP, BlockChain

from tests.conftest import VLLM_IN_PROCESS

pytestmark = [pytest.mark.unit, VLLM_IN_PROCESS]

RNG = random.Random(25)


def ids(n: int) -> list[int]:
    return [RNG.randrange(151_000) for _ in range(n)]


def vllm_chain(token_ids: list[int], block_size: int, algo: str,
               cache_salt: str | None) -> list[bytes]:
    """vLLM's hashes of the prompt's full blocks: its hash function, its NONE_HASH
    (initialized as the engine does at start), its extra keys of block 0."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    out: list[bytes] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        parent = kv_cache_utils.hash_block_tokens(
            fn, parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", prefix_hash.ALGOS)
@pytest.mark.parametrize("salt", [None, "tenant-7"])
@pytest.mark.parametrize("seed", [None, "1234"])
def test_block_hashes_equal_vllms(algo: str, salt: str | None, seed: str | None,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    prompt = ids(16 * 5 + 7)
    theirs = vllm_chain(prompt, 16, algo, salt)
    assert len(theirs) == 5
    assert prefix_hash.block_hashes(prompt, 16, algo, seed, salt) == theirs
    # the salt and the seed change every block, the algorithm too
    other = prefix_hash.block_hashes(prompt, 16, algo, seed, None if salt else "x")
    assert all(a != b for a, b in zip(other, theirs, strict=True))


def test_a_prompt_shorter_than_a_block_has_no_hash() -> None:
    assert prefix_hash.block_hashes(ids(127), 128) == []
    assert prefix_hash.cacheable_blocks(129, 128) == 1
    assert prefix_hash.cacheable_blocks(128, 128) == 0  # the last token is always computed


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("salt", [None, "s"])
def test_the_cached_chain_equals_prefix_hash(block_size: int, salt: str | None) -> None:
    """Prompts that grow (a conversation resent), shrink and differ in their first block,
    through the group cache (GROUP blocks an entry) and the block cache, cold and warm."""
    chain = BlockChain(block_size)
    base = ids(block_size * (2 * GROUP + 3) + 5)
    prompts = [base, base[:block_size * GROUP], base + ids(block_size * GROUP),
               base[:block_size * 3 + 1], [base[0] + 1, *base[1:]], base]
    for prompt in prompts:
        for s in (salt, "other"):
            want = prefix_hash.block_hashes(prompt, block_size, cache_salt=s)
            blob, keys = chain.hashes(array("I", prompt), s)
            assert blob == b"".join(h[:prefix_hash.PREFIX_BYTES] for h in want)
            assert keys == [kv_index.key_of(h) for h in want]


def test_the_chain_cache_is_bounded() -> None:
    chain = BlockChain(16, max_bytes=4096)
    for _ in range(50):
        prompt = ids(16 * GROUP + 16)
        blob, _ = chain.hashes(array("I", prompt))
        assert blob == b"".join(h[:8] for h in prefix_hash.block_hashes(prompt, 16))
    for cache in (chain._groups, chain._blocks):
        # two generations, each cut when its keys pass 4096 bytes
        assert len(cache.young) + len(cache._old) <= 2 * (4096 // (32 + 16 * 4) + 1)


def test_the_index_key_is_vllms_int_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM publishes a hash as the 32-byte digest, or (its default) as an int: the low
    64 bits. Both give the index the same key."""
    from vllm.v1.core import kv_cache_utils

    for h in prefix_hash.block_hashes(ids(64), 16):
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
        as_int = kv_cache_utils.maybe_convert_block_hash(h)
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
        as_bytes = kv_cache_utils.maybe_convert_block_hash(h)
        assert isinstance(as_int, int) and as_bytes == h
        assert kv_index.key_of(as_int) == kv_index.key_of(as_bytes) == h[-8:]
    with pytest.raises(ValueError):
        kv_index.key_of(b"short")
    for bad in (1 << 64, -1):
        with pytest.raises(ValueError):
            kv_index.key_of(bad)


def vllm_batch(events: list[Any], seq: int = 0) -> list[bytes]:
    """A ZMQ message as vLLM's ZmqEventPublisher sends it."""
    from vllm.distributed.kv_events import KVEventBatch

    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.5, events=events))
    return [b"kv-events", seq.to_bytes(8, "big"), payload]


def stored(hashes: list[Any], **kw: Any) -> Any:
    from vllm.distributed.kv_events import BlockStored

    base: dict[str, Any] = {"parent_block_hash": None, "token_ids": list(range(16)),
                            "block_size": 16, "lora_id": None, "medium": "GPU",
                            "lora_name": None}
    return BlockStored(block_hashes=hashes, **{**base, **kw})


def test_batches_encoded_by_vllm_are_applied() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    h = prefix_hash.block_hashes(ids(16 * 6), 16)
    r = kv_index.ReplicaIndex("m", "127.0.0.1:1", "tcp://127.0.0.1:2")
    keys = [kv_index.key_of(x) for x in h]
    # bytes, and the int form; every field vLLM 0.32 sets, extra_keys and group_idx too
    r.receive(vllm_batch([stored(h[:3], extra_keys=[None, None, None], group_idx=0),
                          stored([int.from_bytes(x[-8:], "big") for x in h[3:5]],
                                 parent_block_hash=h[2], session_id="s")], seq=7))
    assert r.held(keys, 6) == 5 and r.held(keys, 2) == 2 and r.last_seq == 7
    r.receive(vllm_batch([BlockRemoved(block_hashes=[h[1]], medium="GPU")], seq=8))
    assert r.held(keys, 6) == 1 and r.held(keys[2:], 6) == 3
    # another medium (an offloaded copy) and another KV-cache group: not held on the GPU
    r.receive(vllm_batch([stored([h[5]], medium="CPU"), stored([h[5]], group_idx=1)], seq=9))
    assert r.held(keys[5:], 1) == 0
    r.receive(vllm_batch([AllBlocksCleared()], seq=10))
    assert r.held(keys, 6) == 0 and not r.blocks


def test_an_unknown_event_type_is_skipped_and_a_bad_message_resets() -> None:
    h = prefix_hash.block_hashes(ids(32), 16)
    keys = [kv_index.key_of(x) for x in h]
    r = kv_index.ReplicaIndex("m", "127.0.0.1:1", "tcp://127.0.0.1:2")
    future = msgspec.msgpack.encode({"type": "BlockPinned", "block_hashes": [h[0]]})
    known = msgspec.msgpack.encode(stored(h))
    payload = msgspec.msgpack.encode([1.0, [msgspec.Raw(future), msgspec.Raw(known)], None])
    r.receive([b"", (0).to_bytes(8, "big"), payload])
    assert r.held(keys, 2) == 2
    r.receive([b"", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
    assert r.held(keys, 2) == 0 and r.last_seq is None
    r.receive([b"only one frame"])
    assert r.last_seq is None


def test_the_index_keeps_at_most_max_blocks_oldest_out_first() -> None:
    h = prefix_hash.block_hashes(ids(16 * 5), 16)
    keys = [kv_index.key_of(x) for x in h]
    r = kv_index.ReplicaIndex("m", "127.0.0.1:1", "tcp://127.0.0.1:2", max_blocks=3)
    for i, x in enumerate(h):
        r.receive(vllm_batch([stored([x])], seq=i))
    assert list(r.blocks) == keys[2:]
    assert r.held(keys, 5) == 0 and r.held(keys[2:], 5) == 3
