"""Which KV-cache blocks each replica holds, kept from the KV events it publishes.

A vLLM replica started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'`` publishes what its prefix cache
stores and drops (vLLM 0.32, ``vllm/distributed/kv_events.py``): a ZMQ PUB socket
sends multipart messages ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
counter from 0 per publisher (one per engine: a restarted replica starts again at 0),
``payload`` a msgpack ``KVEventBatch`` (an array ``[ts, events, data_parallel_rank]``;
each event a map tagged by ``"type"``):

- ``BlockStored``: ``block_hashes`` (the blocks' chained hashes, in prompt order),
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``, ``lora_name``,
  ``group_idx`` ...;
- ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
- ``AllBlocksCleared``: the cache was emptied (``reset_prefix_cache``).

A hash is the 32-byte digest, or with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (vLLM's
default) its low 64 bits as an integer (``kv_cache_utils.maybe_convert_block_hash``:
``int.from_bytes(digest, "big") & (2**64 - 1)``). The index keeps both forms as the same
key, the digest's last 8 bytes (``key_of``), so the replicas may publish either.

Each counter worker process follows every replica of ``models.<name>.routing.kv_events``
(when its ``policy`` is ``prefix``) in a thread of its own (``Follower``): a SUB socket
connected to the endpoint, subscribed to every topic, and a socket monitor that says when
a connection to the publisher is up (the ZMQ handshake done) and when it drops. What the
index trusts:

- *live*: a replica is live while the connection to its publisher is up; an idle
  replica publishes nothing and stays live. Only live replicas get a ``PrefixHit``
  (``ModelIndex.hits``): one not connected (down, restarting, a wrong endpoint) gets
  none, and the edge treats it as a replica without events;
- *reset*: the replica's blocks are forgotten, never trusted stale, when the connection
  drops (``disconnected``: it may come back restarted, with an empty cache), when a
  ``seq`` skips numbers (``gap``: events were lost, a ZMQ high-water mark overflowed),
  when it goes back (``restart``: a new publisher), and when a message cannot be read
  (``bad_message``); it is then re-learned from the events that follow. The first
  message after a connection starts the count whatever its ``seq``;
- what it learns: ``BlockStored`` adds its hashes, ``BlockRemoved`` drops them,
  ``AllBlocksCleared`` empties the index. Only blocks of the GPU (``medium`` "GPU", or
  none given) and of KV-cache group 0 count: the blocks a request's prefix-cache hit
  reads (``cached_tokens``); offloaded copies (CPU, storage tiers) and the other groups
  of hybrid models are not. A block that two requests computed at once is stored twice
  and removed once by vLLM: the index then forgets it early (an under-estimate);
- its size: at most ``MAX_BLOCKS`` blocks per replica, the oldest stored dropped first
  (a bound, not a model of vLLM's eviction: its own ``BlockRemoved`` events keep the
  index in step).

Lookups (``ModelIndex.hits``) run in the serving thread while the followers write: each
is a read of one dict under the GIL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
import zmq
from prometheus_client import Counter, Gauge
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

# Blocks kept per replica. A replica's prefix cache holds its KV capacity in blocks: an
# 80 GB GPU with an 8B model (128 KiB of KV per token) about 600k tokens, 38k blocks of
# 16; a CPU replica with VLLM_CPU_KVCACHE_SPACE=1 a few thousand. 2**17 blocks (2M tokens
# at block size 16) covers the replicas of one GPU with room to spare and costs about
# 17 MB per replica in each counter worker (measured: an OrderedDict of 8-byte keys,
# ~130 bytes an entry); a larger cache loses its oldest blocks from the index first.
MAX_BLOCKS = 1 << 17
KEY_BYTES = 8  # the part of a hash the index keeps (the last 8 bytes: vLLM's int form)
_GPU_MEDIA = (None, "GPU")
_POLL_MS = 200  # how long a follower's poll waits before it looks at its stop flag
_RECONNECT_MAX_MS = 2000  # ZMQ's reconnect backoff to an absent publisher, at most
_SILENT_S = 10.0  # a publisher unreachable this long is said in the log (once an outage)

BLOCKS = Gauge("tokengate_counter_kv_index_blocks",
               "KV-cache blocks the counter's index holds for a replica (each counter "
               "worker keeps its own; the largest is shown), by model and upstream.",
               ["model", "upstream"], multiprocess_mode="livemax")
LIVE = Gauge("tokengate_counter_kv_index_live",
             "1 while the counter is connected to a replica's KV-event publisher, else 0 "
             "(the largest over the counter's workers), by model and upstream.",
             ["model", "upstream"], multiprocess_mode="livemax")
LAST_EVENT = Gauge("tokengate_counter_kv_last_event_timestamp_seconds",
                   "When the counter last received a message from a replica's KV-event "
                   "publisher, Unix time, s (the latest over the counter's workers; 0: "
                   "none since it started), by model and upstream. An idle replica sends "
                   "none: with live 1 a stale time is no fault.",
                   ["model", "upstream"], multiprocess_mode="livemax")
EVENTS = Counter("tokengate_counter_kv_events_total",
                 "KV events applied to the index, by model, upstream and kind (stored, "
                 "removed, cleared; ignored: another medium or KV-cache group; unknown: "
                 "an event type this version does not read), summed over the counter's "
                 "workers (each follows every replica).", ["model", "upstream", "kind"])
RESETS = Counter("tokengate_counter_kv_index_resets_total",
                 "Times a replica's index was emptied to be re-learned, by model, upstream "
                 "and reason (disconnected, gap, restart, bad_message), summed over the "
                 "counter's workers.", ["model", "upstream", "reason"])


# -- vLLM's wire format (vllm/distributed/kv_events.py), without importing vLLM ----------

ExternalHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, gc=False):
    """vLLM's ``BlockStored`` (fields this index reads; others are skipped)."""

    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    """vLLM's ``BlockRemoved``."""

    block_hashes: list[ExternalHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    """vLLM's ``AllBlocksCleared``."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """vLLM's ``KVEventBatch``: ``[ts, events, data_parallel_rank]``; each event is read
    on its own (``EVENT``), so one of a type this version does not know is skipped."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(EventBatch)
_EVENT = msgspec.msgpack.Decoder(Event)


def key_of(block_hash: ExternalHash) -> bytes:
    """The index's key of a hash as vLLM publishes it: the last ``KEY_BYTES`` bytes of
    the digest, which are its int form big-endian (``maybe_convert_block_hash``).
    Raises ``ValueError`` for an int out of 0..2**64-1 or fewer than 8 bytes."""
    if isinstance(block_hash, int):
        if not 0 <= block_hash < 1 << 64:
            raise ValueError(f"block hash {block_hash} is not a 64-bit unsigned integer")
        return block_hash.to_bytes(KEY_BYTES, "big")
    if len(block_hash) < KEY_BYTES:
        raise ValueError(f"a {len(block_hash)}-byte block hash")
    return block_hash[-KEY_BYTES:]


# -- one replica --------------------------------------------------------------------------

class ReplicaIndex:
    """The blocks one replica holds (their ``key_of``), what its publisher's ``seq``
    was, whether it is live. Written by its ``Follower`` only; read by ``held``."""

    def __init__(self, model: str, upstream: str, endpoint: str,
                 max_blocks: int = MAX_BLOCKS) -> None:
        self.model, self.upstream, self.endpoint = model, upstream, endpoint
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.live = False
        self.last_seq: int | None = None
        self._sizes_said: set[int] = set()
        self._blocks_gauge = BLOCKS.labels(model, upstream)
        self._live_gauge = LIVE.labels(model, upstream)
        self._last_event_gauge = LAST_EVENT.labels(model, upstream)
        self._events = {k: EVENTS.labels(model, upstream, k)
                        for k in ("stored", "removed", "cleared", "ignored", "unknown")}
        self._blocks_gauge.set(0)
        self._live_gauge.set(0)
        self._last_event_gauge.set(0)

    def held(self, keys: Sequence[bytes], most: int) -> int:
        """How many of the first ``most`` ``keys`` (a prompt's blocks, in order) the
        replica holds, counted from the first until one is missing (vLLM's
        ``find_longest_cache_hit`` stops at the first miss too)."""
        blocks = self.blocks
        n = 0
        for k in keys[:most]:
            if k not in blocks:
                break
            n += 1
        return n

    def connected(self, up: bool) -> None:
        """The connection to the publisher came up (live, counting ``seq`` afresh) or
        went down (not live, emptied: ``disconnected``)."""
        if not up and (self.blocks or self.last_seq is not None):
            self.reset("disconnected")
        self.last_seq = None
        self.live = up
        self._live_gauge.set(1 if up else 0)

    def reset(self, reason: str) -> None:
        """Forget every block (``reason`` counted in ``RESETS``)."""
        self.blocks = OrderedDict()  # one assignment: a lookup sees the old or the new
        self._blocks_gauge.set(0)
        RESETS.labels(self.model, self.upstream, reason).inc()

    def receive(self, frames: Sequence[bytes]) -> None:
        """One ZMQ message of the publisher: ``[topic, seq, payload]``."""
        self._last_event_gauge.set(time.time())  # wall clock: a time a person reads
        if len(frames) != 3 or len(frames[1]) != 8:
            self._bad(f"a message of {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = _BATCH.decode(frames[2])
        except msgspec.DecodeError as e:
            self._bad(f"seq {seq}: {e}")
            return
        last = self.last_seq
        if last is not None and seq != last + 1:
            why = "gap" if seq > last else "restart"
            log.info("kv events of %s (%s): seq %d after %d (%s): re-learning its blocks",
                     self.upstream, self.endpoint, seq, last, why)
            self.reset(why)
        self.last_seq = seq
        for raw in batch.events:
            try:
                event = _EVENT.decode(raw)
            except msgspec.DecodeError:
                self._events["unknown"].inc()
                continue
            try:
                self.apply(event)
            except ValueError as e:
                self._bad(f"seq {seq}: {e}")
                return
        self._blocks_gauge.set(len(self.blocks))

    def apply(self, event: Event) -> None:
        """One event. Raises ``ValueError`` for a hash that is not one."""
        if isinstance(event, AllBlocksCleared):
            self.blocks = OrderedDict()
            self._events["cleared"].inc()
            return
        if event.medium not in _GPU_MEDIA or event.group_idx not in (None, 0):
            self._events["ignored"].inc()
            return
        blocks = self.blocks
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                blocks.pop(key_of(h), None)
            self._events["removed"].inc()
            return
        if event.block_size and event.block_size not in self._sizes_said:
            self._sizes_said.add(event.block_size)
            log.info("kv events of %s: blocks of %d tokens", self.upstream, event.block_size)
        for h in event.block_hashes:
            k = key_of(h)
            if k in blocks:
                blocks.move_to_end(k)
            else:
                blocks[k] = None
                if len(blocks) > self.max_blocks:
                    blocks.popitem(last=False)
        self._events["stored"].inc()

    def _bad(self, why: str) -> None:
        log.warning("kv events of %s (%s): unreadable message (%s): re-learning its blocks",
                    self.upstream, self.endpoint, why)
        self.reset("bad_message")
        self.last_seq = None


# -- following a publisher -----------------------------------------------------------------

class Follower:
    """A thread that keeps one ``ReplicaIndex`` from its publisher's events until
    ``stop``."""

    def __init__(self, replica: ReplicaIndex, context: zmq.Context[zmq.Socket[bytes]]
                 ) -> None:
        self.replica = replica
        self._context = context
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, daemon=True,
            name=f"kv-events {replica.upstream}")

    def start(self) -> Follower:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """Whether the thread still runs."""
        return self._thread.is_alive()

    def stop(self, wait_s: float = 2.0) -> None:
        """Ask the thread to end (it does within ``_POLL_MS``) and wait up to ``wait_s``
        for it (0: do not wait)."""
        self._stop.set()
        if wait_s > 0:
            self._thread.join(wait_s)

    def _run(self) -> None:
        r = self.replica
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)
        sub.setsockopt(zmq.LINGER, 0)
        # live from the ZMTP handshake (a ZMQ publisher answered), not the TCP connect
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(r.endpoint)
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            # One line per outage, never per request: the first after _SILENT_S without
            # a connection (a publisher that is down, a wrong endpoint, or a sandbox
            # without the network: prefix routing is then approximate for it), one when
            # it connects after that.
            down_since: float | None = time.monotonic()
            said = False
            while not self._stop.is_set():
                if down_since is not None and not said \
                        and time.monotonic() - down_since >= _SILENT_S:
                    said = True
                    log.warning("kv events of %s: not connected to %s for %.0f s: its "
                                "prefix hits are the edge's approximate guess until it is "
                                "(is the replica up with --kv-events-config, and is that "
                                "address reachable from this process?)", r.upstream,
                                r.endpoint, time.monotonic() - down_since)
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is monitor:
                        event = recv_monitor_message(monitor)["event"]
                        up = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
                        r.connected(up)
                        if up:
                            if said:
                                log.info("kv events of %s: connected to %s", r.upstream,
                                         r.endpoint)
                            down_since, said = None, False
                        elif down_since is None:
                            down_since = time.monotonic()
                    else:
                        while True:  # what is there, then look at the monitor again
                            try:
                                frames = sub.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            r.receive(frames)
        except Exception:  # a bug: this replica gets no hits, the worker serves on
            log.exception("kv events of %s (%s): follower stopped", r.upstream, r.endpoint)
        finally:
            r.connected(False)
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)


