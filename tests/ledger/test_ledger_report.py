"""``tokengate usage``: the report equals what was used.

The CLI is run as a user runs it (``python -m tokengate.cli usage``, the ``tokengate``
console script's module). The vLLM test drives the real vLLM CPU server with the
official ``openai`` client, writes each request's usage event the way the edge does
(final usage, the last cumulative chunk of a disconnected stream, a rejected request)
and checks the report against the sum of vLLM's usage.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from tokengate import config as tg_config
from tokengate import redis_client
from tokengate import redis_keys as store
from tokengate.ledger.calculator import Calculator
from tokengate.ledger.event import UsageEvent
from tokengate.ledger.ledger import Ledger
from tokengate_dev import devstack

from tests.cli_calls import tokengate
from tests.conftest import MODEL
from tests.fixtures_ledger import make_event, svc_name, wait_until
from tests.ledger.test_ledger import workload


def usage_cli(config_path: Path, redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``tokengate usage --config config_path --redis-url redis_url ARGS`` (in this
    process: tests/cli_calls.py)."""
    return tokengate("usage", "--config", config_path, "--redis-url", redis_url, *args)


def usage_json(config_path: Path, redis_url: str, *args: str) -> dict:
    r = usage_cli(config_path, redis_url, "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def applied_workload(cfg, ledger_redis, redis_url, usage_writer) -> list[UsageEvent]:
    events = workload(600, seed=41, days=("2026-11-27", "2026-11-28", "2026-11-29"))
    for ev in events:
        usage_writer.write(ev)
    led = Ledger(cfg, redis_client.connect(cfg.redis, url=redis_url), usage_writer.path, "report")
    assert led.drain().applied == len(events)
    led.close()
    return events


def sums(events: list[UsageEvent], cfg: tg_config.Config) -> dict[str, float]:
    calc = Calculator(cfg)
    return {"requests": len(events), "errors": sum(e.status >= 400 for e in events),
            "prompt_tokens": sum(e.prompt_tokens for e in events),
            "completion_tokens": sum(e.completion_tokens for e in events),
            "cached_tokens": sum(e.cached_tokens for e in events),
            "aborted": sum(e.client_aborted for e in events),
            "cost": sum(calc.charge_event(e).cost for e in events)}


def check_total(doc_total: dict, want: dict[str, float]) -> None:
    for k, v in want.items():
        if k == "cost":
            assert doc_total[k] == pytest.approx(v, rel=1e-9), k
        else:
            assert doc_total[k] == v, k


def test_json_report_per_key_model_day(cfg, config_path, redis_url, applied_workload):
    doc = usage_json(config_path, redis_url)
    assert doc["currency"] == "USD" and doc["by"] == ["key", "model", "day"]
    check_total(doc["total"], sums(applied_workload, cfg))
    # one row per (day, key, model) present, each equal to its own events' sum
    groups: dict[tuple, list[UsageEvent]] = {}
    for e in applied_workload:
        groups.setdefault((e.day, e.key_id, e.model), []).append(e)
    assert len(doc["rows"]) == len(groups)
    for row in doc["rows"]:
        check_total(row, sums(groups[(row["day"], row["key_id"], row["model"])], cfg))
        assert sum(row["statuses"].values()) == row["requests"]


def test_since_until_key_and_grouping(cfg, config_path, redis_url, applied_workload):
    doc = usage_json(config_path, redis_url, "--since", "2026-11-28", "--until", "2026-11-28")
    check_total(doc["total"], sums([e for e in applied_workload if e.day == "2026-11-28"], cfg))
    assert {r["day"] for r in doc["rows"]} == {"2026-11-28"}
    doc = usage_json(config_path, redis_url, "--since", "2026-11-28", "--by", "key")
    assert {r["key_id"] for r in doc["rows"]} == {"alpha", "beta:β", None}
    assert all(r["day"] is None and r["model"] is None for r in doc["rows"])
    check_total(doc["total"], sums([e for e in applied_workload if e.day >= "2026-11-28"], cfg))
    doc = usage_json(config_path, redis_url, "--key", "beta:β", "--model", "other/model")
    check_total(doc["total"], sums([e for e in applied_workload if e.key_id == "beta:β"
                                    and e.model == "other/model"], cfg))
    assert usage_json(config_path, redis_url, "--since", "2027-01-01")["rows"] == []


def test_table_report_shows_the_totals(cfg, config_path, redis_url, applied_workload):
    r = usage_cli(config_path, redis_url, "--by", "day")
    assert r.returncode == 0, r.stderr
    want = sums(applied_workload, cfg)
    total_line = [ln for ln in r.stdout.splitlines() if "total" in ln][-1]
    assert f"{want['requests']:,}" in total_line
    assert f"{want['prompt_tokens']:,}" in total_line
    assert f"{want['cost']:.6f}" in total_line
    for day in ("2026-11-27", "2026-11-28", "2026-11-29"):
        assert day in r.stdout


def test_the_tables_title_names_the_days_it_shows(config_path, redis_url, applied_workload):
    # without --since it said "first day .. last day (UTC)", which read like a placeholder
    for args, days in ((("--by", "day"), "2026-11-27 .. 2026-11-29"),
                       (("--since", "2026-11-28", "--by", "key"), "2026-11-28 .. 2026-11-29"),
                       (("--until", "2026-11-28", "--by", "day"), "2026-11-27 .. 2026-11-28"),
                       (("--since", "2027-01-01", "--by", "day"), "from 2027-01-01"),
                       (("--until", "2026-01-01", "--by", "day"), "up to 2026-01-01"),
                       (("--key", "nobody", "--by", "day"), "all days")):
        r = usage_cli(config_path, redis_url, *args)
        assert r.returncode == 0, r.stderr
        by = args[-1]
        assert r.stdout.splitlines()[0].rstrip() == f"tokengate usage, {days} (UTC), by {by}"


def test_usage_errors_and_redis_down(config_path, redis_url):
    r = usage_cli(config_path, redis_url, "--since", "last week")
    assert r.returncode == 2 and "--since" in r.stderr
    r = usage_cli(config_path, redis_url, "--by", "hour")
    assert r.returncode == 2 and "--by" in r.stderr
    r = usage_cli(config_path, redis_url, "--since", "today", "--until", "yesterday")
    assert r.returncode == 2 and "is after --until" in r.stderr
    for bad in ("0", "-1", "many"):
        r = usage_cli(config_path, redis_url, "--by", "session", "--limit", bad)
        assert r.returncode == 2 and "--limit: must be a whole number" in r.stderr
    r = usage_cli(config_path, "redis://127.0.0.1:1/0")
    assert r.returncode == 1 and "Redis unavailable" in r.stderr


def test_help_reads_like_a_man_page():
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "usage", "--help"],
                       capture_output=True, text=True, timeout=30, check=False)
    for section in ("COLUMNS", "DAYS", "EXIT STATUS", "EXAMPLES", "--since", "--json"):
        assert section in r.stdout
    r = subprocess.run([sys.executable, "-m", "tokengate.ledger.service", "--help"],
                       capture_output=True, text=True, timeout=30, check=False)
    for section in ("EXACTLY ONCE", "LOG ROTATION", "REDIS DOWN", "EXIT STATUS"):
        assert section in r.stdout


