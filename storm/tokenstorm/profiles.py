"""Token-length profiles: how many prompt and output tokens each request has.

Input (prompt) lengths, in tokens:

``normal``
    Normal with mean 2000 and standard deviation 500 (``mean``, ``sd``).
``long_tail``
    A mixture: 95 % normal around 1000 (sd 100), 5 % normal around 10000 (sd 1000)
    (``p_tail``, ``mean``, ``tail_mean``).
``burst``
    For the first 10 s of every minute (``burst_s`` of ``period_s``) uniform in
    500-8000; otherwise uniform in 100-500. Requests due inside a burst window are
    marked so reports can show burst and steady windows apart.
``trace``
    Replay of a JSONL file, one request per line: ``input_tokens`` (or
    ``input_length``), optional ``output_tokens`` (``output_length``), optional
    ``timestamp`` in seconds (``timestamp_ms`` in ms). With timestamps the trace
    also gives the arrival times (relative to its first line, divided by ``speed``);
    without, its lengths are used in order, cycling, under the chosen arrival
    process.

Output tokens default to ``round(1.8 * input)`` (``OutputPolicy.ratio``), or a fixed
number, or the trace's own; always at least 1 and capped by the model:
``input + output <= max_model_len``, and by ``max_output`` when set. Input is clipped
to ``[min_input, max_model_len - min_output]`` (``TokenLimits``), so a long tail on a
model with an 8k context is cut at the context, and said so in ``describe()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Plan:
    """A whole run's requests, as columns: send offset (s), prompt and output tokens,
    and whether the request is due inside a burst window."""

    times: np.ndarray
    inputs: np.ndarray
    outputs: np.ndarray
    burst: np.ndarray

    def __len__(self) -> int:
        return int(self.times.shape[0])

    def head(self, n: int) -> Plan:
        return Plan(self.times[:n], self.inputs[:n], self.outputs[:n], self.burst[:n])

    def take(self, idx: np.ndarray | slice) -> Plan:
        return Plan(self.times[idx], self.inputs[idx], self.outputs[idx], self.burst[idx])


@dataclass(frozen=True)
class TokenLimits:
    """Bounds from the served model (tokens): shortest prompt the prompt builder can
    make, the context length, and the least output a request keeps."""

    min_input: int = 9
    max_model_len: int = 8192
    min_output: int = 16

    @property
    def max_input(self) -> int:
        return max(self.min_input, self.max_model_len - self.min_output)

    def clip_input(self, n: float) -> int:
        return int(min(max(round(n), self.min_input), self.max_input))


@dataclass(frozen=True)
class OutputPolicy:
    """Output tokens per request: ``fixed`` if set, else ``round(ratio * input)``;
    capped by ``max_output`` (optional) and by the context; at least 1."""

    ratio: float = 1.8
    fixed: int | None = None
    max_output: int | None = None

    def tokens(self, inp: int, limits: TokenLimits, own: int | None = None) -> int:
        out = own if own is not None else (self.fixed if self.fixed is not None
                                           else round(self.ratio * inp))
        if self.max_output is not None:
            out = min(out, self.max_output)
        return int(max(1, min(out, limits.max_model_len - inp)))


@dataclass
class LengthProfile:
    """Base: draws (input tokens, output tokens, in burst window) for a send time."""

    limits: TokenLimits = field(default_factory=TokenLimits)
    output: OutputPolicy = field(default_factory=OutputPolicy)
    name: str = "base"

    def draw_input(self, t_s: float, rng: np.random.Generator) -> tuple[float, bool]:
        raise NotImplementedError

    #: Whether lengths depend on the send time (sampled one by one) or not (in blocks).
    time_dependent: bool = False

    def sample(self, t_s: float, rng: np.random.Generator) -> tuple[int, int, bool]:
        """One request due at ``t_s`` seconds: (input tokens, output tokens, burst)."""
        raw, in_burst = self.draw_input(t_s, rng)
        inp = self.limits.clip_input(raw)
        return inp, self.output.tokens(inp, self.limits), in_burst

    def draw_inputs(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` raw input lengths at once (time-independent profiles)."""
        return np.array([self.draw_input(0.0, rng)[0] for _ in range(n)])

    def sample_block(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``n`` requests' (input tokens, output tokens), shape ``(n,)`` each."""
        lim = self.limits
        inp = np.clip(np.rint(self.draw_inputs(n, rng)), lim.min_input, lim.max_input)
        inp = inp.astype(np.int64)
        pol = self.output
        if pol.fixed is not None:
            out = np.full(n, pol.fixed, dtype=np.int64)
        else:
            out = np.rint(pol.ratio * inp).astype(np.int64)
        if pol.max_output is not None:
            out = np.minimum(out, pol.max_output)
        out = np.maximum(1, np.minimum(out, lim.max_model_len - inp))
        return inp, out

    def schedule(self, duration_s: float, rng: np.random.Generator) -> Plan | None:
        """A profile with its own arrival times (a timed trace) returns them; else None."""
        return None

    def mean_tokens(self, samples: int = 20000) -> float:
        """Expected prompt + output tokens per request (Monte Carlo, fixed seed)."""
        rng = np.random.default_rng(12345)
        ts = rng.uniform(0.0, 60.0, samples)
        total = 0
        for t in ts:
            inp, out, _ = self.sample(float(t), rng)
            total += inp + out
        return total / samples

    def describe(self) -> str:
        return self.name


@dataclass
class NormalProfile(LengthProfile):
    mean: float = 2000.0
    sd: float = 500.0
    name: str = "normal"

    def draw_input(self, t_s: float, rng: np.random.Generator) -> tuple[float, bool]:
        return float(rng.normal(self.mean, self.sd)), False

    def draw_inputs(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.normal(self.mean, self.sd, n)

    def describe(self) -> str:
        return f"normal(mean={self.mean:g}, sd={self.sd:g}) input tokens"


@dataclass
class LongTailProfile(LengthProfile):
    p_tail: float = 0.05
    mean: float = 1000.0
    sd: float = 100.0
    tail_mean: float = 10000.0
    tail_sd: float = 1000.0
    name: str = "long_tail"

    def draw_input(self, t_s: float, rng: np.random.Generator) -> tuple[float, bool]:
        if rng.random() < self.p_tail:
            return float(rng.normal(self.tail_mean, self.tail_sd)), False
        return float(rng.normal(self.mean, self.sd)), False

    def draw_inputs(self, n: int, rng: np.random.Generator) -> np.ndarray:
        tail = rng.random(n) < self.p_tail
        body = rng.normal(self.mean, self.sd, n)
        return np.where(tail, rng.normal(self.tail_mean, self.tail_sd, n), body)

    def describe(self) -> str:
        clip = ""
        if self.tail_mean > self.limits.max_input:
            clip = f", tail clipped to the context ({self.limits.max_input})"
        return (f"long_tail({100 * (1 - self.p_tail):g}% ~{self.mean:g}, "
                f"{100 * self.p_tail:g}% ~{self.tail_mean:g} input tokens{clip})")


@dataclass
class BurstProfile(LengthProfile):
    period_s: float = 60.0
    burst_s: float = 10.0
    burst_range: tuple[int, int] = (500, 8000)
    steady_range: tuple[int, int] = (100, 500)
    name: str = "burst"
    time_dependent: bool = True

    def in_burst(self, t_s: float) -> bool:
        return (t_s % self.period_s) < self.burst_s

    def draw_input(self, t_s: float, rng: np.random.Generator) -> tuple[float, bool]:
        if self.in_burst(t_s):
            lo, hi = self.burst_range
            return float(rng.integers(lo, hi + 1)), True
        lo, hi = self.steady_range
        return float(rng.integers(lo, hi + 1)), False

    def describe(self) -> str:
        return (f"burst({self.burst_s:g} s of every {self.period_s:g} s: "
                f"{self.burst_range[0]}-{self.burst_range[1]} input tokens, otherwise "
                f"{self.steady_range[0]}-{self.steady_range[1]})")


@dataclass
class TraceProfile(LengthProfile):
    path: Path = Path("trace.jsonl")
    speed: float = 1.0
    name: str = "trace"
    _inputs: list[int] = field(default_factory=list, repr=False)
    _outputs: list[int | None] = field(default_factory=list, repr=False)
    _times: list[float | None] = field(default_factory=list, repr=False)
    _next: int = 0
    time_dependent: bool = True  # cycles through the trace in order

    def __post_init__(self) -> None:
        for lineno, line in enumerate(Path(self.path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                inp = rec.get("input_tokens", rec.get("input_length"))
                out = rec.get("output_tokens", rec.get("output_length"))
                ts = rec.get("timestamp")
                if ts is None and rec.get("timestamp_ms") is not None:
                    ts = float(rec["timestamp_ms"]) / 1000.0
                self._inputs.append(int(inp))
                self._outputs.append(None if out is None else int(out))
                self._times.append(None if ts is None else float(ts))
            except (ValueError, TypeError, AttributeError) as e:
                raise ValueError(f"{self.path}:{lineno}: {e}") from e
        if not self._inputs:
            raise ValueError(f"{self.path}: empty trace")

    @property
    def timed(self) -> bool:
        return all(t is not None for t in self._times)

    def sample(self, t_s: float, rng: np.random.Generator) -> tuple[int, int, bool]:
        i = self._next % len(self._inputs)
        self._next += 1
        inp = self.limits.clip_input(self._inputs[i])
        return inp, self.output.tokens(inp, self.limits, self._outputs[i]), False

    def mean_tokens(self, samples: int = 20000) -> float:
        total = 0
        for i, raw in enumerate(self._inputs):
            inp = self.limits.clip_input(raw)
            total += inp + self.output.tokens(inp, self.limits, self._outputs[i])
        return total / len(self._inputs)

    def schedule(self, duration_s: float, rng: np.random.Generator) -> Plan | None:
        if not self.timed:
            return None
        t0 = min(t for t in self._times if t is not None)
        rows = []
        for i, ts in enumerate(self._times):
            assert ts is not None
            t = (ts - t0) / self.speed
            if t < duration_s:
                inp = self.limits.clip_input(self._inputs[i])
                rows.append((t, inp, self.output.tokens(inp, self.limits, self._outputs[i])))
        rows.sort()
        return Plan(np.array([r[0] for r in rows], dtype=np.float64),
                    np.array([r[1] for r in rows], dtype=np.int64),
                    np.array([r[2] for r in rows], dtype=np.int64),
                    np.zeros(len(rows), dtype=bool))

    def describe(self) -> str:
        how = f"timed, speed x{self.speed:g}" if self.timed else "lengths only"
        return f"trace({self.path}, {len(self._inputs)} requests, {how})"


PROFILES = ("normal", "long_tail", "burst", "trace")


def make_profile(spec: str, limits: TokenLimits, output: OutputPolicy) -> LengthProfile:
    """Profile from a CLI spec: ``NAME`` or ``NAME:key=value,...``.

    Examples: ``normal``, ``normal:mean=1000,sd=0`` (every prompt 1000 tokens),
    ``long_tail:p_tail=0.1``, ``burst:period_s=30,burst_s=5``,
    ``trace:path=runs/trace.jsonl,speed=2``. Raises ``ValueError``.
    """
    name, _, rest = spec.partition(":")
    kwargs: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"profile option {item!r}: expected key=value")
        kwargs[k.strip()] = v.strip()
    floats = {"mean", "sd", "p_tail", "tail_mean", "tail_sd", "period_s", "burst_s", "speed"}
    parsed: dict[str, object] = {}
    for k, v in kwargs.items():
        if k in floats:
            parsed[k] = float(v)
        elif k in ("burst_range", "steady_range"):
            lo, _, hi = v.partition("-")
            parsed[k] = (int(lo), int(hi))
        elif k == "path":
            parsed[k] = Path(v)
        else:
            raise ValueError(f"unknown option {k!r} for profile {name!r}")
    classes: dict[str, type[LengthProfile]] = {
        "normal": NormalProfile, "long_tail": LongTailProfile, "burst": BurstProfile,
        "trace": TraceProfile}
    cls = classes.get(name)
    if cls is None:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {name!r}")
    if cls is TraceProfile and "path" not in parsed:
        raise ValueError("trace profile needs path=FILE.jsonl")
    try:
        return cls(limits=limits, output=output, **parsed)  # type: ignore[arg-type]
    except TypeError as e:
        raise ValueError(f"profile {name!r}: {e}") from e
