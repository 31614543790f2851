"""The plugin's settings, read from the environment of the vLLM server.

vLLM's engine-core process inherits the API server's environment, so one set of
variables configures both parts. A malformed value is an error at startup (a
``ValueError`` naming the variable), never silently replaced by a default.

=================================  ==========================  ==========================
variable                           default                     meaning
=================================  ==========================  ==========================
``TOKENGATE_VLLM_ENABLE``          ``auto``                    ``auto``: on for tested vLLM
                                                               versions; ``1`` force on;
                                                               ``0`` off (``compat``)
``TOKENGATE_ENGINE_USAGE_FILE``    ``var/usage/engine.jsonl``  engine usage file; relative
                                                               to vLLM's working directory;
                                                               ``off`` writes none
``TOKENGATE_SCHED_POLICY``         ``weighted``                ``weighted`` or ``fcfs``
                                                               (``--scheduler-cls`` given)
``TOKENGATE_SCHED_OUTPUT_WEIGHT``  ``0.7``                     weight of one max_tokens
                                                               token against one prompt
                                                               token, >= 0
``TOKENGATE_SCHED_MAX_WAIT_S``     ``10``                      aging bound, seconds >= 0
                                                               (0: first come first served)
``TOKENGATE_SCHED_SPARE_PRIORITY`` ``1``                       under ``--scheduling-policy
                                                               priority``: requests of this
                                                               priority or above run on
                                                               spare capacity, integer >= 1
``TOKENGATE_SCHED_SPARE_CHUNK``    ``32``                      their prefill tokens a step,
                                                               integer >= 1
=================================  ==========================  ==========================
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

USAGE_FILE_ENV = "TOKENGATE_ENGINE_USAGE_FILE"
POLICY_ENV = "TOKENGATE_SCHED_POLICY"
OUTPUT_WEIGHT_ENV = "TOKENGATE_SCHED_OUTPUT_WEIGHT"
MAX_WAIT_ENV = "TOKENGATE_SCHED_MAX_WAIT_S"
SPARE_PRIORITY_ENV = "TOKENGATE_SCHED_SPARE_PRIORITY"
SPARE_CHUNK_ENV = "TOKENGATE_SCHED_SPARE_CHUNK"

# Next to the edge's var/usage/usage.jsonl when vLLM runs from the checkout (make run);
# not a sibling name of it (usage.jsonl*), so the ledger's tail of the edge's file never
# takes the engine's file for a rotation of its own.
DEFAULT_USAGE_FILE = Path("var/usage/engine.jsonl")
POLICIES = ("weighted", "fcfs")
DEFAULT_OUTPUT_WEIGHT = 0.7
DEFAULT_MAX_WAIT_S = 10.0
# the priority the edge gives the batch's lines (edge.admission.priorities.low's
# vllm_priority) and a prefill chunk that keeps a step near a decode step's time on a
# GPU (python -m tokengate_dev.bench.batch_engine --policies spare)
DEFAULT_SPARE_PRIORITY = 1
DEFAULT_SPARE_CHUNK = 32


def usage_file(env: Mapping[str, str] = os.environ) -> Path | None:
    """The engine usage file (absolute), or None when ``TOKENGATE_ENGINE_USAGE_FILE`` is
    ``off``."""
    raw = env.get(USAGE_FILE_ENV, "").strip()
    if raw.lower() == "off":
        return None
    return Path(raw or DEFAULT_USAGE_FILE).absolute()


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}={raw!r}: expected a finite number >= 0")
    return v


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name}={raw!r}: expected an integer >= 1")
    return int(raw)


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """The token-weighted scheduler's settings (see the module docstring).

    ``policy``: ``weighted`` or ``fcfs``; ``output_weight``: weight of one expected
    output token (max_tokens) against one prompt token; ``max_wait_s``: seconds after
    which a waiting request goes before every request that waited less;
    ``spare_priority``, ``spare_chunk``: the spare-capacity rules under vLLM's priority
    policy (``tokengate_vllm.scheduler``).
    """

    policy: str = POLICIES[0]
    output_weight: float = DEFAULT_OUTPUT_WEIGHT
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    spare_priority: int = DEFAULT_SPARE_PRIORITY
    spare_chunk: int = DEFAULT_SPARE_CHUNK

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SchedulerSettings:
        """Read ``TOKENGATE_SCHED_*``; raises ``ValueError`` naming a malformed one."""
        policy = env.get(POLICY_ENV, "").strip().lower() or POLICIES[0]
        if policy not in POLICIES:
            raise ValueError(f"{POLICY_ENV}={policy!r}: expected one of {', '.join(POLICIES)}")
        return cls(policy=policy,
                   output_weight=_float(env, OUTPUT_WEIGHT_ENV, DEFAULT_OUTPUT_WEIGHT),
                   max_wait_s=_float(env, MAX_WAIT_ENV, DEFAULT_MAX_WAIT_S),
                   spare_priority=_int(env, SPARE_PRIORITY_ENV, DEFAULT_SPARE_PRIORITY),
                   spare_chunk=_int(env, SPARE_CHUNK_ENV, DEFAULT_SPARE_CHUNK))