# -- a known workload on the real vLLM server ------------------------------------------


def _metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=10).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.slow
def test_report_equals_vllm_usage_for_a_known_workload(cfg, ledger_config_path, redis_url,
                                                       ledger_redis, usage_writer, vllm_url):
    """Non-streaming, streaming (cumulative usage in every chunk), a stream the client
    abandons after 3 chunks (billed up to the last chunk seen), a completions request,
    a repeated long prompt (prefix-cache hits), a rejected request."""
    import openai

    client = openai.OpenAI(base_url=vllm_url, api_key="unused", max_retries=0)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    long_system = "You are a meticulous assistant. " * 40
    seen: list[dict] = []          # vLLM's usage as the edge would record it
    prompt_before = _metric(vllm_url, "vllm:prompt_tokens_total")

    def record(usage, *, stream: bool, source: str = "final", aborted: bool = False,
               status: int = 200, endpoint: str = "chat") -> None:
        cached = 0
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens or 0
        seen.append({"prompt_tokens": usage.prompt_tokens if usage else 0,
                         "completion_tokens": usage.completion_tokens if usage else 0,
                         "cached_tokens": cached, "stream": stream, "usage_source": source,
                         "client_aborted": aborted, "status": status, "endpoint": endpoint})

    for i, max_tokens in enumerate((5, 17, 33)):
        r = client.chat.completions.create(
            model=MODEL, max_tokens=max_tokens, temperature=0,
            messages=[{"role": "system", "content": long_system},
                      {"role": "user", "content": f"question {i}"}])
        record(r.usage, stream=False)
    for max_tokens in (9, 24):
        last = None
        for chunk in client.chat.completions.create(
                model=MODEL, max_tokens=max_tokens, stream=True, stream_options=opts,
                messages=[{"role": "user", "content": "stream please"}]):
            last = chunk.usage or last
        record(last, stream=True)
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=200, stream=True, stream_options=opts,
        messages=[{"role": "user", "content": "a long answer that I will not wait for"}])
    last = None
    for n, chunk in enumerate(stream):
        last = chunk.usage or last
        if n == 3:
            break
    stream.close()              # the client disconnects
    record(last, stream=True, source="running", aborted=True)
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12)
    record(r.usage, stream=False, endpoint="completions")
    record(None, stream=False, source="none", status=429)

    assert seen[5]["client_aborted"] and 0 < seen[5]["completion_tokens"] < 200
    assert any(s["cached_tokens"] > 0 for s in seen), "expected prefix-cache hits"
    # vLLM's own counter agrees on the prompt tokens it processed.
    wait_until(lambda: _metric(vllm_url, "vllm:prompt_tokens_total") - prompt_before
               == sum(s["prompt_tokens"] for s in seen), 20, what="vLLM prompt metric")

    for i, s in enumerate(seen):
        usage_writer.write(make_event(
            ts=f"2026-11-29T10:00:{i:02d}.000Z", token_estimate=s["prompt_tokens"],
            reserved=s["prompt_tokens"] + 256, system_tokens=0,
            error="rate_limit_exceeded" if s["status"] == 429 else None, **s))
    name = svc_name("test-ledger-report")
    svc = devstack.ledger_service(ledger_config_path, usage_writer.path, redis_url,
                                  ledger_id=name, name=name).start()
    try:
        wait_until(lambda: ledger_redis.hget(store.stats_key(name), "applied") == str(len(seen)),
                   what="workload applied")
    finally:
        svc.stop()
    doc = usage_json(ledger_config_path, redis_url, "--since", "2026-11-29",
                     "--until", "2026-11-29")
    (row,) = doc["rows"]
    assert (row["key_id"], row["model"], row["day"]) == ("demo", MODEL, "2026-11-29")
    assert row["requests"] == len(seen) == 8
    assert row["errors"] == 1 and row["aborted"] == 1 and row["statuses"] == {"200": 7,
                                                                               "429": 1}
    for k in ("prompt_tokens", "completion_tokens", "cached_tokens"):
        assert row[k] == sum(s[k] for s in seen), k
    w = cfg.models[MODEL].cost
    cost = sum(((s["prompt_tokens"] - s["cached_tokens"]) * w.input
                + s["completion_tokens"] * w.output + s["cached_tokens"] * w.cached) / 1e6
               for s in seen)   # every prompt is far below the context-penalty threshold
    assert row["cost"] == pytest.approx(cost, rel=1e-9)


