"""The tiered access log at the edge: the exact rule of tests/sampling_reference.py, run by
the edge's own Lua (its shared vectors replayed through lua/tokengate/sampling.lua, and a
real edge whose every request is checked against the Python reference), settings from
``access_log:`` in tokengate.yaml. Usage events stay 100 %.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokengate import config as tg_config
from tokengate.config import AccessLogConfig, ConfigError
from tokengate.tools import compile_config
from tokengate_dev import devstack

from tests.conftest import MODEL, TEST_DIR
from tests.fixtures_edge import EDGE_DIR, MAIN_KEY, Edge, _edge_yaml, free_port, run_lua
from tests.fixtures_ledger import svc_name
from tests.sampling_reference import bucket, keep, threshold

VECTORS = Path(__file__).parents[1] / "sampling_vectors.json"
RULES = {"error_status": 400, "slow_ms": 30, "slow_rate": 0.5, "rate": 0.25}


def test_the_shared_vectors_replayed_through_the_edge_lua() -> None:
    out = run_lua(f"""
        local cjson = require "cjson"
        local sampling = require "tokengate.sampling"
        local f = assert(io.open("{VECTORS}"))
        local doc = cjson.decode(f:read("*a"))
        f:close()
        local rules = sampling.rules(doc.rules)
        local got = {{}}
        for i, v in ipairs(doc.vectors) do
            local kept = sampling.keep(rules, v.request_id, v.status, v.total_ms)
            got[i] = {{ sampling.bucket(v.request_id) or -1, kept }}
        end
        return cjson.encode(got)""")
    got = json.loads(out)
    doc = json.loads(VECTORS.read_text())
    assert len(got) == len(doc["vectors"]) >= 50
    for v, (b, kept) in zip(doc["vectors"], got, strict=True):
        assert (None if b == -1 else b, kept) == (v["bucket"], v["keep"]), v


def test_the_rule_with_other_settings_in_lua_and_python() -> None:
    # thresholds round half up in both; 4 settings x ids around the thresholds
    settings = [AccessLogConfig(error_status=500, slow_ms=100.0, slow_rate=0.00005, rate=0.0),
                AccessLogConfig(error_status=400, slow_ms=0.0, slow_rate=1.0, rate=0.33335),
                AccessLogConfig(error_status=600, slow_ms=250.5, slow_rate=0.12345, rate=0.5)]
    ids = [f"{b:08x}" + "0" * 24 for b in (0, 1, 2, 1233, 1234, 1235, 3333, 3334, 4999, 5000,
                                          9999)] + ["0x000000" + "0" * 24, " 0000001" + "0" * 24]
    cases = [(i, s, ms) for i in ids for s in (200, 404, 499, 503) for ms in (0.5, 100.0, 250.6)]
    settings_json = json.dumps([s.model_dump(mode="json") for s in settings])
    out = run_lua(f"""
        local cjson = require "cjson"
        local sampling = require "tokengate.sampling"
        local settings = cjson.decode([==[{settings_json}]==])
        local cases = cjson.decode([==[{json.dumps(cases)}]==])
        local got = {{}}
        for _, s in ipairs(settings) do
            local r = sampling.rules(s)
            for _, c in ipairs(cases) do
                got[#got + 1] = sampling.keep(r, c[1], c[2], c[3])
            end
        end
        return cjson.encode(got)""")
    want = [keep(i, st, ms, s) for s in settings for i, st, ms in cases]
    assert json.loads(out) == want
    assert (threshold(0.00005), threshold(0.33335)) == (1, 3334)
    assert bucket("0x000000" + "0" * 24) is None


def compiled(config_path: Path, tmp_path: Path, section: dict[str, Any] | None) -> dict[str, Any]:
    raw = yaml.safe_load(config_path.read_text())
    if section is None:
        raw.pop("access_log", None)
    else:
        raw["access_log"] = section
    path = tmp_path / "conf" / "tokengate.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return compile_config.compile_config(tg_config.load(path))["access_log"]


@pytest.mark.unit
def test_access_log_settings_compile_from_the_yaml(config_path: Path, tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    assert compiled(config_path, tmp_path, None) == {
        "error_status": 400, "slow_ms": 5000.0, "slow_rate": 0.1, "rate": 0.01,
        "file": str(conf / "var/log/access.sampled.log")}
    assert compiled(config_path, tmp_path, {"rate": 0.2, "slow_ms": 800, "file": "x/a.log"}) \
        == {"error_status": 400, "slow_ms": 800.0, "slow_rate": 0.1, "rate": 0.2,
            "file": str(conf / "x/a.log")}
    assert compiled(config_path, tmp_path, {"file": False})["file"] == ""
    with pytest.raises(ConfigError, match="access_log.file"):
        compiled(config_path, tmp_path, {"file": 3})
    with pytest.raises(ConfigError, match="access_log.rate"):
        compiled(config_path, tmp_path, {"rate": 1.5})


@pytest.fixture
def sampled_edge(config_path: Path, counter_addr: str,
                 slow_upstream_url: str) -> Iterator[tuple[Edge, Path]]:
    """An edge in front of the slow fast-upstream (TTFT 40 ms > slow_ms 30) that logs
    by ``RULES`` to its own access log."""
    name = "access-log"
    log = EDGE_DIR / name / "access.sampled.log"
    log.unlink(missing_ok=True)
    usage = EDGE_DIR / name / "usage.jsonl"
    usage.unlink(missing_ok=True)

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [slow_upstream_url.removeprefix("http://")
            .removesuffix("/v1")]
        raw["access_log"] = {**RULES, "file": str(log)}
        raw["edge"]["auth_failures"] = {"log_lines_per_s": 1000}

    path = _edge_yaml(config_path, EDGE_DIR / name / "tokengate.yaml", edit, usage)
    port = free_port()
    status_port = free_port()
    svc = devstack.nginx_service(path, port=port, counter_socket=TEST_DIR / "counter.sock",
                                 name=svc_name(f"test-{name}"), prefix=EDGE_DIR / name,
                                 status_port=status_port)
    svc.start()
    try:
        yield Edge(f"http://127.0.0.1:{port}/v1", port, usage, svc, status_port), log
    finally:
        svc.stop()


def test_every_request_is_logged_or_not_by_the_rule(sampled_edge: tuple[Edge, Path]) -> None:
    edge, log = sampled_edge
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    good = {"Authorization": f"Bearer {MAIN_KEY}"}

    def send(i: int) -> httpx.Response:
        url = edge.base_url
        if i < 60:     # forwarded, slower than slow_ms: the slow tier
            return httpx.post(f"{url}/chat/completions", headers=good, json=chat, timeout=60)
        if i < 210:    # answered by the edge at once: the sampled tier
            return httpx.get(f"{url}/models", headers=good, timeout=60)
        if i < 230:    # 401: no usage event, a line in the unauthenticated tier
            return httpx.get(f"{url}/models", headers={"Authorization": "Bearer nope"},
                             timeout=60)
        return httpx.post(f"{url}/chat/completions", content=b'{"model": ', timeout=60,
                          headers={**good, "Content-Type": "application/json"})  # 400: always

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(250)))
    statuses = sorted({r.status_code for r in answers})
    assert statuses == [200, 400, 401]
    events = {r.headers["x-request-id"]: edge.event(r.headers["x-request-id"])
              for r in answers if r.status_code != 401}
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    logged = {x["request_id"]: x for x in lines if x["tier"] != "unauthenticated"}
    refused = {x["request_id"]: x for x in lines if x["tier"] == "unauthenticated"}
    assert len(logged) + len(refused) == len(lines)
    # without a valid key: no usage event, and a line (log_lines_per_s is above the burst)
    assert set(refused) == {r.headers["x-request-id"] for r in answers if r.status_code == 401}
    assert {(x["status"], x["key_id"], x["error"], x["sample_rate"], x["client"])
            for x in refused.values()} == {(401, None, "invalid_api_key", None, "127.0.0.1")}
    rules = AccessLogConfig(**RULES)
    want = {rid for rid, ev in events.items() if keep(rid, ev["status"], ev["total_ms"], rules)}
    assert set(logged) == want
    tiers = {"error": 0, "slow": 0, "sampled": 0}
    for rid, x in logged.items():
        ev = events[rid]
        assert (x["status"], x["total_ms"], x["token_estimate"], x["key_id"]) == \
            (ev["status"], ev["total_ms"], ev["token_estimate"], ev["key_id"])
        tier = "error" if ev["status"] >= 400 else "slow" if ev["total_ms"] > 30 else "sampled"
        assert (x["tier"], x["sample_rate"]) == \
            (tier, {"error": 1, "slow": 0.5, "sampled": 0.25}[tier])
        tiers[tier] += 1
    # every error is there; each sampled tier kept some and dropped some
    assert tiers["error"] == 20
    slow = [rid for rid, ev in events.items() if ev["status"] < 400 and ev["total_ms"] > 30]
    fast = [rid for rid, ev in events.items() if ev["status"] < 400 and ev["total_ms"] <= 30]
    assert len(slow) + len(fast) == 210
    assert 0 < tiers["slow"] < len(slow) and 0 < tiers["sampled"] < len(fast)
    forwarded = [x for x in lines if x["uri"] == "/v1/chat/completions" and x["status"] == 200]
    assert all(x["token_estimate"] > 0 and x["limits"] == "local" for x in forwarded)
    m = edge.status()
    assert m["access_log_lines"] == len(lines)
    assert (m["unauthenticated_log_lines"], m["unauthenticated_invalid_key"]) == (20, 20)
