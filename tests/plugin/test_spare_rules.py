"""The plugin scheduler's spare rules (tokengate_vllm.scheduler, rules 1-3) in-process on
both of vLLM's schedulers: ``Scheduler`` and ``AsyncScheduler``, the default on GPUs,
which the vLLM CPU server of tests/plugin/test_spare_scheduler.py cannot run (the CPU
platform turns async scheduling off: vllm/platforms/cpu.py).

The model runner is a fake that answers each step as the engine core passes it back
(``EngineCore.step_with_batch_queue``, vllm/v1/engine/core.py): with async scheduling
the next step is scheduled before the last one's output arrives (a queue of two
steps), without it each step is answered before the next. A request samples a token in
a step that finishes its prompt or decodes (the scheduler's ``is_prefill_chunk`` after
``schedule``); ``ignore_eos`` makes every request run to its ``max_tokens``.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import MODEL_TOKENIZER, VLLM_IN_PROCESS

# pure: starts no process of the stack (make test-unit)
pytestmark = [pytest.mark.unit, VLLM_IN_PROCESS]

LINE, INTERACTIVE = 1, 0   # vLLM priorities: edge.admission.priorities' low and normal
BLOCK = 16


@pytest.fixture(scope="module")
def v() -> SimpleNamespace:
    """vLLM's classes, imported by the first test that asks (importing vLLM costs about
    5 s of CPU; tests/plugin/test_scheduler_queue.py)."""
    import torch
    from tokengate_vllm import scheduler
    from vllm import config
    from vllm.sampling_params import SamplingParams
    from vllm.v1 import kv_cache_interface as kv
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    return SimpleNamespace(
        float32=torch.float32, TokenWeightedScheduler=scheduler.TokenWeightedScheduler,
        CacheConfig=config.CacheConfig, ModelConfig=config.ModelConfig,
        SchedulerConfig=config.SchedulerConfig, VllmConfig=config.VllmConfig,
        SamplingParams=SamplingParams, AsyncScheduler=AsyncScheduler,
        FullAttentionSpec=kv.FullAttentionSpec, KVCacheConfig=kv.KVCacheConfig,
        KVCacheGroupSpec=kv.KVCacheGroupSpec, ModelRunnerOutput=ModelRunnerOutput,
        Request=Request, StructuredOutputManager=StructuredOutputManager)


class Engine:
    """vLLM's scheduler as the plugin builds it (``TokenWeightedScheduler``) under
    ``--scheduling-policy priority`` with ``seats`` (``--max-num-seqs``) and a step
    budget of ``budget`` tokens (``--max-num-batched-tokens``), stepped by the fake
    model runner (module docstring). ``steps``: what each step scheduled (request id ->
    tokens); ``preempted``: who each step preempted."""

    def __init__(self, v: SimpleNamespace, run_async: bool, seats: int = 3,
                 budget: int = 2048) -> None:
        self.v = v
        model = v.ModelConfig(model=str(MODEL_TOKENIZER.parent), skip_tokenizer_init=True,
                              max_model_len=4096, dtype="float32")
        sched = v.SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=budget,
                                  max_model_len=4096, enable_chunked_prefill=True,
                                  policy="priority", is_encoder_decoder=False)
        cache = v.CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
        cache.num_gpu_blocks = 1000
        config = v.VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
        config.scheduler_config.async_scheduling = run_async   # the CPU platform's False
        spec = v.FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8,
                                   dtype=v.float32)
        kv = v.KVCacheConfig(num_blocks=1000, kv_cache_tensors=[],
                             kv_cache_groups=[v.KVCacheGroupSpec(["layer"], spec)])
        self.s = v.TokenWeightedScheduler(
            vllm_config=config, kv_cache_config=kv, block_size=BLOCK,
            structured_output_manager=v.StructuredOutputManager(config))
        assert isinstance(self.s, v.AsyncScheduler) == run_async
        self.depth = 2 if run_async else 1
        self.in_flight: deque[tuple[Any, dict[str, bool]]] = deque()
        self.steps: list[dict[str, int]] = []
        self.preempted: list[set[str]] = []
        self.arrival = 1000.0

    def add(self, rid: str, prompt: int, max_tokens: int, priority: int) -> None:
        """A request of ``prompt`` distinct token ids (no prefix hit), arriving after
        every earlier one."""
        self.arrival += 1
        base = sum(ord(c) for c in rid) * 10_000
        self.s.add_request(self.v.Request(
            request_id=rid, prompt_token_ids=[base + i for i in range(prompt)],
            sampling_params=self.v.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None, arrival_time=self.arrival, priority=priority))

    def step(self) -> None:
        """One engine-core step: schedule one, answer the oldest once ``depth`` are in
        flight."""
        out = self.s.schedule()
        self.steps.append(dict(out.num_scheduled_tokens))
        self.preempted.append(set(out.preempted_req_ids or ()))
        samples = {r: not self.s.requests[r].is_prefill_chunk
                   for r in out.num_scheduled_tokens}
        self.in_flight.append((out, samples))
        while len(self.in_flight) >= self.depth:
            self.answer()

    def answer(self) -> None:
        out, samples = self.in_flight.popleft()
        ids = list(samples)
        self.s.update_from_output(out, self.v.ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[5] if samples[r] else [] for r in ids]))

    def run_until(self, done: Any, limit: int = 500) -> None:
        for _ in range(limit):
            if done():
                return
            self.step()
        raise AssertionError(f"not done in {limit} steps")

    def running(self) -> set[str]:
        return {r.request_id for r in self.s.running}

    def finished(self, rid: str) -> bool:
        return rid not in self.s.requests


@pytest.fixture(params=[False, True], ids=["Scheduler", "AsyncScheduler"])
def run_async(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def weighted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin on (its default policy), whatever the environment says."""
    monkeypatch.delenv("TOKENGATE_SCHED_POLICY", raising=False)


