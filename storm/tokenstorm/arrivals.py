"""Open-loop arrival schedules: when each request is due, in seconds from the start.

Processes (``ArrivalSpec.process``):

``constant``
    One request every ``1 / rate`` s.
``poisson``
    Exponential inter-arrival times with mean ``1 / rate`` s (coefficient of
    variation 1).
``gamma``
    Gamma inter-arrival times with shape ``burstiness`` and scale
    ``1 / (rate * burstiness)``: mean ``1 / rate``, coefficient of variation
    ``1 / sqrt(burstiness)``. ``burstiness < 1`` is burstier than Poisson, ``> 1``
    smoother, ``1`` is Poisson. Same parametrization as vLLM's benchmark
    (``vllm/benchmarks/serve.py``, ``get_request``).

A target in requests/s draws gaps in seconds directly. A target in tokens/s runs the
same process on a *token clock*: request i's gap is its unit gap (mean 1) times
``tokens_i / token_rate``, where ``tokens_i`` is its prompt plus planned output tokens
(what a TPM limit counts). The long-run offered load is then exactly the token rate
whatever the length profile, and bursts of long prompts arrive less often.

Schedules are deterministic for a given seed and are built whole before a run, so
sending never waits on sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from tokenstorm.profiles import LengthProfile, Plan

Process = Literal["constant", "poisson", "gamma"]
MAX_REQUESTS = 20_000_000  # a schedule longer than this is a mistake, not a benchmark
PROCESSES: tuple[Process, ...] = ("constant", "poisson", "gamma")


@dataclass(frozen=True)
class ArrivalSpec:
    """An open-loop arrival process and its target.

    Exactly one of ``rate`` (requests/s) or ``token_rate`` (tokens/s, prompt + output)
    is set. ``burstiness`` is the gamma shape (only for ``gamma``).
    """

    process: Process = "poisson"
    rate: float | None = None
    token_rate: float | None = None
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"arrival process must be one of {PROCESSES}, got {self.process!r}")
        if (self.rate is None) == (self.token_rate is None):
            raise ValueError("give exactly one of rate (requests/s) or token_rate (tokens/s)")
        target = self.rate if self.rate is not None else self.token_rate
        if target is None or not target > 0:
            raise ValueError(f"the target rate must be > 0, got {target}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")

    def unit_gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` inter-arrival gaps with mean 1 (dimensionless), shape ``(n,)``."""
        if self.process == "constant":
            return np.ones(n)
        if self.process == "poisson":
            return rng.exponential(1.0, n)
        return rng.gamma(self.burstiness, 1.0 / self.burstiness, n)


def _vectorized(spec: ArrivalSpec, profile: LengthProfile, duration_s: float,
                rng: np.random.Generator, block: int, cap: int) -> Plan:
    """Lengths independent of time: draw in blocks until the schedule passes the end."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    t0, n = 0.0, 0
    while t0 < duration_s and n < cap:
        k = min(block, cap - n)
        inputs, outputs = profile.sample_block(k, rng)
        units = spec.unit_gaps(k, rng)
        if spec.rate is not None:
            gaps = units / spec.rate
        else:
            assert spec.token_rate is not None
            gaps = units * (inputs + outputs) / spec.token_rate
        times = t0 + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        t0 = float(times[-1] + gaps[-1])
        keep = times < duration_s
        parts.append((times[keep], inputs[keep], outputs[keep]))
        n += int(keep.sum())
    if n >= cap and t0 < duration_s and cap == MAX_REQUESTS:
        raise ValueError(f"more than {MAX_REQUESTS:,} requests in {duration_s:g} s; "
                         "shorten the run")
    times_a = np.concatenate([p[0] for p in parts])
    return Plan(times_a, np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]), np.zeros(times_a.size, dtype=bool))


def schedule(spec: ArrivalSpec, profile: LengthProfile, duration_s: float,
             seed: int = 0, max_requests: int | None = None) -> Plan:
    """All requests due in ``[0, duration_s)``: send offsets (s) and token lengths.

    The first request is due at 0 s. Lengths that depend on the send time (``burst``,
    an untimed trace replayed in order) are sampled one request at a time, others in
    blocks. ``max_requests`` caps the count. A timed trace brings its own timestamps
    (``spec`` is then ignored). Raises ``ValueError`` above ``MAX_REQUESTS``.
    """
    rng = np.random.default_rng(seed)
    own = profile.schedule(duration_s, rng)
    if own is not None:
        return own if max_requests is None else own.head(max_requests)
    cap = MAX_REQUESTS if max_requests is None else max_requests
    if not profile.time_dependent:
        if spec.rate is not None:
            expected = spec.rate * duration_s
        else:
            assert spec.token_rate is not None
            expected = spec.token_rate * duration_s / max(profile.mean_tokens(), 1.0)
        return _vectorized(spec, profile, duration_s, rng, int(expected * 1.2 + 100), cap)
    times: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    burst: list[bool] = []
    t = 0.0
    batch = np.empty(0)
    j = 0
    while t < duration_s:
        if len(times) >= cap:
            if max_requests is None:
                raise ValueError(f"more than {MAX_REQUESTS:,} requests in {duration_s:g} s; "
                                 "shorten the run")
            break
        if j == len(batch):
            batch = spec.unit_gaps(4096, rng)
            j = 0
        inp, out, in_burst = profile.sample(t, rng)
        times.append(t)
        inputs.append(inp)
        outputs.append(out)
        burst.append(in_burst)
        if spec.rate is not None:
            t += float(batch[j]) / spec.rate
        else:
            assert spec.token_rate is not None
            t += float(batch[j]) * (inp + out) / spec.token_rate
        j += 1
    return Plan(np.asarray(times, dtype=np.float64), np.asarray(inputs, dtype=np.int64),
                np.asarray(outputs, dtype=np.int64), np.asarray(burst, dtype=bool))
