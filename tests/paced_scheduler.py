"""A test-only ``--scheduler-cls``: tokengate's token-weighted scheduler, whose engine
steps each take at least ``PACE_S`` longer while the file named by
``$TOKENGATE_TEST_PACE_FILE`` exists.

The tiny test model generates a few thousand tokens a second on CPU, so a request that
must keep a running slot busy while others queue behind it ends within 2-3 s (its length
is bounded by max_model_len), sometimes before a test has seen the queue it needs. While
a test holds the file, a step takes at least 5 ms, so such a blocker outlasts the test,
which then ends it itself (its client leaves: vLLM aborts it) at the moment it chooses,
on a fast machine as on a loaded one. vLLM, the plugin's scheduler and its waiting queue
are unchanged: this wrapper only delays the call to ``schedule``, and, with
``$TOKENGATE_TEST_STEPS_FILE`` set, appends what each paced step scheduled to that file
(a JSON object a line: vLLM's request id -> tokens), what the spare-capacity tests read.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

PACE_ENV = "TOKENGATE_TEST_PACE_FILE"
STEPS_ENV = "TOKENGATE_TEST_STEPS_FILE"
PACE_S = 0.005


def PacedTokenWeightedScheduler(*args: Any, **kwargs: Any) -> Any:
    """``TokenWeightedScheduler(*args, **kwargs)`` with paced steps (module docstring).
    Imported here, in the engine: the test process reads ``PACE_ENV`` without importing
    vLLM (12-25 CPU-s there)."""
    from tokengate_vllm.scheduler import TokenWeightedScheduler

    sched = TokenWeightedScheduler(*args, **kwargs)
    flag, steps = os.environ.get(PACE_ENV), os.environ.get(STEPS_ENV)
    if flag:
        step = sched.schedule

        def schedule(*a: Any, **k: Any) -> Any:
            paced = os.path.exists(flag)
            if paced:
                time.sleep(PACE_S)
            out = step(*a, **k)
            if paced and steps and out.total_num_scheduled_tokens:
                with open(steps, "a") as f:
                    f.write(json.dumps(out.num_scheduled_tokens) + "\n")
            return out

        sched.schedule = schedule
    return sched