def test_a_waiting_interactive_request_preempts_the_latest_line_for_a_seat(
        v: SimpleNamespace, run_async: bool, weighted: None):
    e = Engine(v, run_async)
    for i in range(3):
        e.add(f"line-{i}", 64, 400, LINE)
    e.run_until(lambda: e.running() == {"line-0", "line-1", "line-2"}
                and not any(e.s.requests[r].is_prefill_chunk for r in e.running()))
    e.add("chat", 64, 8, INTERACTIVE)
    e.run_until(lambda: e.finished("chat"))
    assert set().union(*e.preempted) == {"line-2"}        # the latest line, only it
    assert {"line-0", "line-1"} <= e.running()
    e.run_until(lambda: not e.s.requests)                  # the line resumes and ends
    assert all(len(s) <= 3 for s in e.steps)


def test_without_the_plugin_the_interactive_request_waits_for_a_seat(
        v: SimpleNamespace, run_async: bool, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TOKENGATE_SCHED_POLICY", "fcfs")
    e = Engine(v, run_async)
    for i in range(3):
        e.add(f"line-{i}", 64, 40, LINE)
    e.run_until(lambda: e.running() == {"line-0", "line-1", "line-2"})
    e.add("chat", 64, 8, INTERACTIVE)
    e.run_until(lambda: e.finished("chat"))
    assert not set().union(*e.preempted)
    assert all(e.finished(f"line-{i}") for i in range(3))  # it ran after a line ended


def test_line_prefills_go_in_chunks_and_never_beside_an_interactive_prefill(
        v: SimpleNamespace, run_async: bool, weighted: None):
    e = Engine(v, run_async)
    e.add("talk", 16, 400, INTERACTIVE)    # decodes throughout: the line is never alone
    e.run_until(lambda: "talk" in e.running() and not e.s.requests["talk"].is_prefill_chunk)
    e.add("line", 3000, 4, LINE)
    e.run_until(lambda: sum(s.get("line", 0) for s in e.steps) >= 320)
    e.add("chat", 490, 4, INTERACTIVE)
    e.run_until(lambda: e.finished("chat"))
    e.run_until(lambda: e.finished("line"))
    chat = [s for s in e.steps if s.get("chat", 0) > 1]    # its prefill steps
    assert chat and sum(s["chat"] for s in chat) == 490
    assert not any("line" in s for s in chat)
    prefill = [s["line"] for s in e.steps if "line" in s][:-3]   # less the decodes
    assert sum(prefill) == 3000 and max(prefill) <= 32


def test_a_request_alone_takes_the_whole_step_budget_as_in_vllm(
        v: SimpleNamespace, run_async: bool, weighted: None):
    """vLLM's own exception to ``long_prefill_token_threshold`` (``Scheduler.schedule``:
    a request alone starves nobody) holds for lines too; an interactive request
    arriving then waits for at most that one step."""
    e = Engine(v, run_async)
    e.add("chat", 3000, 2, INTERACTIVE)
    e.run_until(lambda: e.finished("chat"))
    e.add("line", 3000, 2, LINE)
    e.run_until(lambda: e.finished("line"))
    assert [s.get("chat") or s.get("line") for s in e.steps if s] == [2048, 952, 1, 2048,
                                                                      952, 1]
