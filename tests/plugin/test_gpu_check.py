"""dev/gpu_check.sh and tokengate_dev.bench.gpu_check without a GPU: the script's options
and the commands it would run, its shell hygiene, and the figures and reconciliation it
prints (the run against a real server is in tests/plugin/test_vllm_plugin.py)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from tokengate_dev.bench import gpu_check
from tokenstorm.null_server import FastUpstream

from tests.conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "dev" / "gpu_check.sh"
DRIVER = f"env PYTHONPATH={ROOT / 'dev'} pyx -m tokengate_dev.bench.gpu_check"


def sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, check=False)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_the_script_is_shellcheck_clean():
    r = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stdout


def test_help_is_the_header():
    r = sh("--help")
    assert r.returncode == 0
    assert r.stdout.startswith("gpu_check.sh: the tokengate vLLM plugin on a CUDA machine")
    for opt in ("--python", "--work", "--model-dir", "--tokenizer-dir", "--duration", "--rate",
                "--burst", "--port", "--max-num-seqs", "--allow-cpu", "--dry-run"):
        assert f"  {opt}" in r.stdout


@pytest.mark.parametrize("args, why", [
    (["--bogus"], "unknown option --bogus"),
    (["--duration", "ten"], "take numbers"),
])
def test_bad_options_exit_2(args: list[str], why: str):
    r = sh(*args)
    assert r.returncode == 2 and why in r.stderr


def test_dry_run_prints_the_steps(tmp_path: Path):
    r = sh("--dry-run", "--work", str(tmp_path), "--python", "pyx", "--port", "18999",
           "--duration", "7", "--rate", "2", "--burst", "5", "--tokenizer-dir", "/tok")
    assert r.returncode == 0, r.stderr
    steps = [x for x in r.stdout.splitlines() if x.startswith("+ ")]
    assert "tokengate_dev import build_tiny_model" in steps[0] and "/tok" in steps[0]
    assert steps[1] == f"+ pyx -m pip install -q --no-deps --no-build-isolation " \
                       f"{ROOT / 'vllm_patches'}"
    server = (f"pyx -m vllm.entrypoints.openai.api_server --model {tmp_path}/tiny-qwen3 "
              "--served-model-name tiny-qwen3 --host 127.0.0.1 --port 18999 "
              "--max-model-len 8192 --max-num-seqs 4 --disable-uvicorn-access-log "
              "--scheduler-cls tokengate_vllm.scheduler.TokenWeightedScheduler")
    for i, policy in enumerate(("fcfs", "weighted")):
        assert steps[2 + 2 * i] == (f"+ TOKENGATE_SCHED_POLICY={policy} "
                                    f"TOKENGATE_ENGINE_USAGE_FILE={tmp_path}/engine-"
                                    f"{policy}.jsonl {server}")
        assert steps[3 + 2 * i] == (
            f"+ {DRIVER} run --url http://127.0.0.1:18999 --model tiny-qwen3 "
            f"--usage-file {tmp_path}/engine-{policy}.jsonl --duration 7 --rate 2 --burst 5 "
            f"--label {policy} --out {tmp_path}/figures-{policy}.json")
    # sleep mode (the edge's idle unload): the flag and the dev-mode routes, then the check
    assert steps[6] == (f"+ TOKENGATE_SCHED_POLICY=weighted TOKENGATE_ENGINE_USAGE_FILE="
                        f"{tmp_path}/engine-sleep.jsonl VLLM_SERVER_DEV_MODE=1 {server} "
                        "--enable-sleep-mode")
    assert steps[7] == (f"+ {DRIVER} sleep --url http://127.0.0.1:18999 --model "
                        f"tiny-qwen3 --out {tmp_path}/sleep.json")
    assert len(steps) == 8


def test_the_sleep_check_passes_against_a_server_with_sleep_mode(
        replicas: Callable[..., FastUpstream]) -> None:
    # the fast upstream serves vLLM's sleep routes (tests/edge/test_edge_sleep.py); its
    # completions generate exactly max_tokens, as ignore_eos does
    up = replicas()
    fig = gpu_check.sleep_check(f"http://127.0.0.1:{up.port}", MODEL)
    assert fig["checks"] == {
        "request before sleeping": True, "POST /sleep?level=1 answers sleeping": True,
        "GET /is_sleeping is true": True, "POST /wake_up answers awake": True,
        "GET /is_sleeping is false": True, "request after waking generates 16 tokens": True}
    assert fig["ok"] and fig["usage_after_wake"]["completion_tokens"] == 16


@pytest.mark.unit
def test_the_workload_is_seeded_and_mixed():
    g = gpu_check
    a = g.workload(random.Random(3), 50.0, 8.0, 40)
    assert a == g.workload(random.Random(3), 50.0, 8.0, 40)
    assert [t for t, _ in a] == sorted(t for t, _ in a) and a[-1][0] < 50.0
    kinds = {k for _, k in a}
    assert kinds == set(g.CLASSES)
    assert sum(1 for t, _ in a if t == 15.0) == 40   # the burst at 15 s
    body, leave, timeout, n = g.body_for(random.Random(1), "n2")
    assert (body["n"], body.get("stream"), leave, timeout, n) == (2, None, None, 300, 2)
    body, leave, timeout, n = g.body_for(random.Random(1), "leave")
    assert body["stream"] and leave is not None and 1 <= leave <= 12
    assert g.body_for(random.Random(1), "timeout")[2] == 0.5


@pytest.mark.unit
def test_percentile_is_nearest_rank():
    g = gpu_check
    assert g.percentile([], 50) is None
    assert g.percentile([5.0], 99) == 5.0
    assert g.percentile([float(x) for x in range(1, 101)], 50) == 50.0
    assert g.percentile([float(x) for x in range(1, 101)], 99) == 99.0
    assert g.percentile([3.0, 1.0, 2.0], 100) == 3.0


@pytest.mark.unit
def test_summarize_reconciles_records_with_the_counters_and_compare_prints_them():
    g = gpu_check
    sent = [g.Sent("a" * 32, "short", 1, 0.0, ttft=0.010), g.Sent("b" * 32, "long", 1, 0.0,
            ttft=0.200), g.Sent("c" * 32, "n2", 2, 0.0), g.Sent("d" * 32, "leave", 1, 0.0)]

    def rec(rid: str, index: int, gen: int, prompt: int, prefilled: bool = True,
            queued: float | None = 1.0) -> dict[str, object]:
        return {"request_id": f"chatcmpl-{rid}", "index": index, "num_generation_tokens": gen,
                "num_prompt_tokens": prompt, "prefilled": prefilled, "queued_ms": queued}

    recs = [rec("a" * 32, 0, 10, 20), rec("b" * 32, 0, 300, 2000, queued=850.5),
            rec("c" * 32, 0, 8, 30), rec("c" * 32, 1, 8, 30), rec("d" * 32, 0, 0, 40, False,
                                                                   None),
            rec("e" * 32, 0, 99, 99)]   # another client's request: not counted
    keys = {f"chatcmpl-{s.request_id}#{i}" for s in sent for i in range(s.n)}
    before = {"vllm:generation_tokens_total": 100.0, "vllm:prompt_tokens_total": 1000.0,
              "vllm:iteration_tokens_total_sum": 0.0, "vllm:iteration_tokens_total_count": 0.0}
    after = {"vllm:generation_tokens_total": 426.0, "vllm:prompt_tokens_total": 3080.0,
             "vllm:iteration_tokens_total_sum": 3000.0,
             "vllm:iteration_tokens_total_count": 100.0}
    f = g.summarize("weighted", 10.0, sent, recs, keys, before, after, [2.0, 4.0])
    assert (f.records, f.records_expected, f.missing) == (5, 5, [])
    assert (f.generation_tokens, f.generation_counter) == (326, 326.0)
    assert (f.prompt_tokens, f.prompt_counter) == (2080, 2080.0)
    assert f.reconciled
    assert (f.output_tokens_per_s, f.mean_running, f.tokens_per_iteration,
            f.max_queued_ms) == (32.6, 3.0, 30.0, 850.5)
    assert f.ttft_ms == {"short": {"p50": 10.0, "p99": 10.0},
                         "long": {"p50": 200.0, "p99": 200.0}}
    short = g.summarize("fcfs", 10.0, sent, recs[:-2], keys, before, after, [])
    assert not short.reconciled and short.missing == ["chatcmpl-" + "d" * 32 + "#0"]
    table = g.compare([json.loads(json.dumps({**g.asdict(x), "reconciled": x.reconciled}))
                       for x in (short, f)])
    lines = table.splitlines()
    assert lines[0].split() == ["fcfs", "weighted"]
    assert lines[-2].split()[-2:] == ["NO", "yes"]
    assert "326/326" in table and "5/5" in table
