"""A test-only ``--scheduler-cls``: tokengate's token-weighted scheduler, whose engine
steps each take at least ``PACE_S`` longer while the file named by
``$TOKENGATE_TEST_PACE_FILE`` exists.

The tiny test model generates a few thousand tokens a second on CPU, so a request that
must keep a running slot busy while others queue behind it ends within 2-3 s (its length
is bounded by max_model_len), sometimes before a test has seen the queue it needs. While
a test holds the file, a step takes at least 5 ms, so such a blocker outlasts the test,
which then ends it itself (its client leaves: vLLM aborts it) at the moment it chooses,
on a fast machine as on a loaded one. vLLM, the plugin's scheduler and its waiting queue
are unchanged: this wrapper only delays the call to ``schedule``.
"""

from __future__ import annotations

import os
import time
from typing import Any

PACE_ENV = "TOKENGATE_TEST_PACE_FILE"
PACE_S = 0.005


def PacedTokenWeightedScheduler(*args: Any, **kwargs: Any) -> Any:
    """``TokenWeightedScheduler(*args, **kwargs)`` with paced steps (module docstring).
    Imported here, in the engine: the test process reads ``PACE_ENV`` without importing
    vLLM (12-25 CPU-s there)."""
    from tokengate_vllm.scheduler import TokenWeightedScheduler

    sched = TokenWeightedScheduler(*args, **kwargs)
    flag = os.environ.get(PACE_ENV)
    if flag:
        step = sched.schedule

        def schedule(*a: Any, **k: Any) -> Any:
            if os.path.exists(flag):
                time.sleep(PACE_S)
            return step(*a, **k)

        sched.schedule = schedule
    return sched
