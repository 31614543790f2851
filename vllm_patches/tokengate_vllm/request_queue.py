"""``TokenWeightedRequestQueue``: vLLM's waiting queue, lightest request first, with aging.

A drop-in ``RequestQueue`` (vllm/v1/core/sched/request_queue.py, all ten methods) for
the scheduler's ``self.waiting``. Order of ``peek_request``/``pop_request``:

1. requests put back at the front (``prepend_request``/``prepend_requests``: a
   preempted request, requests the scheduling pass skipped), in the order vLLM's
   ``FCFSRequestQueue`` (a deque) gives them: they already were at the head once, and
   a preempted request loses the work it had done each time it waits again;
2. requests that have waited ``max_wait_s`` or more, oldest first (aging);
3. all others by weight = ``num_prompt_tokens + output_weight * max_tokens`` (tokens),
   lightest first, ties by arrival.

The aging bound: a request can be overtaken by a later arrival only during its first
``max_wait_s`` in the queue; after that only requests that arrived before it (and the
put-back ones of rule 1) go first, so nothing starves however many light requests
keep arriving. ``max_wait_s = 0`` is first come, first served. Waiting time is
measured on a monotonic clock from ``add_request``.

Weight uses what the engine knows when the request arrives: its prompt length and its
``max_tokens`` (vLLM sets it to ``max_model_len - prompt`` when the client gave none);
the default 0.7 is the seed's exchange rate of an output token against a prompt token.

Costs: add and pop O(log n); ``remove_request(s)`` O(k) by marking (removed entries are
dropped when they reach a head, and the heap is rebuilt when they outnumber the live
ones); ``__iter__`` O(n log n).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.request_queue import RequestQueue

from tokengate_vllm.settings import DEFAULT_MAX_WAIT_S, DEFAULT_OUTPUT_WEIGHT

Request = Any  # vllm.v1.request.Request: num_prompt_tokens, max_tokens, identity hash


def request_weight(request: Request, output_weight: float = DEFAULT_OUTPUT_WEIGHT) -> float:
    """``num_prompt_tokens + output_weight * max_tokens`` of a vLLM ``Request``
    (vllm/v1/request.py), in prompt-token units."""
    return float(request.num_prompt_tokens) + output_weight * float(request.max_tokens)


@dataclass(slots=True, eq=False)
class _Entry:
    weight: float
    seq: int
    enqueued: float  # monotonic seconds at add_request
    request: Request = field(repr=False)
    live: bool = True


class TokenWeightedRequestQueue(RequestQueue):
    """See the module docstring. ``output_weight``: weight of one ``max_tokens`` token
    against one prompt token (>= 0); ``max_wait_s``: aging bound, seconds (>= 0);
    ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, output_weight: float = DEFAULT_OUTPUT_WEIGHT,
                 max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if output_weight < 0 or max_wait_s < 0:
            raise ValueError("output_weight and max_wait_s must be >= 0")
        self.output_weight = output_weight
        self.max_wait_s = max_wait_s
        self.clock = clock
        self._front: deque[Request] = deque()
        self._heap: list[tuple[float, int, _Entry]] = []  # (weight, seq, entry)
        self._fifo: deque[_Entry] = deque()               # by seq: arrival order
        self._entries: dict[Request, _Entry] = {}         # live entries by request
        self._seq = itertools.count()

    # -- the RequestQueue interface -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request by its weight; its wait starts now."""
        if request in self._entries:
            raise ValueError(f"request {request.request_id} is already queued")
        e = _Entry(request_weight(request, self.output_weight), next(self._seq),
                   self.clock(), request)
        self._entries[request] = e
        heapq.heappush(self._heap, (e.weight, e.seq, e))
        self._fifo.append(e)

    def pop_request(self) -> Request:
        """Remove and return the next request (see the module docstring); raises
        ``IndexError`` when empty."""
        if self._front:
            return self._front.popleft()
        e = self._head()
        self._drop(e)
        return e.request

    def peek_request(self) -> Request:
        """The request ``pop_request`` would return; raises ``IndexError`` when empty."""
        if self._front:
            return self._front[0]
        return self._head().request

    def prepend_request(self, request: Request) -> None:
        """Put a request before every other (a preempted one)."""
        self._front.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put requests before every other, as ``deque.extendleft`` does (the last of
        ``requests`` first): the order ``FCFSRequestQueue.prepend_requests`` gives."""
        self._front.extendleft(requests)

    def remove_request(self, request: Request) -> None:
        """Remove one request; raises ``ValueError`` when it is not queued."""
        if not self._remove(request):
            raise ValueError(f"request {getattr(request, 'request_id', request)} is not "
                             "in the queue")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Remove every one of ``requests`` that is queued (others are ignored, as
        ``FCFSRequestQueue.remove_requests`` does)."""
        for r in requests:
            self._remove(r)

    def __bool__(self) -> bool:
        return bool(self._front) or bool(self._entries)

    def __len__(self) -> int:
        return len(self._front) + len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """The requests in the order ``pop_request`` would return them now, if no time
        passed and nothing were added."""
        yield from list(self._front)
        now = self.clock()
        overdue = [e for e in self._fifo if e.live and now - e.enqueued >= self.max_wait_s]
        yield from (e.request for e in overdue)
        rest = sorted((e for e in self._entries.values()
                       if not now - e.enqueued >= self.max_wait_s),
                      key=lambda e: (e.weight, e.seq))
        yield from (e.request for e in rest)

    # -- internals -----------------------------------------------------------------

    def _head(self) -> _Entry:
        """The next entry after the front: the oldest if it is overdue, else the lightest."""
        while self._fifo and not self._fifo[0].live:
            self._fifo.popleft()
        if not self._fifo:
            raise IndexError("peek from an empty queue")
        oldest = self._fifo[0]
        if self.clock() - oldest.enqueued >= self.max_wait_s:
            return oldest
        while not self._heap[0][2].live:
            heapq.heappop(self._heap)
        return self._heap[0][2]

    def _drop(self, e: _Entry) -> None:
        e.live = False
        del self._entries[e.request]
        # Dead entries leave the heap and the fifo when they reach a head; rebuild when
        # they outnumber the live ones, so removals cannot grow memory without bound.
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [t for t in self._heap if t[2].live]
            heapq.heapify(self._heap)
            self._fifo = deque(e for e in self._fifo if e.live)

    def _remove(self, request: Request) -> bool:
        e = self._entries.get(request)
        if e is not None:
            self._drop(e)
            return True
        try:
            self._front.remove(request)
        except ValueError:
            return False
        return True
