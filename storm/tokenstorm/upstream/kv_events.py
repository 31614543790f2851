"""vLLM's KV-cache events on the wire, and a ZMQ publisher of them for the simulated
replica (``tokenstorm sim-replica``).

Source: vLLM 0.32, ``vllm/distributed/kv_events.py`` (the msgspec structs and
``ZmqEventPublisher``) and ``vllm/v1/core/block_pool.py`` (what each event carries):

- a message is the ZMQ multipart ``[topic, seq, payload]``: ``topic`` the configured
  topic (UTF-8, "" by default), ``seq`` an 8-byte big-endian counter from 0 per
  process (a replica that restarts starts again at 0), ``payload`` one msgpack
  ``KVEventBatch``: the array ``[ts, events, data_parallel_rank]``, ``ts`` wall-clock
  seconds, each event a map tagged by ``"type"`` (the class name), fields equal to
  their default left out;
- a block hash is the 32-byte digest (``tokengate.prefix_hash``) or, by default, its
  low 64 bits as an unsigned integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, 1 unless
  set to 0; ``vllm/v1/core/kv_cache_utils.py`` ``maybe_convert_block_hash``);
- ``BlockStored``: the blocks one request filled in one engine step: their hashes, the
  parent of the first (None
  for a prompt's block 0), their token ids concatenated, ``block_size``, ``lora_id``
  and ``lora_name`` None without LoRA, ``medium`` ``"GPU"``, ``extra_keys`` one entry
  per block (None, or ``(cache_salt,)`` for block 0 of a salted request), ``group_idx``
  0, ``kv_cache_spec_kind`` ``"full_attention"``;
- ``BlockRemoved``: one hash evicted (one event per hash), ``medium``, ``group_idx``;
- ``AllBlocksCleared``: the prefix cache was reset.

The optional replay socket (vLLM's ``replay_endpoint``) is a ROUTER: a client sends
``[b"", start_seq as 8 bytes big-endian]`` (a DEALER's frames) and gets every buffered
batch from ``start_seq`` on as ``[b"", topic, seq, payload]``, then
``[b"", b"", seq -1 (8 bytes, signed), b""]``.

The structs below restate vLLM's field names, order and defaults; the proof that the
bytes are vLLM's is ``tests/storm/test_sim_replica.py``, which decodes what the
simulated replica publishes with vLLM's own ``msgspec.msgpack.Decoder(KVEventBatch)``
and compares it with the events of a real vLLM server for the same prompts.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

MEDIUM_GPU = "GPU"                # vllm.distributed.kv_events.MEDIUM_GPU
FULL_ATTENTION = "full_attention"  # vllm.v1.kv_cache_interface.KVCacheSpecKind
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ZmqEventPublisher.END_SEQ


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged: ``{"type": "<class name>", ...}``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def int_hash(digest: bytes) -> int:
    """A block hash as vLLM publishes it by default: the digest's low 64 bits, as an
    unsigned integer (``maybe_convert_block_hash``)."""
    return int.from_bytes(digest, "big") & 0xFFFF_FFFF_FFFF_FFFF


def with_int_hashes(e: KVCacheEvent) -> KVCacheEvent:
    """``e`` with its block hashes (and parent) as ``int_hash`` gives them."""
    if isinstance(e, BlockStored):
        parent = e.parent_block_hash
        return msgspec.structs.replace(
            e, block_hashes=[int_hash(h) if isinstance(h, bytes) else h
                             for h in e.block_hashes],
            parent_block_hash=int_hash(parent) if isinstance(parent, bytes) else parent)
    if isinstance(e, BlockRemoved):
        return msgspec.structs.replace(
            e, block_hashes=[int_hash(h) if isinstance(h, bytes) else h
                             for h in e.block_hashes])
    return e


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventPublisher:
    """Publishes ``KVEventBatch`` es on a ZMQ PUB socket, numbered from 0, keeping the
    last ``buffer_steps`` for the replay socket.

    ``endpoint``: the address the PUB socket binds (``tcp://127.0.0.1:5557``,
    ``tcp://*:5557``; vLLM connects instead when the host is not a wildcard, for a
    broker that binds: not needed here, subscribers connect); ``replay_endpoint``: the ROUTER address that answers replay requests
    (None: no replay); ``topic``: the first frame of every message; ``hwm``: the PUB
    socket's high-water mark (messages a slow subscriber may lag before ZMQ drops
    them); ``int_hashes``: block hashes as integers (vLLM's default) or as the 32-byte
    digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). Defaults are vLLM's
    (``vllm/config/kv_events.py``, ``vllm/envs.py``). ``publish`` never
    blocks; call ``start`` inside the event loop to serve replays and ``close`` at
    the end.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000,
                 int_hashes: bool = True) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)  # sync: a PUB send never waits
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if replay_endpoint is not None:
            self._replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._int_hashes = int_hashes
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None
        self.published = 0  # batches sent

    def start(self) -> None:
        """Start answering replay requests (a task of the running event loop)."""
        if self._replay is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """Send one batch of ``events`` (in order, hashes as 32-byte digests) stamped
        with the wall clock now."""
        if self._int_hashes:
            events = [with_int_hashes(e) for e in events]  # type: ignore[misc]
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=events,
                                                    data_parallel_rank=0))
        seq = self._seq
        self._seq += 1
        # A PUB socket never blocks: past the high-water mark ZMQ drops the message for
        # that subscriber, which then sees a gap in seq (and may replay).
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                 flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published += 1

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and goes on
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        """Stop the replay task and close the sockets (pending messages are dropped)."""
        if self._task is not None:
            self._task.cancel()
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
