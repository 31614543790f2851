"""vLLM's KV events as they travel (vllm/distributed/kv_events.py, vLLM 0.32), read by
the tests that compare them: a ZMQ multipart ``[topic, seq, payload]`` (``seq`` 8 bytes,
big-endian), ``payload`` a msgpack ``KVEventBatch``: an array ``[ts, events,
data_parallel_rank]``, each event a map tagged by ``"type"`` (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``) without the fields at their defaults
(``omit_defaults``).

Decoded with msgspec's untyped decoder rather than vLLM's classes: importing
``vllm.distributed.kv_events`` imports torch (12-25 CPU-s and ~600 MB in a test worker,
each worker that reads events), and what the tests compare is the wire itself."""

from __future__ import annotations

from typing import Any

import msgspec


class Event:
    """One decoded event: its fields as attributes, its tag as ``type``."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"Event({self.fields!r})"


def events(payload: bytes) -> list[Event]:
    """The events of one ``KVEventBatch`` payload, in order."""
    batch = msgspec.msgpack.decode(payload)
    return [Event(e) for e in batch[1]]


def int_hash(block_hash: bytes) -> int:
    """A block hash as vLLM publishes it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (its
    default): the digest's low 64 bits, big-endian (vllm/v1/core/kv_cache_utils.py
    maybe_convert_block_hash)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
