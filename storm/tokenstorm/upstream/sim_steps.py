"""A simulated replica's engine that steps as vLLM's V1 scheduler does and times each step
by a roofline of the real model on the real GPU (``tokenstorm sim-replica --gpu``).

Each step (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``; the waiting
queue in ``--scheduling-policy`` order: arrival, or priority then arrival):

1. a token budget of ``--max-num-batched-tokens``;
2. the running requests first, in the order they were admitted: each asks for the tokens
   it knows and has not computed (a decode: 1; a prefill: the rest of its prompt, chunked
   to the budget left); when the KV cache cannot hold the new tokens' slots, the
   last-admitted running request is preempted (its blocks freed, its computed tokens
   reset to 0, put back at the head of the waiting queue, recomputed later from what the
   prefix cache still holds), repeated until the slots fit or the request preempted
   itself; under ``--scheduling-policy priority`` the victim is the lowest-priority,
   latest-arriving running request, which gives back the budget it took in this step,
   and it waits at its place in the queue (``tokenstorm.upstream.sim_priority``);
3. then, if nothing was preempted in this step, waiting requests in order (those that
   had arrived when the step began) while fewer than ``--max-num-seqs`` run and budget
   is left: the prefix-cache hit counts as computed and
   the rest of the prompt is scheduled up to the budget (chunked prefill); the head that
   does not fit in the free blocks stops admission;
4. blocks full of scheduled tokens are cached when they are allocated, as vLLM's
   ``KVCacheManager.allocate_slots`` does;
5. the step lasts ``Roofline.step_s`` of what it scheduled; at its end every request
   whose known tokens are all computed samples one token (its first: TTFT).

With ``spare_chunk`` (``SimSettings``), the rules of tokengate's vLLM plugin scheduler
under the priority policy (``tokengate_vllm.scheduler``) for requests of priority
``SPARE_PRIORITY`` or above: before step 2, a waiting request that finds every seat
taken preempts the running one of the highest (priority, arrival) when that is such a
request of a higher priority number; after step 3, their prefill chunks leave a step
that computes another request's prefill (their blocks stay allocated) and are cut to
``spare_chunk`` tokens in any other.

``n > 1`` choices share the prompt's blocks and hold their own blocks from admission, as
in the fixed-timing engine; their decodes count as ``n`` tokens in the step's cost.
"""

from __future__ import annotations

from collections.abc import Callable

from tokengate import prefix_hash

from tokenstorm.upstream import sim_priority
from tokenstorm.upstream.kv_events import KVEventPublisher
from tokenstorm.upstream.roofline import Roofline
from tokenstorm.upstream.sim_engine import Engine, SimRequest
from tokenstorm.upstream.sim_settings import SimSettings

# the plugin's TOKENGATE_SCHED_SPARE_PRIORITY default (the edge's lines: vllm_priority 1)
SPARE_PRIORITY = 1


