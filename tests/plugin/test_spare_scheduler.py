"""The plugin's scheduler under ``--scheduling-policy priority`` in a real vLLM CPU
server: requests of priority 1 (the edge gives the batch's lines that) run on spare
capacity (tokengate_vllm.scheduler, rules 1-3).

The server (``spare_vllm``, tests/fixtures_vllm.py) has three seats and steps paced
while a test holds its file (tests/paced_scheduler.py: each step at least 5 ms), so a
long request is still running when the test sends the next one, however fast the
machine. What each paced step scheduled is written by that wrapper
(``SPARE_STEPS_FILE``); who was preempted and who ended first come from the engine
records.
"""

from __future__ import annotations

import json
import random
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from tests.conftest import MODEL
from tests.fixtures_vllm import SPARE_PACE_FILE, SPARE_STEPS_FILE, VllmServer
from tests.plugin.test_vllm_plugin import EXACT, settle, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LINE, INTERACTIVE = 1, 0   # vLLM priorities: edge.admission.priorities' low and normal


@pytest.fixture
def spare(spare_vllm: VllmServer) -> VllmServer:
    spare_vllm.wait_idle()
    return spare_vllm


@contextmanager
def paced() -> Iterator[None]:
    SPARE_PACE_FILE.touch()
    try:
        yield
    finally:
        SPARE_PACE_FILE.unlink(missing_ok=True)


def prompt(n: int, rng: random.Random) -> list[int]:
    """``n`` token ids no other prompt of the run shares a block with (no prefix hit)."""
    return [rng.randrange(1000, 100_000) for _ in range(n)]


class Stream:
    """A completions stream of ``ids`` at ``priority`` on its own thread; ``started``
    is set at its first token, and it stops reading when ``leave`` is set."""

    def __init__(self, v: VllmServer, pool: ThreadPoolExecutor, ids: list[int],
                 priority: int, max_tokens: int) -> None:
        self.request_id = uuid.uuid4().hex
        self.started, self.leave = threading.Event(), threading.Event()
        self.future = pool.submit(self._run, v, ids, priority, max_tokens)

    def _run(self, v: VllmServer, ids: list[int], priority: int, max_tokens: int) -> None:
        s = v.client(timeout=300).completions.create(
            model=MODEL, prompt=ids, max_tokens=max_tokens, stream=True,
            extra_headers={"X-Request-Id": self.request_id},
            extra_body={**EXACT, "priority": priority})
        for chunk in s:
            if chunk.choices and chunk.choices[0].text:
                self.started.set()
            if self.leave.is_set():
                break
        s.close()


def key(request_id: str) -> str:
    """The engine record's key of a completions request of one prompt (vLLM's request
    id: ``cmpl-<X-Request-Id>-<prompt index>``)."""
    return f"cmpl-{request_id}-0#0"


def test_an_interactive_request_takes_the_seat_of_the_latest_line(spare: VllmServer):
    """Three lines fill the three seats; an interactive request preempts the latest
    one (vLLM's priority policy would let it wait for a seat to free) and ends while
    all three still run; the preempted line then runs to its end."""
    v, rng = spare, random.Random(1)
    offset = v.size()
    with paced(), ThreadPoolExecutor(3) as pool:
        lines = []
        for _ in range(3):
            lines.append(Stream(v, pool, prompt(20, rng), LINE, 400))
            assert lines[-1].started.wait(120)
        inter_id = uuid.uuid4().hex
        v.client(timeout=300).completions.create(
            model=MODEL, prompt=prompt(20, rng), max_tokens=4,
            extra_headers={"X-Request-Id": inter_id},
            extra_body={**EXACT, "priority": INTERACTIVE})
        assert not any(line.future.done() for line in lines)
        for line in lines:
            line.future.result()
    keys = {key(inter_id)} | {key(line.request_id) for line in lines}
    records, _after = settle(v, offset, keys)
    rec = {r.key: r for r in records}
    assert [rec[key(line.request_id)].num_preemptions for line in lines] == [0, 0, 1]
    assert rec[key(inter_id)].num_preemptions == 0
    assert all(rec[key(line.request_id)].num_generation_tokens == 400 for line in lines)
    assert rec[key(inter_id)].ts < min(rec[key(line.request_id)].ts for line in lines)


def test_a_lines_prefill_goes_in_small_chunks_never_beside_an_interactive_prefill(
        spare: VllmServer):
    """An interactive stream decodes; a line of 3,000 prompt tokens comes and is
    prefilled at most 32 tokens a step (vLLM alone computes it in one step); an
    interactive request of 490 prompt tokens comes meanwhile and is prefilled in a step
    that holds no chunk of the line (the stream's decode beside it), while the line's
    prefill goes on after it."""
    v, rng = spare, random.Random(2)
    SPARE_STEPS_FILE.unlink(missing_ok=True)
    with paced(), ThreadPoolExecutor(2) as pool:
        stream = Stream(v, pool, prompt(8, rng), INTERACTIVE, 5000)
        assert stream.started.wait(120)
        line = Stream(v, pool, prompt(3000, rng), LINE, 4)
        wait_for(lambda: v.metrics()["vllm:num_requests_running"] == 2, "the line running")
        inter_id = uuid.uuid4().hex
        v.client(timeout=300).completions.create(
            model=MODEL, prompt=prompt(490, rng), max_tokens=4,
            extra_headers={"X-Request-Id": inter_id},
            extra_body={**EXACT, "priority": INTERACTIVE})
        line.future.result()
        stream.leave.set()
        stream.future.result()
    steps = [json.loads(x) for x in SPARE_STEPS_FILE.read_text().splitlines()]

    def tokens(request_id: str) -> list[int]:
        """What each step scheduled of the request (0: nothing)."""
        mine = f"cmpl-{request_id}-0"
        return [next((n for rid, n in st.items() if rid.startswith(mine)), 0)
                for st in steps]

    line_steps, inter_steps = tokens(line.request_id), tokens(inter_id)
    prefill = [n for n in line_steps if n > 1]
    assert sum(prefill) == 3000 and max(prefill) <= 32
    at = inter_steps.index(490)          # the interactive prompt in one step
    assert line_steps[at] == 0           # and no chunk of the line in it
    first, last = (line_steps.index(n) for n in (prefill[0], prefill[-1]))
    assert first < at < last             # the line's prefill was under way, went on
