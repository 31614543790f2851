"""The simulated replica's GPU timing (``tokenstorm sim-replica --gpu``): the roofline
against published vLLM measurements, and the engine stepping as vLLM's V1 scheduler
(token budget, chunked prefill, decodes first, preemption when the KV cache is short,
prefix hits computed). Steps and their roofline cost are counted, never timed."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokengate import config as tg_config
from tokenstorm.upstream import roofline
from tokenstorm.upstream.sim import SimReplica
from tokenstorm.upstream.sim_engine import engine_records
from tokenstorm.upstream.sim_settings import SimSettings
from tokenstorm.upstream.sim_steps import SteppedEngine

from tests.conftest import MODEL

OUTPUT_ID = 5


def test_roofline_is_within_20_percent_of_each_published_vllm_measurement() -> None:
    for p, pred, err in roofline.check():
        assert abs(err) <= 0.20, (p, pred)


def test_shapes_read_from_config_json_count_the_weights_of_an_8b_model() -> None:
    s = roofline.ModelShape.named("qwen3-8b")
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim) == (36, 4096, 32, 8, 128)
    assert 8.1e9 < s.weight_bytes / 2 < 8.3e9   # Qwen3-8B: 8.2 B parameters
    assert s.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2
    with pytest.raises(ValueError, match="shipped: llama-3-8b, qwen3-14b, qwen3-8b"):
        roofline.ModelShape.named("no-such-model")


def test_a_decode_step_is_bound_by_weights_and_a_long_prefill_by_flops() -> None:
    r = roofline.Roofline(roofline.ModelShape.named("qwen3-8b"), roofline.GPUS["h100"], 0.0)
    m = r.shape
    one = r.step_s([(1, 100, 1)])
    # the matrices and the LM head, read once; the embeddings only row by row
    read = (m.linear_params + m.vocab * m.hidden) * m.dtype_bytes
    assert one == pytest.approx(read / 3.0e12, rel=0.01)
    big = r.step_s([(8192, 0, 1)])
    flops = 2 * m.linear_params * 8192 + 4 * m.layers * m.heads * m.head_dim * 8192 * 8193 / 2
    assert big == pytest.approx(flops / 790e12, rel=0.01)


def run(s: SimSettings, jobs: list[tuple[list[int], int]],
        gap_steps: int = 0) -> tuple[SteppedEngine, list[Any], list[int]]:
    """Submit ``jobs`` (prompt ids, max_tokens) to a stepped engine and wait for all;
    returns the engine, the requests and the step count at each first token."""
    first_steps: list[int] = []

    async def main() -> tuple[SteppedEngine, list[Any]]:
        rf = s.roofline()
        assert rf is not None
        e = SteppedEngine(s, rf, OUTPUT_ID, on_ttft=lambda _t: first_steps.append(e.steps))
        rs = [e.submit(ids, n) for ids, n in jobs]
        await asyncio.gather(*(r.done for r in rs))
        return e, rs

    e, rs = asyncio.run(main())
    return e, rs, first_steps


def settings(**kw: Any) -> SimSettings:
    base: dict[str, Any] = {"gpu": "h100", "model_config": "llama-3-8b",
                            "num_gpu_blocks": 0, "max_model_len": 4096}
    return SimSettings(**{**base, **kw}).sized()


def test_a_batch_arriving_at_once_is_one_prefill_step_then_one_step_a_token() -> None:
    s = settings()
    e, rs, firsts = run(s, [(list(range(i * 100, i * 100 + 32)), 128) for i in range(8)])
    assert e.steps == 128
    assert firsts == [1] * 8
    pub = next(p for p in roofline.PUBLISHED if p.what == "e2e_ms" and p.gpu == "h100")
    assert e.busy_s * 1000 == pytest.approx(roofline.predict(pub), rel=1e-9)
    assert all(r.generated == 128 and r.finish_reason == "length" for r in rs)


def test_a_prompt_longer_than_the_token_budget_is_prefilled_in_chunks() -> None:
    s = settings(max_num_batched_tokens=256)
    e, _rs, firsts = run(s, [(list(range(1000)), 3)])
    assert firsts == [4]        # 256 + 256 + 256 + 232 tokens
    assert e.steps == 6


def test_each_step_reports_how_late_the_host_ran_it() -> None:
    """on_late: one lateness per step (s, never below 0): the chunked prompt's 4
    prefill steps and its 2 decodes."""
    s = settings(max_num_batched_tokens=256)
    lates: list[float] = []

    async def main() -> SteppedEngine:
        rf = s.roofline()
        assert rf is not None
        e = SteppedEngine(s, rf, OUTPUT_ID, on_late=lates.append)
        await e.submit(list(range(1000)), 3).done
        return e

    e = asyncio.run(main())
    assert e.steps == 6
    assert len(lates) == 6 and min(lates) >= 0


def test_running_decodes_go_first_and_a_new_prefill_takes_the_budget_left() -> None:
    s = settings(max_num_batched_tokens=256)
    _e, rs, firsts = run(s, [(list(range(10)), 40), (list(range(1000, 1600)), 2)])
    # step 1: 10 + 246 tokens of the second; then 1 decode + 255, then 1 + 99
    assert firsts == [1, 3]
    assert rs[1].computed == 601


def test_a_short_kv_cache_preempts_the_last_admitted_and_everything_still_finishes() -> None:
    s = settings(model_config="qwen3-8b", num_gpu_blocks=200, max_model_len=2048)
    e, rs, _ = run(s, [(list(range(i * 5000, i * 5000 + 1000)), 500) for i in range(6)])
    assert e.preemptions > 0
    assert sum(r.num_preemptions for r in rs) == e.preemptions
    assert rs[0].num_preemptions == 0   # the first admitted is never the victim
    assert all(r.generated == 500 for r in rs)
    assert e.pool.num_free == 199 and not e.running


def test_a_request_arriving_while_the_loop_is_late_waits_for_the_next_step() -> None:
    """The loop is blocked past the end of the step it planned: the steps run on at
    their planned times, and the request that came during the block is not put into a
    step that began before it arrived (its queue time and prefill are both >= 0)."""
    s = settings()
    got: list[Any] = []

    async def main() -> None:
        rf = s.roofline()
        assert rf is not None
        e = SteppedEngine(s, rf, OUTPUT_ID)
        a = e.submit(list(range(64)), 8)
        loop = asyncio.get_running_loop()

        def late() -> None:
            time.sleep(0.03)   # the loop falls behind several of a's steps
            got.append(e.submit(list(range(1000, 1064)), 2))

        loop.call_soon(late)
        await a.done
        await got[0].done

    asyncio.run(main())
    [b] = got
    assert b.scheduled_at is not None and b.scheduled_at >= b.arrival
    assert b.first_token_at > b.scheduled_at
    rec = engine_records(b, "m", b.last_token_at)[0]
    assert rec["queued_ms"] is not None and rec["prefill_ms"] is not None


def test_a_repeated_prompt_computes_only_what_the_prefix_cache_misses() -> None:
    s = settings(max_num_batched_tokens=8192)
    prompt = list(range(1000))

    async def main() -> list[Any]:
        rf = s.roofline()
        assert rf is not None
        e = SteppedEngine(s, rf, OUTPUT_ID)
        a = e.submit(prompt, 2)
        await a.done
        b = e.submit(prompt, 2)
        await b.done
        return [a, b]

    a, b = asyncio.run(main())
    assert (a.cached_tokens, b.cached_tokens) == (0, 992)   # 62 full blocks of 16


def test_a_gpu_replica_serves_over_http_with_vllms_usage(cfg: tg_config.Config) -> None:
    m = cfg.models[MODEL]
    s = SimSettings(model=m.name, model_dir=Path(m.dir), max_model_len=2048,
                    gpu="h100", model_config="qwen3-8b", num_gpu_blocks=0).sized()
    assert s.num_gpu_blocks == roofline.Roofline(
        roofline.ModelShape.named("qwen3-8b"), roofline.GPUS["h100"]).kv_blocks(16) + 1
    with SimReplica(s) as rep:
        body = {"model": m.name, "prompt": list(range(100, 700)), "max_tokens": 5}
        usages = [httpx.post(rep.url + "/completions", json=body, timeout=30).json()["usage"]
                  for _ in range(2)]
    assert [u["completion_tokens"] for u in usages] == [5, 5]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 592]


def test_bad_gpu_timing_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        SimSettings(gpu="h100", max_num_batched_tokens=0).check()
    with pytest.raises(ValueError, match="--model-config 'nope'"):
        SimSettings(gpu="h100", model_config="nope").check()


def test_capacity_counts_the_largest_decode_batch_within_the_tpot_target() -> None:
    r = roofline.Roofline(roofline.ModelShape.named("qwen3-8b"), roofline.GPUS["h100"])
    b = roofline.decode_batch(r, 1000, 0.010, kv_tokens=10**9)
    assert r.step_s([(1, 1000, 1)] * b) <= 0.010 < r.step_s([(1, 1000, 1)] * (b + 1))
    assert roofline.decode_batch(r, 1000, 0.001) == 0   # below the weights' read alone
    n, per = roofline.replicas_needed(r, 50, 720, 0, 1200, 0.05, 0.8)
    assert n == math.ceil(50 / (per * 0.8))
    assert per == pytest.approx(1 / roofline.request_s(r, 720, 0, 1200, 0.05))


def test_tokenstorm_capacity_answers_for_the_design_mix_and_refuses_a_bad_target() -> None:
    base = [sys.executable, "-m", "tokenstorm.cli", "capacity", "--prompt", "720",
            "--output", "1200", "--rate", "50"]
    out = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    r = roofline.Roofline(roofline.ModelShape.named("qwen3-8b"), roofline.GPUS["h100"])
    n, per = roofline.replicas_needed(r, 50, 720, 0, 1200, 0.05)
    assert out.startswith(f"qwen3-8b on one h100: {per:.2f} requests/s of 720 prompt")
    assert out.endswith(f": {n} replicas\n")
    bad = subprocess.run([*base, "--tpot-ms", "1"], capture_output=True, text=True,
                         check=False)
    assert bad.returncode == 1
    assert "no batch of qwen3-8b on h100 decodes within 1 ms a token" in bad.stderr
