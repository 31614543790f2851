"""The engine of a simulated vLLM replica: its scheduler, prefill queue, decode clock and
KV cache (the rules: ``tokenstorm.upstream.sim``), and the engine usage records of a
finished request."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tokengate import prefix_hash
from tokengate_vllm import record as engine_record

from tokenstorm.upstream.kv_cache import Block, BlockPool
from tokenstorm.upstream.kv_events import KVEventPublisher
from tokenstorm.upstream.sim_priority import PriorityWaiting
from tokenstorm.upstream.sim_prompts import BadRequest
from tokenstorm.upstream.sim_settings import SimSettings


class SimRequest:
    """One request in the engine. Times are the event loop's clock (s)."""

    __slots__ = (
        "arrival",
        "arrival_wall",
        "blocks",
        "cached_tokens",
        "computed",
        "created_cache_tokens",
        "done",
        "extra_blocks",
        "finish_reason",
        "first_token_at",
        "generated",
        "hashes",
        "key_endpoint",
        "last_token_at",
        "max_tokens",
        "max_tokens_param",
        "n",
        "next_at",
        "num_cached_blocks",
        "num_preemptions",
        "priority",
        "prompt_ids",
        "prompt_len",
        "request_id",
        "reserved",
        "salt",
        "scheduled_at",
        "waiter",
    )

    def __init__(self, prompt_ids: list[int], max_tokens: int, n: int, hashes: list[bytes],
                 salt: str | None, arrival: float, done: asyncio.Future[None],
                 request_id: str = "", max_tokens_param: int | None = None,
                 key_endpoint: tuple[str | None, str | None] = (None, None),
                 priority: int = 0) -> None:
        self.request_id = request_id   # vLLM's external id (the engine record's)
        self.priority = priority       # the body's: lower first (--scheduling-policy)
        self.max_tokens_param = max_tokens_param  # what the body asked for, or None
        self.key_endpoint = key_endpoint  # (key id, endpoint) the edge's headers named
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        self.max_tokens = max_tokens   # tokens each choice generates
        self.n = n                     # choices
        self.hashes = hashes           # full blocks of the prompt + max_tokens - 1 outputs
        self.salt = salt
        self.blocks: list[Block] = []        # the first choice's, in token order
        self.extra_blocks: list[Block] = []  # the other choices' own blocks
        self.num_cached_blocks = 0     # leading blocks of ``blocks`` cached under a hash
        self.reserved = 0              # blocks still to allocate as tokens are generated
        self.cached_tokens = 0         # prefix-cache hit, tokens
        self.created_cache_tokens = 0  # prompt tokens this request's prefill cached
        self.generated = 0             # tokens generated per choice
        self.computed = 0              # tokens whose KV exists (stepped engine)
        self.num_preemptions = 0       # times its blocks were taken back (stepped)
        self.arrival = arrival
        self.arrival_wall = time.time()
        self.scheduled_at: float | None = None  # admitted from the waiting queue
        self.first_token_at = 0.0
        self.last_token_at = 0.0
        self.next_at = 0.0
        self.finish_reason: str | None = None   # "length", or "abort" (client left)
        self.waiter: asyncio.Future[None] | None = None  # set at the next token
        self.done = done               # set when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    """Scheduler, prefill queue, decode clock and KV cache of one simulated replica
    (the rules: ``tokenstorm.upstream.sim``'s text). Build it inside the running event loop.

    ``output_token_id``: the id of every generated token; ``publisher``: where the KV
    events go (None: nowhere); ``on_ttft``: called with each request's TTFT (s);
    ``on_finish``: called with each request once it finished, aborted ones included (its
    engine usage records).
    """

    def __init__(self, s: SimSettings, output_token_id: int,
                 publisher: KVEventPublisher | None = None,
                 on_ttft: Callable[[float], None] | None = None,
                 on_finish: Callable[[SimRequest], None] | None = None) -> None:
        self.s = s
        self.loop = asyncio.get_running_loop()
        self.output_token_id = output_token_id
        self.pool = BlockPool(s.num_gpu_blocks, s.block_size,
                              record_events=publisher is not None)
        self.publisher = publisher
        self.on_ttft = on_ttft
        self.on_finish = on_finish
        # vLLM's RequestQueue of --scheduling-policy (tokenstorm.upstream.sim_priority)
        self.waiting: deque[SimRequest] | PriorityWaiting[SimRequest] = \
            PriorityWaiting() if s.scheduling_policy == "priority" else deque()
        self.running: set[SimRequest] = set()
        self.reserved = 0                # blocks promised to running requests' outputs
        self.prefill_free_at = 0.0       # when the prefill queue is idle
        self._decode: list[tuple[float, int, SimRequest]] = []  # (next token at, seq, r)
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._flush_pending = False
        # vLLM's counters (tokens, requests)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.finished: dict[str, int] = {}

    # -- requests -----------------------------------------------------------------------

    def blocks_needed(self, prompt_len: int, max_tokens: int, n: int) -> tuple[int, int, int]:
        """(blocks at prefill, more blocks the first choice fills while generating,
        blocks of the other choices) for a request; a running request holds their sum
        at its end. Its KV covers prompt + max_tokens - 1 tokens (the last token's is
        never computed)."""
        bs = self.s.block_size
        first = -(-prompt_len // bs)
        total = max(first, -(-(prompt_len + max_tokens - 1) // bs))
        return first, total - first, (n - 1) * (total - prompt_len // bs)

    def submit(self, prompt_ids: list[int], max_tokens: int, n: int = 1,
               salt: str | None = None, request_id: str = "",
               max_tokens_param: int | None = None,
               key_endpoint: tuple[str | None, str | None] = (None, None),
               priority: int = 0) -> SimRequest:
        """Queue a request of ``prompt_ids`` generating ``max_tokens`` (>= 1) tokens for
        each of ``n`` choices; ``salt``: its cache_salt; ``request_id``: vLLM's external
        id, ``max_tokens_param``: the body's max_tokens, ``key_endpoint``: the (key id,
        endpoint) the edge sent (its engine usage records); ``priority``: the body's
        (read under ``--scheduling-policy priority`` only, as vLLM). BadRequest when its
        blocks cannot fit in the whole KV cache."""
        s = self.s
        now, prefill, extra = self.blocks_needed(len(prompt_ids), max_tokens, n)
        room = s.num_gpu_blocks - 1
        if now + prefill + extra > room:
            raise BadRequest(f"the request needs {now + prefill + extra} KV-cache blocks; "
                             f"the replica has {room}", param="n")
        tokens = prompt_ids + [self.output_token_id] * (max_tokens - 1)
        hashes = prefix_hash.block_hashes(tokens, s.block_size, s.hash_algo, s.hash_seed,
                                          salt)
        r = SimRequest(prompt_ids, max_tokens, n, hashes, salt, self.arrival_time(),
                       self.loop.create_future(), request_id, max_tokens_param,
                       key_endpoint, priority)
        self.waiting.append(r)
        self._schedule()
        return r

    def arrival_time(self) -> float:
        """The engine's clock for a request that arrives now (the loop's, s)."""
        return self.loop.time()

    def abort(self, r: SimRequest) -> None:
        """The client left: drop ``r`` from the queue, or free what it holds."""
        if r.finished:
            return
        if r in self.running:
            self._finish(r, "abort")
            return
        with contextlib.suppress(ValueError):
            self.waiting.remove(r)
        r.finish_reason = "abort"
        self.finished["abort"] = self.finished.get("abort", 0) + 1
        if self.on_finish is not None:
            self.on_finish(r)
        if not r.done.done():
            r.done.set_result(None)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``POST /reset_prefix_cache``: False while a request holds blocks."""
        ok = self.pool.reset()
        self._events_changed()
        return ok

    # -- scheduling ---------------------------------------------------------------------

    def _schedule(self) -> None:
        """Admit waiting requests in order while a slot and their blocks are free."""
        s, pool, bs = self.s, self.pool, self.s.block_size
        while self.waiting and len(self.running) < s.max_num_seqs:
            r = self.waiting[0]
            full = r.prompt_len // bs
            hit = pool.longest_hit(r.hashes[:full],
                                   prefix_hash.cacheable_blocks(r.prompt_len, bs))
            now_blocks, later, extra = self.blocks_needed(r.prompt_len, r.max_tokens, r.n)
            revived = sum(1 for b in hit if b.ref_cnt == 0)
            if pool.num_free - self.reserved < revived + now_blocks - len(hit) + later + extra:
                break  # first come, first served: the head waits for blocks
            self.waiting.popleft()
            pool.touch(hit)
            r.blocks = hit + pool.allocate(now_blocks - len(hit))
            r.extra_blocks = pool.allocate(extra)
            r.reserved = later
            self.reserved += later
            k = len(hit)
            self._cache_upto(r, k, full)
            r.cached_tokens = k * bs
            r.created_cache_tokens = (full - k) * bs
            self.prefix_cache_queries += r.prompt_len
            self.prefix_cache_hits += r.cached_tokens
            r.scheduled_at = self.loop.time()
            start = max(self.loop.time(), self.prefill_free_at)
            self.prefill_free_at = start + (r.prompt_len - k * bs) / s.prefill_tokens_per_s
            r.first_token_at = self.prefill_free_at + s.ttft_overhead_ms / 1000.0
            self.running.add(r)
            self.loop.call_at(r.first_token_at, self._first_token, r)
        self._events_changed()

    def _cache_upto(self, r: SimRequest, start: int, end: int) -> None:
        """Cache ``r``'s blocks ``start`` .. ``end`` - 1 (now full) under their hashes."""
        if end <= start:
            return
        bs, p = self.s.block_size, r.prompt_len
        lo, hi = start * bs, end * bs
        ids = r.prompt_ids[lo:min(hi, p)]
        if hi > p:
            ids = ids + [self.output_token_id] * (hi - max(lo, p))
        self.pool.cache(r.blocks[start:end], r.hashes[start:end],
                        r.hashes[start - 1] if start else None, ids,
                        r.salt if start == 0 else None)
        r.num_cached_blocks = end

    def itl_s(self) -> float:
        """The inter-token latency now (s), from the number of running requests."""
        return self.s.itl_ms / 1000.0 * (1.0 + self.s.itl_growth * max(len(self.running) - 1, 0))

    def _first_token(self, r: SimRequest) -> None:
        if r.finished:
            return
        r.generated = 1
        r.last_token_at = self.loop.time()
        # vLLM counts the prompt at each engine request's first output: once per choice
        self.prompt_tokens += r.prompt_len * r.n
        self.generation_tokens += r.n
        if self.on_ttft is not None:
            self.on_ttft(self.loop.time() - r.arrival)
        self._notify(r)
        if r.generated >= r.max_tokens:
            self._finish(r, "length")
            return
        r.next_at = r.first_token_at + self.itl_s()
        self._seq += 1
        heapq.heappush(self._decode, (r.next_at, self._seq, r))
        self._arm()

    def _arm(self) -> None:
        if not self._decode:
            return
        t = self._decode[0][0]
        if t < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(t, self._tick)
            self._timer_at = t

    def _tick(self) -> None:
        """One decode step for every request whose next token is due (within 0.5 ms)."""
        self._timer, self._timer_at = None, math.inf
        horizon = self.loop.time() + 0.0005
        itl = self.itl_s()
        heap = self._decode
        while heap and heap[0][0] <= horizon:
            _, _, r = heapq.heappop(heap)
            if r.finished:
                continue
            self._advance(r)
            if not r.finished:
                # the request keeps its own phase; a loop that fell behind catches up
                r.next_at += itl
                self._seq += 1
                heapq.heappush(heap, (r.next_at, self._seq, r))
        self._events_changed()
        self._arm()

    def _advance(self, r: SimRequest) -> None:
        r.generated += 1
        r.last_token_at = self.loop.time()
        self.generation_tokens += r.n
        bs = self.s.block_size
        computed = r.prompt_len + r.generated - 1   # tokens whose KV now exists
        if len(r.blocks) * bs < computed:
            r.blocks += self.pool.allocate(1)
            r.reserved -= 1
            self.reserved -= 1
        self._cache_upto(r, r.num_cached_blocks, computed // bs)
        self._notify(r)
        if r.generated >= r.max_tokens:
            self._finish(r, "length")

    def _finish(self, r: SimRequest, reason: str) -> None:
        r.finish_reason = reason
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.running.discard(r)
        self.reserved -= r.reserved
        r.reserved = 0
        self.pool.release(r.blocks)
        self.pool.release(r.extra_blocks)
        if self.on_finish is not None:
            self.on_finish(r)
        if not r.done.done():
            r.done.set_result(None)
        self._notify(r)
        self._schedule()

    @staticmethod
    def _notify(r: SimRequest) -> None:
        w = r.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- KV events ----------------------------------------------------------------------

    def _events_changed(self) -> None:
        """Publish what changed as one batch once the current callbacks are done (one
        scheduling step: vLLM publishes one batch per engine step)."""
        if not self.pool.events:
            return
        if not self._flush_pending:
            self._flush_pending = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        events = self.pool.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)


