"""vLLM 0.32's priority scheduling (``--scheduling-policy priority``) for a simulated
replica: the waiting queue and the preemption victim.

From ``vllm/v1/core/sched/request_queue.py`` and ``scheduler.py``:

- the waiting requests are a heap (``PriorityRequestQueue``) ordered as
  ``Request.__lt__`` orders them: the lower ``priority`` first (the request body's
  ``priority``, 0 by default), then the earlier ``arrival_time``, then the request id;
  a preempted request goes back into the heap at its own place (``prepend_request`` is
  ``add_request`` under this policy), not to the head as under ``fcfs``;
- a waiting request never preempts a running one: admission still stops at the first
  request that finds no seat (``--max-num-seqs``) or no KV blocks;
- when a running request's new tokens find no free KV blocks, the victim is
  ``max(running, key=(priority, arrival_time))``, the lowest priority and latest
  arrival (under ``fcfs``: the last admitted), wherever it stands in the running list;
  a victim already scheduled in this step gives its tokens back to the step's budget.

Under ``fcfs`` vLLM 0.32 reads a request's ``priority`` and then ignores it (nothing in
its server or engine refuses a non-zero one, whatever the field's description says).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Prioritized(Protocol):
    """What the queue reads of a request: its ``priority``, its ``arrival`` (the engine's
    clock, s) and its ``request_id``."""

    priority: int
    arrival: float
    request_id: str


R = TypeVar("R", bound=Prioritized)


class PriorityWaiting(Generic[R]):
    """vLLM's ``PriorityRequestQueue`` with the ``deque`` methods the simulated engines
    call on their waiting queue: ``append`` and ``appendleft`` (both ``add_request``),
    ``popleft`` (``pop_request``), ``[0]`` (``peek_request``), ``remove``
    (ValueError when absent), ``len``, iteration in order. Ties beyond vLLM's order
    (same priority, arrival and id) go in insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, int, R]] = []
        self._seq = 0

    def append(self, r: R) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (r.priority, r.arrival, r.request_id, self._seq, r))

    appendleft = append   # a preempted request: ordered as any other

    def popleft(self) -> R:
        return heapq.heappop(self._heap)[-1]

    def __getitem__(self, i: int) -> R:
        if i != 0 or not self._heap:
            raise IndexError("only the head of a priority queue can be read")
        return self._heap[0][-1]

    def remove(self, r: R) -> None:
        for k, entry in enumerate(self._heap):
            if entry[-1] is r:
                del self._heap[k]
                heapq.heapify(self._heap)
                return
        raise ValueError("not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[R]:
        return (e[-1] for e in sorted(self._heap))


def victim(running: list[R]) -> R:
    """The running request vLLM 0.32 preempts under ``--scheduling-policy priority``
    when KV blocks run out (``Scheduler.schedule``: ``max(self.running, key=lambda r:
    (r.priority, r.arrival_time))``, the first of equals)."""
    return max(running, key=lambda r: (r.priority, r.arrival))
