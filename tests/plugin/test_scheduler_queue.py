"""The token-weighted waiting queue (tokengate_vllm.request_queue) on known vLLM requests:
its order, its aging bound, and every RequestQueue method against vLLM's own queue."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest
from tokengate_vllm import settings

from tests.conftest import VLLM_IN_PROCESS

if TYPE_CHECKING:
    from vllm.v1.core.sched.request_queue import RequestQueue
    from vllm.v1.request import Request

# pure: starts no process of the stack (make test-unit)
pytestmark = [pytest.mark.unit, VLLM_IN_PROCESS]


@pytest.fixture(scope="module")
def v() -> SimpleNamespace:
    """vLLM's classes and the plugin's queue, imported by the first test that asks, not
    at collection: every pytest-xdist worker collects every module, and importing vLLM
    (torch with it) costs about 5 s of CPU."""
    from tokengate_vllm import request_queue, scheduler
    from vllm.v1.core.sched import async_scheduler
    from vllm.v1.core.sched import request_queue as vllm_queue
    from vllm.v1.core.sched import scheduler as vllm_scheduler

    return SimpleNamespace(
        TokenWeightedRequestQueue=request_queue.TokenWeightedRequestQueue,
        request_weight=request_queue.request_weight, base_scheduler=scheduler.base_scheduler,
        scheduler_class=scheduler.scheduler_class, AsyncScheduler=async_scheduler.AsyncScheduler,
        FCFSRequestQueue=vllm_queue.FCFSRequestQueue, RequestQueue=vllm_queue.RequestQueue,
        Scheduler=vllm_scheduler.Scheduler)


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=[7] * prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens), pooling_params=None)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def drain(q: RequestQueue) -> list[str]:
    out = []
    while q:
        assert q.peek_request() is q.peek_request()
        peeked = q.peek_request()
        got = q.pop_request()
        assert got is peeked
        out.append(got.request_id)
    return out


def test_weight_is_prompt_plus_0_7_max_tokens(v: SimpleNamespace):
    assert v.request_weight(req("a", 1000, 100)) == pytest.approx(1070.0)
    assert v.request_weight(req("a", 10, 500)) == pytest.approx(360.0)
    assert v.request_weight(req("a", 10, 500), output_weight=0.0) == 10.0


def test_a_burst_is_served_lightest_first_ties_in_arrival_order(v: SimpleNamespace):
    q = v.TokenWeightedRequestQueue(clock=Clock())
    for r in [req("long-prompt", 1000, 100),    # 1070
              req("long-output", 10, 500),      # 360
              req("short", 10, 10),             # 17
              req("mid-1", 100, 100),           # 170
              req("mid-2", 100, 100)]:          # 170, arrived after mid-1
        q.add_request(r)
    assert [r.request_id for r in q] == ["short", "mid-1", "mid-2", "long-output", "long-prompt"]
    assert len(q) == 5
    assert drain(q) == ["short", "mid-1", "mid-2", "long-output", "long-prompt"]
    assert not q and len(q) == 0


def test_an_overdue_request_goes_before_lighter_ones_that_keep_arriving(v: SimpleNamespace):
    clock = Clock()
    q = v.TokenWeightedRequestQueue(max_wait_s=5.0, clock=clock)
    q.add_request(req("heavy", 4000, 1000))
    served = []
    for i in range(10):          # one light arrival and one pop per second
        q.add_request(req(f"light-{i}", 5, 5))
        served.append(q.pop_request().request_id)
        clock.t += 1.0
    # Waited 0..4 s: overtaken by every light one; at 5 s it is overdue and goes next.
    assert served[:5] == [f"light-{i}" for i in range(5)]
    assert served[5] == "heavy"
    assert served[6:] == [f"light-{i}" for i in range(5, 9)]


def test_overdue_requests_go_oldest_first_then_the_rest_by_weight(v: SimpleNamespace):
    clock = Clock()
    q = v.TokenWeightedRequestQueue(max_wait_s=2.0, clock=clock)
    q.add_request(req("old-heavy", 3000, 10))
    clock.t += 0.5
    q.add_request(req("old-light", 20, 10))
    clock.t += 0.5
    q.add_request(req("new-heavy", 2000, 10))
    q.add_request(req("new-light", 1, 1))
    clock.t += 1.2  # old-heavy waited 2.2 s, old-light 1.7 s, the new ones 1.2 s
    assert [r.request_id for r in q] == ["old-heavy", "new-light", "old-light", "new-heavy"]
    assert q.pop_request().request_id == "old-heavy"
    clock.t += 0.4  # old-light now waited 2.1 s: overdue, before new-light
    assert [r.request_id for r in q] == ["old-light", "new-light", "new-heavy"]
    assert drain(q) == ["old-light", "new-light", "new-heavy"]


@pytest.mark.parametrize("seed", range(5))
def test_no_request_is_overtaken_by_a_later_arrival_after_waiting_the_bound(v: SimpleNamespace, seed: int):
    """Random open-loop arrivals, one pop per tick: whenever a request is served, every
    request still waiting that arrived earlier has waited less than the bound (else it
    would have been served first), so nothing is passed over once it waited max_wait_s."""
    rng = random.Random(seed)
    clock = Clock()
    bound = 3.0
    q = v.TokenWeightedRequestQueue(max_wait_s=bound, clock=clock)
    arrived: dict[str, float] = {}
    waits = []
    for tick in range(400):
        for _ in range(rng.choice([0, 1, 1, 2])):   # load > 1 per tick at times: a queue
            rid = f"r{len(arrived)}"
            q.add_request(req(rid, rng.randint(1, 3000), rng.randint(1, 1000)))
            arrived[rid] = clock.t
        if q:
            got = q.pop_request().request_id
            older_waiting = [r.request_id for r in q if arrived[r.request_id] < arrived[got]]
            for rid in older_waiting:
                assert clock.t - arrived[rid] < bound, (got, rid)
            waits.append(clock.t - arrived[got])
        clock.t += 0.25
    assert max(waits) >= bound  # the bound was reached, so the check above was exercised


def test_max_wait_zero_is_first_come_first_served(v: SimpleNamespace):
    clock = Clock()
    ours, fcfs = v.TokenWeightedRequestQueue(max_wait_s=0.0, clock=clock), v.FCFSRequestQueue()
    rng = random.Random(1)
    for i in range(30):
        r = req(f"r{i}", rng.randint(1, 500), rng.randint(1, 500))
        ours.add_request(r)
        fcfs.add_request(r)
    assert drain(ours) == drain(fcfs)


def test_prepend_puts_requests_before_everything_in_fcfs_order(v: SimpleNamespace):
    """prepend_request / prepend_requests behave as vLLM's v.FCFSRequestQueue (a deque):
    the scheduler puts preempted and skipped requests back with them."""
    clock = Clock()
    ours, fcfs = v.TokenWeightedRequestQueue(clock=clock), v.FCFSRequestQueue()
    light, heavy = req("light", 1, 1), req("heavy", 5000, 5000)
    preempted = req("preempted", 4000, 100)
    skipped = [req("skipped-a", 900, 9), req("skipped-b", 800, 8)]
    for q in (ours, fcfs):
        q.add_request(heavy)
        q.add_request(light)
        q.prepend_request(preempted)
        q.prepend_requests(skipped)
    assert [r.request_id for r in ours][:3] == [r.request_id for r in fcfs][:3] == \
        ["skipped-b", "skipped-a", "preempted"]
    assert drain(ours) == ["skipped-b", "skipped-a", "preempted", "light", "heavy"]


def test_remove_request_and_remove_requests(v: SimpleNamespace):
    q = v.TokenWeightedRequestQueue(clock=Clock())
    rs = [req(f"r{i}", 10 * (i + 1), 1) for i in range(6)]
    for r in rs:
        q.add_request(r)
    front = req("front", 99999, 1)
    q.prepend_request(front)
    q.remove_request(rs[0])             # the lightest: the head
    q.remove_request(front)             # from the front
    q.remove_requests([rs[2], rs[4], req("never-queued", 1, 1)])  # unknown ones ignored
    assert len(q) == 3
    assert [r.request_id for r in q] == ["r1", "r3", "r5"]
    with pytest.raises(ValueError):
        q.remove_request(rs[0])
    assert drain(q) == ["r1", "r3", "r5"]


def test_an_empty_queue_raises_index_error_like_vllms(v: SimpleNamespace):
    q = v.TokenWeightedRequestQueue()
    assert not q and len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(IndexError):
        q.pop_request()
    r = req("a", 1, 1)
    q.add_request(r)
    q.remove_request(r)
    with pytest.raises(IndexError):
        q.pop_request()


def test_adding_a_queued_request_twice_is_refused(v: SimpleNamespace):
    q = v.TokenWeightedRequestQueue()
    r = req("a", 1, 1)
    q.add_request(r)
    with pytest.raises(ValueError):
        q.add_request(r)


def test_removals_do_not_grow_the_heap_without_bound(v: SimpleNamespace):
    q = v.TokenWeightedRequestQueue(clock=Clock())
    keep = req("keep", 1, 1)
    q.add_request(keep)
    for i in range(5000):
        r = req(f"r{i}", 100, 100)
        q.add_request(r)
        q.remove_request(r)
    assert len(q) == 1
    assert len(q._heap) <= 2 * len(q) + 65 and len(q._fifo) <= 2 * len(q) + 65
    assert q.pop_request() is keep


def test_every_abstract_method_of_request_queue_is_implemented(v: SimpleNamespace):
    abstract = set(v.RequestQueue.__abstractmethods__)
    assert len(abstract) == 10
    v.TokenWeightedRequestQueue()  # instantiable: none left abstract


def test_the_factory_extends_async_scheduler_when_async_scheduling_is_on(v: SimpleNamespace):
    on = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))
    off = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False))
    assert v.base_scheduler(on) is v.AsyncScheduler
    assert v.base_scheduler(off) is v.Scheduler
    gpu, cpu = v.scheduler_class(v.AsyncScheduler), v.scheduler_class(v.Scheduler)
    assert issubclass(gpu, v.AsyncScheduler) and gpu.__name__ == "TokenWeightedAsyncScheduler"
    assert issubclass(cpu, v.Scheduler) and not issubclass(cpu, v.AsyncScheduler)
    assert v.scheduler_class(v.Scheduler) is cpu


def test_scheduler_settings_from_the_environment():
    s = settings.SchedulerSettings.from_env({})
    assert (s.policy, s.output_weight, s.max_wait_s) == ("weighted", 0.7, 10.0)
    s = settings.SchedulerSettings.from_env({"TOKENGATE_SCHED_POLICY": "FCFS",
                                             "TOKENGATE_SCHED_OUTPUT_WEIGHT": "1.5",
                                             "TOKENGATE_SCHED_MAX_WAIT_S": "0"})
    assert (s.policy, s.output_weight, s.max_wait_s) == ("fcfs", 1.5, 0.0)
    assert (s.spare_priority, s.spare_chunk) == (1, 32)
    s = settings.SchedulerSettings.from_env({"TOKENGATE_SCHED_SPARE_PRIORITY": "2",
                                             "TOKENGATE_SCHED_SPARE_CHUNK": " 64 "})
    assert (s.spare_priority, s.spare_chunk) == (2, 64)
    for env in ({"TOKENGATE_SCHED_POLICY": "sjf"}, {"TOKENGATE_SCHED_MAX_WAIT_S": "-1"},
                {"TOKENGATE_SCHED_OUTPUT_WEIGHT": "nan"}, {"TOKENGATE_SCHED_MAX_WAIT_S": "ten"},
                {"TOKENGATE_SCHED_SPARE_PRIORITY": "0"}, {"TOKENGATE_SCHED_SPARE_CHUNK": "-1"},
                {"TOKENGATE_SCHED_SPARE_CHUNK": "1.5"}):
        with pytest.raises(ValueError, match=next(iter(env))):
            settings.SchedulerSettings.from_env(env)
