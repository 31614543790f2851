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

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message


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


class Subscriber:
    """A ZMQ SUB socket on a KV-event publisher (vLLM's or a simulated replica's), on
    ``topic`` ("" for every topic): the batches' events (``events``), their topics and
    sequence numbers as they came. Connected when built (ZMQ's EVENT_CONNECTED, within
    30 s); receiving once ``wait_subscribed`` returned."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.sock.connect(endpoint)
        assert monitor.poll(30_000), f"no KV-event publisher on {endpoint}"
        recv_monitor_message(monitor)
        self.sock.disable_monitor()
        monitor.close(0)
        self.seqs: list[int] = []
        self.topics: set[bytes] = set()

    def wait_subscribed(self, probe: Callable[[], None], tries: int = 20) -> None:
        """Return once the publisher sends to this socket: a SUB connected misses what is
        published before its subscription reaches the publisher (ZMQ's slow joiner), so
        ``probe()`` (a request that stores blocks no one stored before) is made until
        events arrive, which are then drained. AssertionError after ``tries``."""
        for _ in range(tries):
            probe()
            if self.events(idle_s=1.0):
                return
        raise AssertionError("no KV event reached the subscriber")

    def events(self, idle_s: float = 1.5, timeout_s: float = 60.0) -> list[Event]:
        """The events of the batches received until none came for ``idle_s``."""
        out: list[Event] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.sock.poll(int(idle_s * 1000)):
            topic, seq, payload = self.sock.recv_multipart()
            self.topics.add(topic)
            self.seqs.append(int.from_bytes(seq, "big"))
            out.extend(events(payload))
        return out

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