# -- every replica of a worker --------------------------------------------------------------

@dataclass(frozen=True)
class ModelIndex:
    """The replicas of one model whose events are followed, in ``routing.kv_events``'
    order."""

    replicas: tuple[ReplicaIndex, ...]

    def hits(self, keys: Sequence[bytes], most: int, block_size: int
             ) -> list[tuple[str, int]]:
        """(upstream, prompt tokens its prefix cache holds) for each live replica:
        ``held(keys, most) * block_size``; ``keys``: the prompt's blocks (``key_of``
        of each hash), ``most``: the blocks a hit may cover
        (``prefix_hash.cacheable_blocks``)."""
        return [(r.upstream, r.held(keys, most) * block_size)
                for r in self.replicas if r.live]


class KvEvents:
    """The followers of one counter worker process, one per (model, replica, endpoint)
    of the configuration's ``routing.kv_events`` (``ModelConfig.kv_events``: the models
    whose ``policy`` is ``prefix``, the replicas among their ``upstreams``). ``sync`` (at start and on every reload) starts the new ones and stops
    those no longer configured; one unchanged keeps what it learned."""

    def __init__(self) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._followers: dict[tuple[str, str, str], Follower] = {}

    def sync(self, models: Iterable[tuple[str, dict[str, str]]]) -> dict[str, ModelIndex]:
        """``models``: (model name, the publishers to follow: upstream -> endpoint,
        ``ModelConfig.kv_events``) of each model. Returns the ``ModelIndex`` of each
        model that has some."""
        wanted = {name: [(name, upstream, endpoint) for upstream, endpoint in events.items()]
                  for name, events in models if events}
        keep = {key for keys in wanted.values() for key in keys}
        for key in list(self._followers):
            if key not in keep:
                self._followers.pop(key).stop()
        out = {}
        for name, keys in wanted.items():
            for key in keys:
                if key not in self._followers:
                    if self._context is None:
                        self._context = zmq.Context()
                    self._followers[key] = Follower(ReplicaIndex(*key), self._context).start()
            out[name] = ModelIndex(tuple(self._followers[k].replica for k in keys))
        return out

    def close(self) -> None:
        """Stop every follower (all asked at once, then waited for) and the ZMQ context."""
        for f in self._followers.values():
            f.stop(0)
        for f in self._followers.values():
            f.stop()
        ended = not any(f.alive for f in self._followers.values())
        self._followers.clear()
        if self._context is not None and ended:  # term() waits for every socket to close
            self._context.term()
            self._context = None