def engine_records(r: SimRequest, model: str, now: float) -> list[dict[str, Any]]:
    """The engine usage records of a finished ``r`` (one per choice, ``index`` 0..n-1),
    with the fields tokengate's vLLM plugin gives them (``tokengate_vllm.record``:
    ``from_finished`` for a request that ran to its end, source "stats";
    ``from_aborted`` for one the client left, source "abort"). ``now``: the event
    loop's time of the finish (s); wall-clock times are taken now."""
    e2e = max(0.0, now - r.arrival)
    wall = time.time()
    first = r.generated >= 1   # the engine returned output: its prompt was counted
    sched = r.scheduled_at
    base = {
        "request_id": r.request_id, "n": r.n,
        "ts": engine_record.rfc3339(wall), "arrival_ts": engine_record.rfc3339(wall - e2e),
        "model": model, "key_id": r.key_endpoint[0], "endpoint": r.key_endpoint[1],
        "finish_reason": r.finish_reason,
        "source": "abort" if r.finish_reason == "abort" else "stats",
        "num_prompt_tokens": r.prompt_len, "num_generation_tokens": r.generated,
        "num_cached_tokens": r.cached_tokens, "prefilled": first,
        "max_tokens": r.max_tokens_param, "num_preemptions": r.num_preemptions,
        "e2e_ms": engine_record.ms(e2e) or 0.0,
        "queued_ms": None if sched is None else engine_record.ms(sched - r.arrival),
        "prefill_ms": engine_record.ms(r.first_token_at - sched)
        if first and sched is not None else None,
        "decode_ms": engine_record.ms(r.last_token_at - r.first_token_at) if first else None,
    }
    return [{**base, "index": i} for i in range(r.n)]
