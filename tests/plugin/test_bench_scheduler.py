"""``make bench-scheduler`` without vLLM: the workload both policies get, the vLLM server
each policy runs, and the figures, ratios and table computed from recorded runs (the
bench itself starts vLLM twice and takes minutes: it is run by hand, not here)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from tokengate import config as tg_config
from tokengate_dev.bench import scheduler as sb
from tokengate_dev.bench import scheduler_figures as ef
from tokenstorm.report import Records
from tokenstorm.runner import plan_for, prompt_builder

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model(cfg: tg_config.Config) -> tg_config.ModelConfig:
    return cfg.models["tiny-qwen3"]


def test_both_policies_get_the_same_open_loop_streaming_mix(model: tg_config.ModelConfig):
    opts = sb.SchedBenchOptions()
    specs = sb.workload(opts, model)
    assert [s.name for s in specs] == ["long_tail", "burst"]
    for s in specs:
        assert s.url == "http://127.0.0.1:18950/v1" and s.keys == ()
        assert s.arrival is not None and (s.arrival.process, s.arrival.rate) == ("poisson", 2.5)
        assert s.stream.stream and s.stream.continuous_usage_stats and s.stream.ignore_eos
        assert s.profile == sb.PROFILES[s.name] and s.duration_s == 30.0
    builder = prompt_builder(model.dir, model.name, "chat", 0)
    lt, burst = (plan_for(s, builder) for s in specs)
    again = plan_for(sb.workload(opts, model)[0], builder)
    assert np.array_equal(lt.times, again.times) and np.array_equal(lt.inputs, again.inputs)
    for plan in (lt, burst):
        assert plan.times[-1] < 30.0
        # 0.03 x prompt, at most 200, and what the context leaves
        cap = np.minimum(200, model.max_model_len - plan.inputs)
        assert np.all(plan.outputs == np.minimum(np.rint(0.03 * plan.inputs), cap).clip(1))
    weight = sb.request_weight(lt.inputs, lt.outputs, 0.7)
    long = weight >= opts.long_weight
    assert 0.05 < long.mean() < 0.4     # p_tail 0.2: the longs are the tail
    assert weight[~long].max() < 1500 and weight[long].min() > 2500
    # burst: the 10 s burst window (500-8000 prompt tokens) then 20 s steady (100-500)
    assert np.array_equal(burst.burst, burst.times < 10.0)
    assert burst.inputs[~burst.burst].max() <= 500 <= burst.inputs[burst.burst].min()


def test_each_policy_runs_the_same_server_with_its_own_engine_file(
        model: tg_config.ModelConfig, tmp_path: Path):
    opts = sb.SchedBenchOptions(max_num_seqs=3, port=18951)
    fcfs = sb.vllm_for("fcfs", model, opts, tmp_path / "engine-fcfs.jsonl")
    weighted = sb.vllm_for("weighted", model, opts, tmp_path / "engine-weighted.jsonl")
    assert fcfs.argv == weighted.argv
    argv = " ".join(fcfs.argv)
    assert "--scheduler-cls tokengate_vllm.scheduler.TokenWeightedScheduler" in argv
    assert "--max-num-seqs 3" in argv and "--port 18951" in argv
    assert fcfs.env["TOKENGATE_SCHED_POLICY"] == "fcfs"
    assert weighted.env["TOKENGATE_SCHED_POLICY"] == "weighted"
    assert fcfs.env["TOKENGATE_ENGINE_USAGE_FILE"] == str(tmp_path / "engine-fcfs.jsonl")
    assert (fcfs.env["TOKENGATE_SCHED_OUTPUT_WEIGHT"], fcfs.env["TOKENGATE_SCHED_MAX_WAIT_S"]) \
        == ("0.7", "10")
    assert fcfs.name != weighted.name


def records(ttft_s: list[float], prompts: list[int], outputs: list[int],
            status: list[int] | None = None) -> Records:
    n = len(ttft_s)
    sched = np.arange(n, dtype=np.float64)
    z = np.zeros(n, dtype=np.int64)
    return Records(sched=sched, sent=sched, first=sched + np.array(ttft_s),
                   end=sched + np.array(ttft_s) + 1.0,
                   status=np.array(status or [200] * n, dtype=np.int64),
                   prompt=np.array(prompts), completion=np.array(outputs), header_count=z - 1,
                   chunks=np.array(outputs), error=z, limit=z, retry_after=np.full(n, np.nan),
                   expected_prompt=np.array(prompts), planned_output=np.array(outputs),
                   key=z, burst=np.zeros(n, dtype=bool), itl=np.empty(0))


def test_client_figures_split_short_and_long_by_the_schedulers_weight():
    # weights: 1000 + 0.7*100 = 1070 (short), 2000 + 0.7*715 = 2500.5 (long: >= 2500),
    # 2400 + 0.7*100 = 2470 (short), 6000 + 0.7*180 (long)
    r = records([0.1, 2.0, 0.3, 5.0, 0.2, float("nan")], [1000, 2000, 2400, 6000, 1000, 1000],
                [100, 715, 100, 180, 100, 100], status=[200, 200, 200, 200, 200, 503])
    f = sb.client_figures(r, long_weight=2500.0, output_weight=0.7)
    assert f.requests == {"short": 4, "long": 2} and f.ok == {"short": 3, "long": 2}
    assert f.failed == 1
    assert f.ttft_ms == {"short": {"p50": 200.0, "p99": 300.0},
                         "long": {"p50": 2000.0, "p99": 5000.0}}


def test_engine_figures_of_a_run_that_has_the_server_to_itself():
    def rec(gen: int, prompt: int, queued: float | None, prefilled: bool = True
            ) -> dict[str, Any]:
        return {"request_id": "chatcmpl-x", "index": 0, "num_generation_tokens": gen,
                "num_prompt_tokens": prompt, "prefilled": prefilled, "queued_ms": queued}

    recs = [rec(30, 1000, 5.0), rec(180, 6000, 9800.0), rec(0, 900, None, prefilled=False)]
    before = {ef.GENERATION: 10.0, ef.PROMPT: 100.0, ef.QUEUE_TIME + "_sum": 1.0,
              ef.QUEUE_TIME + "_count": 1.0}
    after = {ef.GENERATION: 220.0, ef.PROMPT: 7100.0, ef.QUEUE_TIME + "_sum": 7.0,
             ef.QUEUE_TIME + "_count": 4.0, ef.ITERATION + "_sum": 7210.0,
             ef.ITERATION + "_count": 70.0}
    f = ef.engine_figures(recs, 7.0, before, after,
                          {ef.RUNNING: [4.0, 3.0], ef.WAITING: [6.0, 0.0, 3.0]}, expected=3)
    assert (f.max_queued_ms, f.mean_queue_ms, f.output_tokens_per_s) == (9800.0, 2000.0, 30.0)
    assert (f.mean_running, f.mean_waiting, f.tokens_per_iteration) == (3.5, 3.0, 103.0)
    assert (f.generation_tokens, f.prompt_tokens) == (210, 7000) and f.reconciled
    assert not ef.engine_figures(recs[:2], 7.0, before, after, {}, expected=3).reconciled


def test_parse_metrics_sums_label_sets():
    text = ('# HELP vllm:num_requests_running x\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
            'vllm:iteration_tokens_total_sum{engine="0"} 12.5\n'
            'process_cpu_seconds_total 9.0\n')
    assert ef.parse_metrics(text) == {"vllm:num_requests_running": 4.0,
                                      "vllm:iteration_tokens_total_sum": 12.5}


def profile_run(policy: str, short_p99: float, long_p99: float, tok_s: float,
                running: float) -> dict[str, Any]:
    client = sb.ClientFigures(requests={"short": 60, "long": 15}, ok={"short": 60, "long": 15},
                              ttft_ms={"short": {"p50": short_p99 / 4, "p99": short_p99},
                                       "long": {"p50": long_p99 / 2, "p99": long_p99}},
                              failed=0)
    engine = ef.EngineFigures(max_queued_ms=long_p99 - 100, mean_queue_ms=500.0,
                              output_tokens_per_s=tok_s, mean_running=running,
                              mean_waiting=2.0, tokens_per_iteration=80.0, records=75,
                              records_expected=75)
    run = sb.ProfileRun("long_tail", policy, client, engine, valid=True, invalid_reasons=[])
    return json.loads(json.dumps(run.to_json()))


def test_ratios_table_and_findings_from_recorded_runs():
    runs = {"fcfs": {"long_tail": profile_run("fcfs", 8000.0, 9000.0, 100.0, 3.5)},
            "weighted": {"long_tail": profile_run("weighted", 2000.0, 13500.0, 102.0, 3.5)}}
    opts = sb.SchedBenchOptions(profiles=["long_tail"])
    out: dict[str, Any] = {"options": vars(opts), "runs": runs, "ratios": sb.ratios(runs)}
    rs = out["ratios"]["long_tail"]
    assert rs["TTFT short p99 (ms)"] == 0.25 and rs["TTFT long p99 (ms)"] == 1.5
    assert rs["output tokens/s"] == 1.02 and rs["mean running requests"] == 1.0
    assert rs["longest queue wait (ms)"] == round(13400 / 8900, 3)
    console = Console(file=io.StringIO(), width=120)
    console.print(sb.render(out))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    row = next(x for x in text.splitlines() if "TTFT short p99" in x)
    assert [c.strip() for c in row.split("│")[3:6]] == ["8,000", "2,000", "x0.25"]
    assert "60 short, 15 long" in text and "valid, reconciled" in text
    notes = sb.findings(out)
    assert notes[0].startswith("long_tail: TTFT short p50 2,000 -> 500 (x0.25) ms, p99 "
                               "8,000 -> 2,000 (x0.25) ms; TTFT long p99 9,000 -> 13,500 "
                               "(x1.50) ms")
    assert notes[1] == (
        "What this CPU run shows: the ordering itself, in front of 4 running slots. Short "
        "requests stop waiting behind long ones: their TTFT p99 fell (long_tail x0.25). Long "
        "requests pay for it (TTFT p99 long_tail x1.50); the longest wait, 13,400 ms, is the "
        "aging bound (10 s) plus the time a slot took to free up. Mean queue wait: long_tail "
        "x1.00; output tokens/s: long_tail x1.02 (the same work in another order).")
    assert notes[2].startswith("What it cannot show: GPU utilization") and "3.2 -> 5.7" in notes[2]


def test_help_reads_like_a_man_page(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as e:
        sb.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "make bench-scheduler" in out
    for opt in ("--duration", "--rate", "--max-num-seqs", "--profiles", "--port", "--out"):
        assert opt in out


def test_findings_say_so_when_short_requests_did_not_gain():
    runs = {"fcfs": {"long_tail": profile_run("fcfs", 2000.0, 2400.0, 140.0, 2.8)},
            "weighted": {"long_tail": profile_run("weighted", 6000.0, 10700.0, 133.0, 3.5)}}
    opts = sb.SchedBenchOptions(profiles=["long_tail"])
    out: dict[str, Any] = {"options": vars(opts), "runs": runs, "ratios": sb.ratios(runs)}
    runs["fcfs"]["long_tail"]["valid"] = False
    text = sb.shows(out)
    assert "Short requests' TTFT p99 did not fall everywhere (long_tail x3.00): the order " \
           "of the waiting queue helps only while short and long requests wait together" in text
    assert "Long requests pay for it (TTFT p99 long_tail x4.46); the longest wait, 10,600 ms, " \
           "is the aging bound (10 s) plus the time a slot took to free up." in text
    assert text.endswith("Not valid: fcfs long_tail (see the table): read those figures "
                         "with care.")
