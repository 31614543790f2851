"""TokenStorm runs against the fast upstream: exact per-request accounting, multiple
workers and keys, invalid-run detection, the CLI's outputs and its self-check."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokengate import config as tg_config
from tokenstorm.arrivals import ArrivalSpec
from tokenstorm.client import L_REQUESTS, L_TOKENS, L_UNKNOWN, classify_429
from tokenstorm.profiles import OutputPolicy
from tokenstorm.prompts import StreamOptions
from tokenstorm.report import SLO, Records, summarize
from tokenstorm.runner import RunSpec, execute

PY = sys.executable


def spec_for(url: str, cfg: tg_config.Config, **kw: object) -> RunSpec:
    m = cfg.models["tiny-qwen3"]
    base: dict[str, object] = {
        "url": url, "model": m.name, "model_dir": Path(m.dir),
        "max_model_len": m.max_model_len, "arrival": ArrivalSpec("constant", rate=300.0),
        "duration_s": 2.0, "profile": "normal:mean=1000,sd=200",
        "output": OutputPolicy(fixed=16), "send_token_count": True,
        "max_lag_ms": 1000.0}  # the lag rule has its own test: test_send_lag_rule
    base.update(kw)
    return RunSpec(**base)  # type: ignore[arg-type]


def test_streamed_open_loop_run_accounts_for_every_token(fast_upstream_url: str,
                                                         cfg: tg_config.Config) -> None:
    result = execute(spec_for(fast_upstream_url, cfg, stream=StreamOptions(stream=True)),
                     progress=False)
    s, r = result.summary, result.records
    assert s.requests == 600 and s.status_counts == {"200": 600} and s.errors == {}
    assert (r.completion == 16).all() and (r.chunks == 16).all()
    assert (r.prompt == r.expected_prompt).all()
    assert r.itl.size == 600 * 15
    assert s.prompt_check == {"checked": 600, "mismatches": 0, "header_checked": 0,
                              "header_mismatches": 0, "enabled": True}
    assert s.all.ttft_ms.n == s.all.tpot_ms.n == s.all.e2e_ms.n == 600
    assert s.valid, s.invalid_reasons
    # Scheduled times are the plan's, to the nanosecond.
    np.testing.assert_allclose(r.sched, result.plan.times, atol=1e-9)


def test_paced_stream_is_parsed_event_by_event(slow_upstream_url: str,
                                               cfg: tg_config.Config) -> None:
    """With ITL > 0 the fast upstream writes (and the client reads) one SSE event per
    token in its own HTTP chunk: one ITL sample per gap, usage from the final chunk."""
    result = execute(spec_for(slow_upstream_url, cfg, stream=StreamOptions(stream=True),
                              arrival=ArrivalSpec("constant", rate=20.0), duration_s=1.0,
                              output=OutputPolicy(fixed=10)), progress=False)
    s, r = result.summary, result.records
    assert s.requests == 20 and s.all.ok == 20
    assert (r.completion == 10).all() and (r.chunks == 10).all()
    assert r.itl.size == 20 * 9
    assert s.prompt_check["mismatches"] == 0


def test_two_workers_and_three_keys_share_the_schedule(fast_upstream_url: str,
                                                       cfg: tg_config.Config) -> None:
    result = execute(spec_for(fast_upstream_url, cfg, workers=2, keys=("k1", "k2", "k3"),
                              arrival=ArrivalSpec("poisson", rate=200.0), duration_s=1.5,
                              seed=9), progress=False)
    s, r = result.summary, result.records
    n = len(result.plan)
    assert s.requests == n and s.all.ok == n
    assert s.keys == {f"key{i}": {"requests": int((np.arange(n) % 3 == i).sum()),
                                  "ok": int((np.arange(n) % 3 == i).sum()), "429": 0}
                      for i in range(3)}
    assert (r.completion == 16).all() and s.all.ttft_ms.n == n
    assert s.all.tpot_ms.n == 0  # not streamed: no TPOT
    assert s.valid


def test_estimated_prompt_counts_make_the_run_invalid(fast_upstream_url: str,
                                                      cfg: tg_config.Config) -> None:
    """Without X-Token-Count the fast upstream estimates prompt tokens (bytes / 4): the
    reported counts are not the planned ones and the run says so."""
    result = execute(spec_for(fast_upstream_url, cfg, send_token_count=False,
                              arrival=ArrivalSpec("constant", rate=50.0), duration_s=0.4),
                     progress=False)
    s = result.summary
    assert s.prompt_check["checked"] == 20 and s.prompt_check["mismatches"] == 20
    assert not s.valid
    assert s.invalid_reasons == ["prompt tokens differ from the planned count on 20 responses"]


def records(n: int, late_ms: list[float]) -> Records:
    sched = np.arange(n) * 0.001
    lag = np.zeros(n)
    lag[:len(late_ms)] = np.array(late_ms) / 1000.0
    z = np.zeros(n, dtype=np.int64)
    return Records(sched=sched, sent=sched + lag, first=sched + lag + 0.001,
                   end=sched + lag + 0.002, status=z + 200, prompt=z + 100, completion=z + 4,
                   header_count=z - 1, chunks=z + 4, error=z, limit=z,
                   retry_after=np.full(n, np.nan), expected_prompt=z + 100,
                   planned_output=z + 4, key=z, burst=np.zeros(n, dtype=bool),
                   itl=np.full(3 * n, 0.0003))


@pytest.mark.unit
@pytest.mark.parametrize("late, open_loop, valid", [
    (5, True, True),      # 0.5 % late: within the 1 % allowance
    (11, True, False),    # 1.1 % late: the generator fell behind
    (500, False, True),   # closed loop: sends follow completions, lag does not apply
])
def test_send_lag_rule(late: int, open_loop: bool, valid: bool) -> None:
    s = summarize(records(1000, [20.0] * late), name="t", target="x", mode="m", offered="o",
                  stream=True, workers=1, duration_s=1.0, slo=SLO(), max_lag_ms=10.0,
                  open_loop=open_loop, key_names=[], check_prompt=True)
    assert s.valid is valid
    assert s.late_fraction == late / 1000
    if not valid:
        assert s.invalid_reasons == [
            (f"generator fell behind its schedule: {late / 10:.1f}% of requests left more "
             f"than 10 ms late (p99 send lag {s.send_lag_ms.p99:.1f} ms)")]


@pytest.mark.unit
def test_tpot_and_goodput_follow_their_definitions() -> None:
    r = records(100, [])
    r.first = r.sched + 0.010           # TTFT 10 ms
    r.end = r.sched + 0.040             # E2E 40 ms, 4 tokens: TPOT (40-10)/3 = 10 ms
    r.end[:30] = r.sched[:30] + 0.100   # 30 requests: TPOT 30 ms
    s = summarize(r, name="t", target="x", mode="m", offered="o", stream=True, workers=1,
                  duration_s=1.0, slo=SLO(ttft_ms=20, tpot_ms=20), max_lag_ms=10.0,
                  open_loop=True, key_names=[], check_prompt=True)
    assert s.all.tpot_ms.p50 == pytest.approx(10.0)
    assert s.all.tpot_ms.max == pytest.approx(30.0)
    span = float(r.end.max() - r.sched.min())
    assert s.all.goodput_rps == pytest.approx(70 / span)
    assert s.all.rps == pytest.approx(100 / span)


@pytest.mark.unit
@pytest.mark.parametrize("body, headers, kind", [
    ((b'{"error":{"message":"Rate limit reached: requests per minute (RPM) 600",'
      b'"type":"requests","code":"rate_limit_exceeded"}}'), b"", L_REQUESTS),
    ((b'{"error":{"message":"Rate limit reached for tokens per minute (TPM): limit 1000",'
      b'"code":"rate_limit_exceeded"}}'), b"", L_TOKENS),
    (b'{"error":{"message":"Too many requests","code":"rate_limit_exceeded"}}',
     b"\r\nx-ratelimit-remaining-requests: 0\r\nx-ratelimit-remaining-tokens: 500\r\n",
     L_REQUESTS),
    (b'{"error":{"message":"Too many requests","code":"rate_limit_exceeded"}}',
     b"\r\nx-ratelimit-remaining-requests: 12\r\nx-ratelimit-remaining-tokens: 3\r\n",
     L_TOKENS),
    (b"slow down", b"", L_UNKNOWN),
])
def test_429s_are_attributed_to_the_limit_that_refused(body: bytes, headers: bytes,
                                                       kind: int) -> None:
    assert classify_429(headers, body) == kind


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "tokenstorm.cli", *args], check=False,
                          capture_output=True, text=True, timeout=120)


def test_cli_marks_a_run_that_falls_behind_invalid(slow_upstream_url: str) -> None:
    """One connection to a server that takes ~46 ms per request cannot carry 100
    requests/s: requests wait for the connection, leave late, and the run is invalid
    (exit status 2)."""
    p = run_cli("run", "--url", slow_upstream_url, "--rate", "100", "--arrivals", "constant",
                "--duration", "0.5", "--profile", "normal:mean=100,sd=0", "--output-tokens",
                "4", "--connections", "1", "--max-connections", "1", "--send-token-count",
                "--quiet")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "INVALID: generator fell behind its schedule" in re.sub(r"\s+", " ", p.stdout)


def test_cli_writes_summary_and_plots_with_burst_windows(fast_upstream_url: str,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    p = run_cli("run", "--url", fast_upstream_url, "--rate", "200", "--duration", "2",
                "--profile", "burst:period_s=1,burst_s=0.25,burst_range=500-2000",
                "--output-tokens", "8", "--stream", "--send-token-count", "--name", "burst",
                "--max-lag-ms", "1000",
                "--out", str(out), "--plots", str(tmp_path), "--quiet",
                "--api-key", "a", "--api-key", "b")
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert data["valid"] is True and data["name"] == "burst"
    assert set(data["windows"]) == {"steady", "burst"}
    w = data["windows"]
    assert w["steady"]["requests"] + w["burst"]["requests"] == data["requests"]
    assert w["steady"]["ok"] + w["burst"]["ok"] == data["all"]["ok"] == data["requests"]
    assert set(data["keys"]) == {"key0", "key1"}
    assert data["prompt_check"]["mismatches"] == 0
    assert (tmp_path / "burst-latency.png").stat().st_size > 10_000
    assert (tmp_path / "burst-throughput.png").stat().st_size > 10_000


def test_ceiling_self_check_reports_requests_per_second() -> None:
    p = run_cli("ceiling", "--duration", "1", "--profile", "normal:mean=200,sd=0",
                "--output-tokens", "4")
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"TokenStorm ceiling: ([\d,]+) requests/s", p.stdout)
    assert m is not None, p.stdout
    assert int(m.group(1).replace(",", "")) > 0


def test_help_reads_like_a_man_page() -> None:
    p = run_cli("run", "--help")
    assert p.returncode == 0
    for section in ("COMMANDS", "MEASURES", "VALIDITY", "EXIT STATUS", "EXAMPLES",
                    "PROFILES"):
        assert section in p.stdout