def _session_workload() -> list[UsageEvent]:
    """The workload with an agent session on most events: three sessions of "alpha"
    (one with a 128-character id), one of "beta:β", and events without one."""
    events = workload(300, seed=43, days=("2026-11-28", "2026-11-29"))
    sessions = {"alpha": ["claude-6f1c", "codex/thread 7", "s" * 128],
                "beta:β": ["sha256:" + "ab" * 16]}
    out = []
    for i, e in enumerate(events):
        ids = sessions.get(e.key_id or "")
        sid = ids[i % len(ids)] if ids and i % 5 else None
        out.append(replace(e, session_id=sid))
    return out


def test_sessions_report_equals_the_sum_of_each_sessions_events(cfg, config_path, redis_url,
                                                                ledger_redis, usage_writer):
    events = _session_workload()
    for ev in events + events[:50]:  # a replayed stretch is applied once
        usage_writer.write(ev)
    led = Ledger(cfg, redis_client.connect(cfg.redis, url=redis_url), usage_writer.path,
                 "sessions")
    assert led.drain().applied == len(events)
    led.close()
    calc = Calculator(cfg)
    doc = usage_json(config_path, redis_url, "--by", "session", "--key", "alpha")
    assert doc["by"] == ["session"]
    rows = {r["session_id"]: r for r in doc["rows"]}
    assert set(rows) == {"claude-6f1c", "codex/thread 7", "s" * 128}
    for sid, row in rows.items():
        mine = [e for e in events if e.key_id == "alpha" and e.session_id == sid]
        assert row["key_id"] == "alpha"
        assert row["requests"] == len(mine)
        assert row["prompt_tokens"] == sum(e.prompt_tokens for e in mine)
        assert row["cached_tokens"] == sum(e.cached_tokens for e in mine)
        assert row["completion_tokens"] == sum(e.completion_tokens for e in mine)
        assert row["cost"] == pytest.approx(sum(calc.charge_event(e).cost for e in mine),
                                            rel=1e-9)
        assert row["first"] == min(e.ts for e in mine)
        assert row["last"] == max(e.ts for e in mine)
    # most recently seen first
    assert [r["last"] for r in doc["rows"]] == sorted((r["last"] for r in doc["rows"]),
                                                      reverse=True)
    beta = usage_json(config_path, redis_url, "--by", "session", "--key", "beta:β",
                      "--limit", "1")["rows"]
    assert [r["session_id"] for r in beta] == ["sha256:" + "ab" * 16]
    # retention: every session hash and index expires (ledger.session_days)
    ttl = ledger_redis.ttl(store.session_key("alpha", "claude-6f1c"))
    assert 0 < ttl <= cfg.ledger.session_days * 86400
    assert 0 < ledger_redis.ttl(store.sessions_key("alpha")) <= cfg.ledger.session_days * 86400


def test_a_keys_session_index_keeps_its_most_recent_sessions(cfg, config_path, redis_url,
                                                            ledger_redis, usage_writer):
    cfg = cfg.model_copy(update={"ledger": cfg.ledger.model_copy(
        update={"sessions_per_key": 3})})
    for i in range(5):
        usage_writer.write(make_event(key_id="alpha", session_id=f"s{i}",
                                      ts=f"2026-11-29T10:00:0{i}.000Z"))
    led = Ledger(cfg, redis_client.connect(cfg.redis, url=redis_url), usage_writer.path,
                 "trim")
    assert led.drain().applied == 5
    led.close()
    assert ledger_redis.zrevrange(store.sessions_key("alpha"), 0, -1) == ["s4", "s3", "s2"]