class SteppedEngine(Engine):
    """``Engine``'s requests, KV cache and records, scheduled in steps (the module's
    text) timed by ``roofline``. Build it inside the running event loop. ``on_late``:
    called at the end of each step with how late the event loop ran it against its
    planned end (s, at least 0): the host's scheduling, which a GPU's step never waits
    for; the next step still starts at the planned end."""

    def __init__(self, s: SimSettings, roofline: Roofline, output_token_id: int,
                 publisher: KVEventPublisher | None = None,
                 on_ttft: Callable[[float], None] | None = None,
                 on_finish: Callable[[SimRequest], None] | None = None,
                 on_late: Callable[[float], None] | None = None) -> None:
        super().__init__(s, output_token_id, publisher, on_ttft, on_finish)
        self.on_late = on_late
        self.roofline = roofline
        self.order: list[SimRequest] = []   # running, in the order they were admitted
        self._stepping = False
        self.steps = 0
        self.preemptions = 0
        self.busy_s = 0.0                   # seconds of steps run
        self.late_s = 0.0                   # the loop's lateness at the last step's plan

    # Engine calls _schedule on every submit and finish: here it only wakes the loop
    def _schedule(self) -> None:
        if not self._stepping:
            self._stepping = True
            self.loop.call_soon(self._step, None)

    def arrival_time(self) -> float:
        """The engine's clock for a request that arrives now: the loop's, less the
        loop's lateness at the step in progress (the request comes as far into that
        step as the loop has run since planning it). A loop late on its steps (this
        process short of CPU) then does not add its lateness to the requests' queue
        time, as it does not add it to the steps'."""
        now = self.loop.time()
        return now - self.late_s if self._stepping else now

    def _step(self, start: float | None) -> None:
        """Plan a step starting at ``start`` (the loop's clock, s; None: now): back to
        back steps start at the planned end of the one before, so a late event loop
        catches up instead of adding its lateness to every step."""
        now = self.loop.time()
        if start is None:
            start = now
        self.late_s = max(0.0, now - start)
        parts = self._plan(start)
        self._events_changed()
        if not parts:
            if self.waiting and self.waiting[0].arrival > start:
                self._step(None)   # it came while the loop was late
                return
            self._stepping = False
            return
        # past the prompt every choice computes its own tokens
        cost = self.roofline.step_s([
            (new * (r.n if cached >= r.prompt_len else 1), cached,
             r.n if cached + new == r.prompt_len + r.generated else 0)
            for r, new, cached in parts])
        self.steps += 1
        self.busy_s += cost
        self.loop.call_at(start + cost, self._step_done, parts, start + cost)

    def _plan(self, start: float) -> list[tuple[SimRequest, int, int]]:
        """What the step starting at ``start`` computes: (request, new tokens, tokens
        computed before). Only requests that arrived by ``start`` join it: a step planned
        late (the loop behind its clock) must not take a request that came while it
        ran, or that request's TTFT would be shorter than a step."""
        if not self.s.spare_chunk:
            return self._plan_vllm(start)
        order = [r for r in self.order if not r.finished]
        if self.waiting and order and len(order) >= self.s.max_num_seqs \
                and self.waiting[0].arrival <= start:
            victim = sim_priority.victim(order)
            if victim.priority >= SPARE_PRIORITY \
                    and victim.priority > self.waiting[0].priority:
                order.remove(victim)
                self._preempt(victim)
        self.order = order
        parts = self._plan_vllm(start)
        other = any(r.priority < SPARE_PRIORITY and cached < r.prompt_len
                    for r, _new, cached in parts)
        kept = []
        for r, new, cached in parts:
            if r.priority >= SPARE_PRIORITY and cached < r.prompt_len:
                if other:
                    continue   # its blocks stay allocated; it computes in a later step
                new = min(new, self.s.spare_chunk)
            kept.append((r, new, cached))
        return kept

    def _plan_vllm(self, start: float) -> list[tuple[SimRequest, int, int]]:
        """``_plan`` as vLLM's scheduler plans a step (the module's steps 1-4)."""
        s, pool, bs = self.s, self.pool, self.s.block_size
        budget = s.max_num_batched_tokens
        self.order = order = [r for r in self.order if not r.finished]
        parts: list[tuple[SimRequest, int, int]] = []
        preempted = False
        i = 0
        while i < len(order) and budget > 0:
            r = order[i]
            new = min(r.prompt_len + r.generated - r.computed, budget)
            need = -(-(r.computed + new) // bs) - len(r.blocks)
            victim = None
            while need > pool.num_free and victim is not r:
                victim = self._victim(order)
                k = order.index(victim)
                del order[k]
                if k < i:   # scheduled in this step: its tokens go back to the budget
                    i -= 1
                    j = next(j for j, p in enumerate(parts) if p[0] is victim)
                    budget += parts.pop(j)[1]
                self._preempt(victim)
                preempted = True
            if victim is r:
                break
            r.blocks += pool.allocate(max(need, 0))
            self._cache_upto(r, r.num_cached_blocks, (r.computed + new) // bs)
            parts.append((r, new, r.computed))
            budget -= new
            i += 1
        if preempted:
            return parts
        while self.waiting and len(order) < s.max_num_seqs and budget > 0 \
                and self.waiting[0].arrival <= start:
            r = self.waiting[0]
            known = r.prompt_len + r.generated
            hit = pool.longest_hit(r.hashes[:known // bs],
                                   prefix_hash.cacheable_blocks(known, bs))
            cached = len(hit) * bs
            new = min(known - cached, budget)
            _, _, extra = self.blocks_needed(r.prompt_len, r.max_tokens, r.n)
            blocks = -(-(cached + new) // bs) - len(hit)
            revived = sum(1 for b in hit if b.ref_cnt == 0)
            if pool.num_free < revived + blocks + extra:
                break
            self.waiting.popleft()
            pool.touch(hit)
            r.blocks = hit + pool.allocate(blocks)
            r.extra_blocks = pool.allocate(extra)
            r.num_cached_blocks = len(hit)
            r.computed = cached
            if r.scheduled_at is None:   # vLLM reports the first scheduling's hit
                r.scheduled_at = start
                r.cached_tokens = cached
                r.created_cache_tokens = max(r.prompt_len // bs - len(hit), 0) * bs
                self.prefix_cache_queries += r.prompt_len
                self.prefix_cache_hits += cached
            self._cache_upto(r, len(hit), (cached + new) // bs)
            self.running.add(r)
            order.append(r)
            parts.append((r, new, cached))
            budget -= new
        return parts

    def _victim(self, order: list[SimRequest]) -> SimRequest:
        """The running request vLLM preempts when KV blocks run out: the last admitted
        (``fcfs``), or the lowest priority, latest arrival (``priority``,
        ``tokenstorm.upstream.sim_priority.victim``)."""
        return sim_priority.victim(order) if self.s.scheduling_policy == "priority" \
            else order[-1]

    def _preempt(self, r: SimRequest) -> None:
        """vLLM's ``_preempt_request``: free ``r``'s blocks, back to the waiting head."""
        self.pool.release(r.blocks)
        self.pool.release(r.extra_blocks)
        r.blocks, r.extra_blocks = [], []
        r.num_cached_blocks = 0
        r.computed = 0
        r.num_preemptions += 1
        self.preemptions += 1
        self.running.discard(r)
        self.waiting.appendleft(r)

    def _step_done(self, parts: list[tuple[SimRequest, int, int]], now: float) -> None:
        if self.on_late is not None:
            self.on_late(max(0.0, self.loop.time() - now))
        for r, new, _ in parts:
            if r.finished or r.computed + new > r.prompt_len + r.generated \
                    or r not in self.running:
                continue   # aborted, or preempted while this step ran
            r.computed += new
            if r.computed < r.prompt_len + r.generated:
                continue   # a prefill chunk: no token yet
            first = r.generated == 0
            r.generated += 1
            r.last_token_at = now
            self.generation_tokens += r.n
            if first:
                r.first_token_at = now
                # vLLM counts the prompt at each engine request's first output
                self.prompt_tokens += r.prompt_len * r.n
                if self.on_ttft is not None:
                    self.on_ttft(now - r.arrival)
            self._notify(r)
            if r.generated >= r.max_tokens:
                self._finish(r, "length")
        self._events_changed()
        self._step(now)
