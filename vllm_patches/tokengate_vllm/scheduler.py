"""``TokenWeightedScheduler``: the factory behind ``--scheduler-cls``.

    python -m vllm.entrypoints.openai.api_server ... \\
        --scheduler-cls tokengate_vllm.scheduler.TokenWeightedScheduler

vLLM resolves the dotted path and calls the object with keyword arguments in the
engine-core process (``SchedulerConfig.get_scheduler_cls``, vllm/config/scheduler.py;
``EngineCore.__init__``, vllm/v1/engine/core.py), so a function works where a class is
expected. It builds vLLM's own scheduler of the kind vLLM itself would pick:
``AsyncScheduler`` when async scheduling is on (the default on GPU), ``Scheduler``
otherwise (the CPU platform turns async scheduling off, vllm/platforms/cpu.py), and
replaces only its waiting queue (``self.waiting``) with a
``TokenWeightedRequestQueue``; the queue of waiting requests that hold KV blocks
(``kv_holding_waiting``), preemption and everything else stay vLLM's.

Stays first come, first served (vLLM's queue untouched) with
``TOKENGATE_SCHED_POLICY=fcfs``, with ``--scheduling-policy priority`` (the client's
priorities win), and on a vLLM version the plugin was not tested with (``compat``).

Under ``--scheduling-policy priority`` (vLLM's priority queue kept) it adds three rules
for the requests of priority ``TOKENGATE_SCHED_SPARE_PRIORITY`` (1) or above, which the
edge gives the batch's lines, so that they run on spare capacity only
(``spare_schedule``):

1. a waiting request that finds every seat (``--max-num-seqs``) taken preempts the
   running request of the highest (priority, arrival) when that one runs on spare
   capacity and its priority number is above the waiting one's (vLLM 0.32 preempts only
   when KV blocks run out: ``Scheduler.schedule``);
2. a step that computes another request's prefill holds no spare request's prefill
   chunk (their decodes stay in it);
3. otherwise a spare request's prefill takes at most ``TOKENGATE_SCHED_SPARE_CHUNK``
   (32) tokens a step, so a step holding one costs about a decode step on a GPU.

On ``make bench-batch``'s replica on a virtual clock (Qwen3-8B, H100 roofline, 32
seats; ``python -m tokengate_dev.bench.batch_engine --policies spare``) these rules held
interactive TTFT p99 at 1.05-1.10x its value alone with 0.89-0.92 of the seats busy,
where vLLM's priority policy gave 1.24-1.25x (docs/developers/benchmarks.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import cache
from typing import Any

from tokengate_vllm import compat
from tokengate_vllm.request_queue import TokenWeightedRequestQueue
from tokengate_vllm.settings import SchedulerSettings

log = logging.getLogger("vllm.tokengate")

PART = "token-weighted scheduler"


@cache
def scheduler_class(base: type) -> type:
    """``base`` (vLLM's ``Scheduler`` or ``AsyncScheduler``) with the token-weighted
    waiting queue; one class per base."""

    class TokenWeighted(base):  # type: ignore[valid-type,misc]
        __doc__ = f"vLLM's {base.__name__} with tokengate's token-weighted waiting queue."
        waiting: Any  # vLLM's RequestQueue; set by base.__init__, replaced below
        policy: Any
        tokengate_spare = False  # the spare-capacity rules (priority policy)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.tokengate_settings = s = SchedulerSettings.from_env()
            if not compat.active(PART):
                return
            from vllm.v1.core.sched.request_queue import SchedulingPolicy

            if s.policy == "fcfs":
                log.info("%s: off (TOKENGATE_SCHED_POLICY=fcfs), first come first served",
                         PART)
            elif self.policy == SchedulingPolicy.PRIORITY:
                self.tokengate_spare = True
                log.info("%s: --scheduling-policy priority, priority >= %d on spare "
                         "capacity (prefill chunks of %d tokens)", PART, s.spare_priority,
                         s.spare_chunk)
            elif self.policy != SchedulingPolicy.FCFS:
                log.warning("%s: off, --scheduling-policy is %s (only fcfs is replaced)",
                            PART, self.policy.value)
            elif self.waiting:
                raise RuntimeError("the waiting queue is not empty at construction")
            else:
                self.waiting = TokenWeightedRequestQueue(s.output_weight, s.max_wait_s)
                log.info("%s: on %s, weight = prompt + %g x max_tokens, aging bound %g s",
                         PART, base.__name__, s.output_weight, s.max_wait_s)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            if not self.tokengate_spare:
                return super().schedule(*args, **kwargs)
            s = self.tokengate_settings
            return spare_schedule(self, super().schedule, s.spare_priority, s.spare_chunk,
                                  *args, **kwargs)

    TokenWeighted.__name__ = TokenWeighted.__qualname__ = f"TokenWeighted{base.__name__}"
    return TokenWeighted


def _seats_full(sched: Any) -> bool:
    """Whether vLLM admits no waiting request now (``Scheduler.schedule``'s test)."""
    return bool(len(sched.running) + sched.num_waiting_for_streaming_input
                >= sched.max_num_active_reqs)


def _free_a_seat(sched: Any, spare: int) -> None:
    """Rule 1 (module docstring): preempt as vLLM does when KV blocks run out
    (``running`` less the victim, ``_preempt_request``: its blocks freed, back to the
    waiting queue, named in the step's ``preempted_req_ids``)."""
    if sched.kv_holding_waiting or not sched.waiting or not sched.running \
            or not _seats_full(sched):
        return
    head = sched.waiting.peek_request()
    victim = max(sched.running, key=lambda r: (r.priority, r.arrival_time))
    if victim.priority < spare or victim.priority <= head.priority:
        return
    sched.running.remove(victim)
    sched._preempt_request(victim, time.monotonic(),
                           drop_stale_output=sched.requires_kv_delivery)


def spare_schedule(sched: Any, schedule: Callable[..., Any], spare: int, chunk: int,
                   *args: Any, **kwargs: Any) -> Any:
    """One step of vLLM's ``schedule`` (``schedule``, bound to ``sched``) under the three
    rules of the module docstring for requests of priority ``spare`` or above; returns
    its ``SchedulerOutput``. Rule 2 holds the spare prefills for the step: the running
    ones through vLLM's own skip of a request not yet eligible
    (``next_decode_eligible_step``), the waiting ones out of the queue; rule 3 sets
    vLLM's ``long_prefill_token_threshold`` to ``chunk`` for the step. Both are put back
    when ``schedule`` returns."""
    _free_a_seat(sched, spare)
    other_prefill = any(r.priority < spare and r.is_prefill_chunk for r in sched.running)
    if not other_prefill and sched.waiting and not sched.kv_holding_waiting \
            and not _seats_full(sched):
        other_prefill = sched.waiting.peek_request().priority < spare
    if other_prefill:
        held = [(r, r.next_decode_eligible_step) for r in sched.running
                if r.priority >= spare and r.is_prefill_chunk]
        for r, _ in held:
            r.next_decode_eligible_step = sched.current_step + 2  # schedule adds 1 first
        waiting = [r for r in sched.waiting if r.priority >= spare]
        if waiting:
            sched.waiting.remove_requests(waiting)
        try:
            return schedule(*args, **kwargs)
        finally:
            for r, step in held:
                r.next_decode_eligible_step = step
            for r in waiting:
                sched.waiting.add_request(r)
    cfg = sched.scheduler_config
    before = (cfg.long_prefill_token_threshold, sched.adaptive_long_prefill_threshold)
    if not 0 < before[0] <= chunk:
        cfg.long_prefill_token_threshold = chunk
    sched.adaptive_long_prefill_threshold = False
    try:
        return schedule(*args, **kwargs)
    finally:
        cfg.long_prefill_token_threshold, sched.adaptive_long_prefill_threshold = before


def base_scheduler(vllm_config: Any) -> type:
    """vLLM's scheduler class for this configuration: ``AsyncScheduler`` when
    ``scheduler_config.async_scheduling`` is on, else ``Scheduler`` (the choice
    ``SchedulerConfig.get_scheduler_cls`` makes without ``--scheduler-cls``)."""
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        return AsyncScheduler  # type: ignore[no-any-return]
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler  # type: ignore[no-any-return]


def TokenWeightedScheduler(*args: Any, **kwargs: Any) -> Any:
    """Build the scheduler (see the module docstring); takes exactly the arguments of
    vLLM's ``Scheduler.__init__`` (``vllm_config`` by keyword, as ``EngineCore`` passes
    it, or first)."""
    vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
    return scheduler_class(base_scheduler(vllm_config))(*args, **kwargs)
