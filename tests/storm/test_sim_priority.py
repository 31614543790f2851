"""A simulated replica under vLLM 0.32's ``--scheduling-policy priority``
(``tokenstorm.upstream.sim_priority``): waiting requests by (priority, arrival), the
lowest priority preempted when KV blocks run out, a preempted request back at its own
place; under ``fcfs`` the body's priority changes nothing. Steps are counted, never
timed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from tokenstorm.upstream.sim import SimReplica
from tokenstorm.upstream.sim_priority import PriorityWaiting, victim
from tokenstorm.upstream.sim_settings import SimSettings
from tokenstorm.upstream.sim_steps import SteppedEngine

from tests.conftest import MODEL
from tests.storm.test_sim_steps import OUTPUT_ID, settings


@dataclass
class Req:
    priority: int
    arrival: float
    request_id: str


@pytest.mark.unit
def test_the_queue_orders_by_priority_then_arrival_then_id_and_a_preempted_one_keeps_its_place(
) -> None:
    q: PriorityWaiting[Req] = PriorityWaiting()
    a, b, c, d = Req(1, 1.0, "a"), Req(0, 3.0, "b"), Req(0, 2.0, "c"), Req(0, 2.0, "bb")
    for r in (a, b, c, d):
        q.append(r)
    assert [r.request_id for r in q] == ["bb", "c", "b", "a"]
    assert q[0] is d and len(q) == 4
    q.remove(c)
    with pytest.raises(ValueError):
        q.remove(c)
    late = Req(0, 2.5, "late")
    q.appendleft(late)           # vLLM's prepend_request under priority: its own place
    assert [q.popleft().request_id for _ in range(len(q))] == ["bb", "late", "b", "a"]
    with pytest.raises(IndexError):
        q[0]


@pytest.mark.unit
def test_the_victim_is_the_lowest_priority_then_the_latest_arrival() -> None:
    running = [Req(1, 1.0, "low-early"), Req(0, 5.0, "high-late"), Req(1, 2.0, "low-late"),
               Req(0, 0.5, "high-early")]
    assert victim(running).request_id == "low-late"
    assert victim(running[1:2] + running[3:]).request_id == "high-late"


def serve(s: SimSettings, jobs: list[tuple[list[int], int, int]]
          ) -> tuple[SteppedEngine, list[Any]]:
    """Submit ``jobs`` (prompt ids, max_tokens, priority) at once, in order, to a
    stepped engine, and wait for all of them."""
    async def main() -> tuple[SteppedEngine, list[Any]]:
        rf = s.roofline()
        assert rf is not None
        e = SteppedEngine(s, rf, OUTPUT_ID)
        rs = [e.submit(ids, n, request_id=f"r{i}", priority=p)
              for i, (ids, n, p) in enumerate(jobs)]
        await asyncio.gather(*(r.done for r in rs))
        return e, rs

    return asyncio.run(main())


def admission_order(rs: list[Any]) -> list[int]:
    return sorted(range(len(rs)), key=lambda i: (rs[i].scheduled_at, i))


@pytest.mark.unit
def test_a_waiting_high_priority_request_is_admitted_before_earlier_low_ones() -> None:
    """One seat: the first request runs; of the three that wait, the later one of
    priority 0 goes before the two earlier ones of priority 5, which then go by arrival."""
    jobs = [(list(range(i * 100, i * 100 + 40)), 4, p) for i, p in enumerate((0, 5, 5, 0))]
    _e, rs = serve(settings(scheduling_policy="priority", max_num_seqs=1), jobs)
    assert admission_order(rs) == [0, 3, 1, 2]


@pytest.mark.unit
def test_under_fcfs_the_bodys_priority_changes_nothing() -> None:
    jobs = [(list(range(i * 100, i * 100 + 40)), 4, p) for i, p in enumerate((0, 5, 5, 0))]
    _e, rs = serve(settings(max_num_seqs=1), jobs)
    assert admission_order(rs) == [0, 1, 2, 3]


@pytest.mark.unit
def test_a_short_kv_cache_preempts_the_low_priority_request_though_it_came_first() -> None:
    """200 blocks, three prompts of 63 blocks admitted at once, each growing by 32 more:
    under fcfs the last admitted is preempted and the first never; under priority the
    first (priority 1) is the one preempted, given back the budget it had taken in the
    step, and it finishes after the two of priority 0, which are never preempted."""
    base = {"model_config": "qwen3-8b", "num_gpu_blocks": 200, "max_model_len": 2048}
    prompts = [list(range(i * 5000, i * 5000 + 1000)) for i in range(3)]
    e, rs = serve(settings(**base), [(p, 500, 1 if i == 0 else 0)
                                     for i, p in enumerate(prompts)])
    assert e.preemptions > 0 and rs[0].num_preemptions == 0
    e, rs = serve(settings(**base, scheduling_policy="priority"),
                  [(p, 500, 1 if i == 0 else 0) for i, p in enumerate(prompts)])
    assert rs[0].num_preemptions == e.preemptions > 0
    assert rs[1].num_preemptions == rs[2].num_preemptions == 0
    assert rs[0].last_token_at > max(rs[1].last_token_at, rs[2].last_token_at)
    assert all(r.generated == 500 for r in rs)
    assert e.pool.num_free == 199 and not e.running and not e.waiting


def test_a_replica_takes_the_priority_flag_and_refuses_a_priority_that_is_no_integer(
        ) -> None:
    s = SimSettings(model=MODEL, max_model_len=2048, scheduling_policy="priority")
    assert s.argv()[s.argv().index("--scheduling-policy") + 1] == "priority"
    with pytest.raises(ValueError, match="--scheduling-policy"):
        SimSettings(scheduling_policy="lifo").check()
    spare = SimSettings(gpu="h100", num_gpu_blocks=0, scheduling_policy="priority",
                        spare_chunk=32).sized()
    assert spare.argv()[spare.argv().index("--spare-chunk") + 1] == "32"
    for bad in ({"gpu": "h100", "spare_chunk": 32}, {"scheduling_policy": "priority",
                                                     "spare_chunk": 32},
                {"gpu": "h100", "scheduling_policy": "priority", "spare_chunk": -1}):
        with pytest.raises(ValueError, match="--spare-chunk"):
            SimSettings(**{"num_gpu_blocks": 0, **bad}).sized().check()
    with SimReplica(s) as rep:
        body = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 2}
        ok = httpx.post(rep.url + "/completions", json={**body, "priority": -3}, timeout=30)
        bad = httpx.post(rep.url + "/completions", json={**body, "priority": "1"},
                         timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "body.priority"


@pytest.mark.unit
def test_spare_chunks_free_a_seat_keep_line_prefills_apart_and_small() -> None:
    """The vLLM plugin scheduler's rules in a simulated replica (``spare_chunk`` 32), on
    a virtual clock (tokengate_dev.bench.batch_engine's): a line (priority 1) running in
    the one seat is preempted for an interactive request, which gets its first token in
    its own first step; a line's 200-token prompt is computed 32 tokens a step, never in
    a step that computes an interactive prefill; both finish."""
    from tokengate_dev.bench.batch_engine import VirtualLoop

    spare = {"scheduling_policy": "priority", "spare_chunk": 32, "model_config": "qwen3-8b"}
    s = settings(max_num_seqs=1, **spare)
    steps: list[list[tuple[int, int, bool]]] = []   # per step: (priority, new, prefill)

    class Recorded(SteppedEngine):
        def _plan(self, start: float) -> list[tuple[Any, int, int]]:
            parts = super()._plan(start)
            steps.append([(r.priority, new, c < r.prompt_len) for r, new, c in parts])
            return parts

    async def main() -> list[Any]:
        rf = s.roofline()
        assert rf is not None
        e = Recorded(s, rf, OUTPUT_ID)
        line = e.submit(list(range(1000, 1200)), 40, request_id="line", priority=1)
        await asyncio.sleep(20 * rf.step_s([(1, 200, 1)]))   # the line decodes by then
        inter = e.submit(list(range(5000, 5200)), 4, request_id="inter", priority=0)
        await asyncio.gather(line.done, inter.done)
        return [line, inter]

    loop = VirtualLoop()
    line, inter = loop.run_until_complete(main())
    loop.close()
    first = [(p, new) for p, new, prefill in steps[0]]
    assert first == [(1, 32)]   # the line's first chunk
    assert [len(st) for st in steps[:7]] == [1] * 7 and steps[6] == [(1, 200 - 6 * 32, True)]
    inter_steps = [st for st in steps if any(p == 0 and prefill for p, _n, prefill in st)]
    assert inter_steps == [[(0, 200, True)]]   # alone: the line was preempted
    assert line.num_preemptions == 1 and inter.num_preemptions == 0
    assert inter.last_token_at < line.last_token_at
    assert (line.generated, inter.generated) == (40, 4)

    # two seats, both at once: the interactive prefill's step holds no line chunk
    s = settings(max_num_seqs=2, **spare)
    steps.clear()

    async def together() -> None:
        rf = s.roofline()
        assert rf is not None
        e = Recorded(s, rf, OUTPUT_ID)
        rs = [e.submit(list(range(i * 1000, i * 1000 + 200)), 4, request_id=f"r{p}",
                       priority=p) for i, p in ((1, 1), (5, 0))]
        await asyncio.gather(*(r.done for r in rs))

    loop = VirtualLoop()
    loop.run_until_complete(together())
    loop.close()
    assert steps[0] == [(0, 200, True)]
    assert steps[1] == [(0, 1, False), (1, 32, True)]
