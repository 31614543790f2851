"""``make bench-batch``'s replica alone, on a virtual clock: the scheduler's part of
what a batch costs interactive TTFT, free of this machine's CPU.

One simulated H100 replica of ``make bench-batch`` (``tokenstorm.upstream.sim_steps``:
vLLM's steps timed by the roofline of Qwen3-8B, ``--slots`` seats, the given
``--scheduling-policy``) runs in an event loop whose clock moves only when the loop
would wait (``VirtualLoop``): a step costs its roofline time and nothing else, so the
figures are the same on every run of a seed. Interactive requests (priority 0) arrive
as ``make bench-batch``'s do, Poisson at ``--interactive-share`` of the seats, 200
prompt and 48 output tokens; the batch's lines (priority 1 under ``priority``) are
submitted straight to the engine by a model of the edge's admission of its ``low``
priority (``tokengate.admission``): a line goes while fewer than ``max_running``
requests run or wait, at most ``max_waiting`` wait, and its prefill lane is free (each
line takes it for prompt / ``max_prefill_tokens`` x the mean TTFT so far); the model
reads the engine's counts at once, where the edge reads them from ``/metrics`` and from
its own requests.

For each bound given: the interactive TTFT p99 (ms, arrival at the replica to the first
token: the engine records' queued + prefill) over that alone, the queued part's p99,
the busy share (seats in use over seats) and the preemptions, over the run less its
first ``--warm-s``.

Besides vLLM's policies, ``spare``: vLLM's priority policy with the rules of tokengate's
vLLM plugin scheduler for the batch's lines (``tokengate_vllm.scheduler``; the
simulated replica's ``spare_chunk``, the plugin's ``DEFAULT_SPARE_CHUNK`` tokens). On
seeds 11-13, 60 s, 28-29 of 32 seats for lines, no lane: interactive TTFT p99
1.05-1.10x alone at 0.89-0.92 of the seats, where the priority policy gave 1.24-1.25x
(docs/developers/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import selectors
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from tokengate_vllm.settings import DEFAULT_SPARE_CHUNK
from tokenstorm.upstream.sim_engine import SimRequest
from tokenstorm.upstream.sim_settings import SCHEDULING_POLICIES, SimSettings
from tokenstorm.upstream.sim_steps import SteppedEngine

OUTPUT_TOKEN_ID = 5


class _NoWaitSelector(selectors.BaseSelector):
    """A selector with nothing to watch: its wait moves the loop's virtual clock."""

    def __init__(self) -> None:
        self.loop: VirtualLoop | None = None
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        self._keys[fd] = selectors.SelectorKey(fileobj, fd, events, data)
        return self._keys[fd]

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj if isinstance(fileobj, int) else fileobj.fileno())

    def select(self, timeout: float | None = None) -> list[Any]:
        assert self.loop is not None
        if timeout:
            self.loop.now += timeout
        return []

    def get_map(self) -> Any:
        return self._keys


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (s): callbacks take no time, and a wait for the
    next timer jumps the clock to it. Nothing here reads sockets."""

    def __init__(self) -> None:
        sel = _NoWaitSelector()
        super().__init__(sel)
        sel.loop = self
        self.now = 0.0

    def time(self) -> float:
        return self.now


# the policies this benchmark runs: vLLM's, and the what-if
POLICIES = (*SCHEDULING_POLICIES, "spare")


@dataclass(frozen=True)
class Bound:
    """The edge's bounds of the batch's priority: ``max_running``, ``max_waiting``,
    ``max_prefill_tokens`` (0: no lane)."""

    max_running: int
    max_waiting: int
    prefill_tokens: int

    @classmethod
    def parse(cls, text: str) -> Bound:
        """``running:waiting:prefill`` (``30:2:256``)."""
        a, b, c = (int(x) for x in text.split(":"))
        return cls(a, b, c)


@dataclass(frozen=True)
class Figures:
    ttft_p99_ms: float
    queued_p99_ms: float
    busy_share: float
    lines: int
    preemptions: int


def run(policy: str, bound: Bound | None, seed: int, duration_s: float, warm_s: float,
        slots: int = 32, share: float = 0.35, prompt: int = 200, output: int = 48
        ) -> Figures:
    """One run on a virtual clock: interactive requests alone (``bound`` None) or beside
    a batch admitted within ``bound``; figures over ``warm_s`` .. ``duration_s``."""
    spare = policy == "spare"
    s = SimSettings(gpu="h100", model_config="qwen3-8b", num_gpu_blocks=0,
                    max_model_len=4096, max_num_seqs=slots,
                    scheduling_policy="priority" if spare else policy,
                    spare_chunk=DEFAULT_SPARE_CHUNK if spare else 0).sized()
    rf = s.roofline()
    assert rf is not None
    # make bench-batch's rate (tokengate_dev.bench.batch.Options.request_s), one replica
    request_s = rf.step_s([(prompt, 0, 1)]) + output * rf.step_s(
        [(1, prompt + output // 2, 1)] * max(1, round(share * slots)))
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(request_s / (share * slots), int(2 * duration_s * share * slots
                                                           / request_s) + 10)
    arrivals = [t for t in np.cumsum(gaps) if t < duration_s]
    ids = itertools.count(1)
    interactive: list[SimRequest] = []
    lines: list[SimRequest] = []
    ttfts: list[float] = []
    loop = VirtualLoop()

    def distinct() -> list[int]:
        base = next(ids) * 1000   # no two prompts share a block
        return list(range(base, base + prompt))

    async def main() -> None:
        e = SteppedEngine(s, rf, OUTPUT_TOKEN_ID, on_ttft=ttfts.append)

        async def users() -> None:
            for t in arrivals:
                await asyncio.sleep(max(0.0, t - loop.time()))
                interactive.append(e.submit(distinct(), output, priority=0))

        async def batch(b: Bound) -> None:
            lane_free = 0.0
            while loop.time() < duration_s:
                waiting = len(e.waiting)
                if len(e.running) + waiting < b.max_running and waiting <= b.max_waiting \
                        and loop.time() >= lane_free:
                    lines.append(e.submit(distinct(), output,
                                          priority=0 if policy == "fcfs" else 1))
                    if b.prefill_tokens and ttfts:
                        lane_free = loop.time() + prompt / b.prefill_tokens * float(
                            np.mean(ttfts))
                    continue
                await asyncio.sleep(0.002)   # the edge's hold looks every 2 ms

        tasks = [users()] + ([batch(bound)] if bound else [])
        await asyncio.gather(*tasks)
        await asyncio.gather(*(r.done for r in interactive))

    loop.run_until_complete(main())
    loop.close()
    measured = [r for r in interactive if warm_s <= r.arrival <= duration_s]
    ttft = [(r.first_token_at - r.arrival) * 1000 for r in measured]
    queued = [((r.scheduled_at or r.arrival) - r.arrival) * 1000 for r in measured]
    used = sum(max(0.0, min(r.last_token_at if r.finished else duration_s, duration_s)
                   - max(r.scheduled_at, warm_s))
               for r in interactive + lines if r.scheduled_at is not None)
    return Figures(float(np.percentile(ttft, 99)), float(np.percentile(queued, 99)),
                   used / (slots * (duration_s - warm_s)), len(lines),
                   sum(r.num_preemptions for r in interactive + lines))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tokengate_dev.bench.batch_engine",
                                description=__doc__.split("\n")[0])
    p.add_argument("--bounds", nargs="+", type=Bound.parse,
                   default=[Bound.parse(x) for x in ("26:2:256", "28:2:256", "29:2:256",
                                                     "30:2:256", "30:2:0", "32:8:256")],
                   metavar="RUNNING:WAITING:PREFILL",
                   help="the batch priority's max_running, max_waiting and "
                        "max_prefill_tokens (0: no lane) of each run (default: 26:2:256 "
                        "28:2:256 29:2:256 30:2:256 30:2:0 32:8:256)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="vLLM's scheduling policies, and spare: priority with the vLLM "
                        "plugin scheduler's rules for lines")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--warm-s", type=float, default=5.0)
    args = p.parse_args(argv)
    console = Console()
    alone = run("fcfs", None, args.seed, args.duration_s, args.warm_s)
    t = Table(title=f"one replica on a virtual clock, seed {args.seed}: interactive alone "
                    f"TTFT p99 {alone.ttft_p99_ms:.1f} ms (queued "
                    f"{alone.queued_p99_ms:.1f}), busy share {alone.busy_share:.3f}")
    for c in ("policy", "max_running:max_waiting:prefill", "TTFT p99 ms", "with / alone",
              "queued p99 ms", "busy share", "lines", "preemptions"):
        t.add_column(c, justify="left" if c == "policy" else "right")
    for policy in args.policies:
        for b in args.bounds:
            f = run(policy, b, args.seed, args.duration_s, args.warm_s)
            t.add_row(policy, f"{b.max_running}:{b.max_waiting}:{b.prefill_tokens}",
                      f"{f.ttft_p99_ms:.1f}", f"{f.ttft_p99_ms / alone.ttft_p99_ms:.2f}",
                      f"{f.queued_p99_ms:.1f}", f"{f.busy_share:.3f}", str(f.lines),
                      str(f.preemptions))
    console.print(t)


if __name__ == "__main__":
    main()
