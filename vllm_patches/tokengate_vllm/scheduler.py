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
"""

from __future__ import annotations

import logging
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

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.tokengate_settings = s = SchedulerSettings.from_env()
            if not compat.active(PART):
                return
            from vllm.v1.core.sched.request_queue import SchedulingPolicy

            if s.policy == "fcfs":
                log.info("%s: off (TOKENGATE_SCHED_POLICY=fcfs), first come first served",
                         PART)
            elif self.policy != SchedulingPolicy.FCFS:
                log.warning("%s: off, --scheduling-policy is %s (only fcfs is replaced)",
                            PART, self.policy.value)
            elif self.waiting:
                raise RuntimeError("the waiting queue is not empty at construction")
            else:
                self.waiting = TokenWeightedRequestQueue(s.output_weight, s.max_wait_s)
                log.info("%s: on %s, weight = prompt + %g x max_tokens, aging bound %g s",
                         PART, base.__name__, s.output_weight, s.max_wait_s)

    TokenWeighted.__name__ = TokenWeighted.__qualname__ = f"TokenWeighted{base.__name__}"
    return TokenWeighted


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
