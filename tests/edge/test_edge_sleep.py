"""Idle unload: a replica idle for ``models.<name>.idle_unload.idle_s`` is put to sleep
through vLLM's sleep mode (``POST /sleep``); the next request wakes it (``POST /wake_up``)
and is held until it is awake, or answered 503 ``model_waking`` with ``Retry-After`` when
the wake takes longer than ``max_hold_ms``. A replica with a request in flight never
sleeps.

vLLM's CPU build refuses sleep mode, so the replicas are TokenStorm's fast upstream, which
serves vLLM's sleep routes (with a settable wake delay) and counts the requests that
reached it asleep; the routes and their flags are checked here against the installed
vLLM's source. The GPU run is a step of ``dev/gpu_check.sh``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from tokenstorm.null_server import FastUpstream

from tests.conftest import MODEL
from tests.fixtures_edge import EDGE_DIR, MAIN_KEY, PORT_OFFSET, Edge, at_once

HEADERS = {"Authorization": f"Bearer {MAIN_KEY}", "Content-Type": "application/json"}


def _edge(edge_variant_off_vllm: Callable[..., Edge], name: str, ups: list[FastUpstream],
          **idle: Any) -> Edge:
    def edit(raw: dict[str, Any]) -> None:
        m = raw["models"][MODEL]
        m["upstreams"] = [f"127.0.0.1:{u.port}" for u in ups]
        m["embedded"] = False
        m["idle_unload"] = {"idle_s": 1, **idle}
    return edge_variant_off_vllm(name, edit)


def _counts(up: FastUpstream, **values: float) -> dict[str, float]:
    """The fast upstream's sleep counts (sleeps, wakes, queued_asleep); sets ``values``
    (wake_delay_ms) first."""
    url = f"http://127.0.0.1:{up.port}/tokenstorm/metrics"
    r = httpx.post(url, json=values, timeout=5) if values else httpx.get(url, timeout=5)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _wait(what: Callable[[], bool], why: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)


def _asleep(e: Edge, up: FastUpstream) -> bool:
    return bool(e.status()["upstreams"][MODEL][f"127.0.0.1:{up.port}"]["asleep"])


def _fell_asleep(e: Edge, up: FastUpstream, sleeps: int = 1) -> None:
    _wait(lambda: _counts(up)["sleeps"] >= sleeps and _asleep(e, up),
          f"127.0.0.1:{up.port} was not put to sleep")


def _both_asleep(edge_variant_off_vllm: Callable[..., Edge],
                 replicas: Callable[..., FastUpstream], name: str, idle_s: float,
                 **replica: Any) -> tuple[Edge, FastUpstream, FastUpstream]:
    """An edge of two replicas (``replicas(**replica)``) that idle unload (``idle_s``)
    has put to sleep: (the edge, replica a, replica b)."""
    a, b = replicas(**replica), replicas(**replica)
    e = _edge(edge_variant_off_vllm, name, [a, b], idle_s=idle_s)
    _fell_asleep(e, a)
    _fell_asleep(e, b)
    return e, a, b


def _client(e: Edge) -> openai.OpenAI:
    return openai.OpenAI(base_url=e.base_url, api_key=MAIN_KEY, max_retries=0, timeout=60)


def _chat(e: Edge, max_tokens: int = 4) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens}
    return httpx.post(e.base_url + "/chat/completions", content=json.dumps(body),
                      headers=HEADERS, timeout=60)


@pytest.mark.unit
def test_the_installed_vllm_serves_sleep_mode_only_with_dev_mode() -> None:
    # read from the source: the routes the edge calls, and the flags that enable them
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations)))
    routes = (root / "entrypoints" / "serve" / "dev" / "sleep" / "api_router.py").read_text()
    for route in ('@router.post("/sleep")', '@router.post("/wake_up")',
                  '@router.get("/is_sleeping")'):
        assert route in routes
    assert 'content={"status": "sleeping", "level": level}' in routes
    assert 'content={"status": "awake" if fully_awake else "sleeping", "tags": tags}' in routes
    assert 'content={"is_sleeping": is_sleeping}' in routes
    # /sleep's default mode aborts what the engine holds: the edge sleeps only idle replicas
    assert re.search(r'mode: Annotated\[PauseMode, Query\(\)\] = "abort"', routes)
    launcher = (root / "entrypoints" / "launchers" / "api_server" / "routers.py").read_text()
    assert re.search(r"if envs\.VLLM_SERVER_DEV_MODE:\s+from vllm\.entrypoints\.serve import "
                     r"register_vllm_dev_api_routers", launcher)
    assert '"--enable-sleep-mode"' in (root / "engine" / "arg_utils.py").read_text()


def test_the_fast_upstream_sleeps_queues_and_wakes(
        replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    base = f"http://127.0.0.1:{up.port}"
    r = httpx.post(base + "/sleep?level=1", timeout=5)
    assert (r.status_code, r.json()) == (200, {"status": "sleeping", "level": 1})
    assert httpx.get(base + "/is_sleeping", timeout=5).json() == {"is_sleeping": True}
    assert httpx.post(base + "/sleep?level=3", timeout=5).status_code == 422
    # a request to a sleeping engine is queued, not refused, until a wake
    answers: list[httpx.Response] = []
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    t = threading.Thread(target=lambda: answers.append(
        httpx.post(up.url + "/chat/completions", json=chat, timeout=30)))
    t.start()
    _wait(lambda: _counts(up)["queued_asleep"] == 1, "the request was not queued")
    assert not answers
    r = httpx.post(base + "/wake_up", timeout=5)
    assert (r.status_code, r.json()) == (200, {"status": "awake", "tags": None})
    t.join(10)
    assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 3
    assert httpx.get(base + "/is_sleeping", timeout=5).json() == {"is_sleeping": False}
    assert {k: _counts(up)[k] for k in ("sleeps", "wakes", "queued_asleep")} == \
        {"sleeps": 1, "wakes": 1, "queued_asleep": 1}


def test_an_idle_replica_sleeps_and_the_next_request_wakes_it(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    e = _edge(edge_variant_off_vllm, "sleep-wake", [up], idle_s=1, max_hold_ms=20000)
    _fell_asleep(e, up)
    assert e.status()["idle_sleeps"] >= 1
    sleeps = _counts(up, wake_delay_ms=500)["sleeps"]
    # vLLM's dev-mode routes are the edge's to call, never a client's
    root = e.base_url.removesuffix("/v1")
    for path in ("/sleep?level=1", "/v1/../sleep", "/v1/sleep", "/wake_up", "/collective_rpc"):
        r = httpx.post(root + path, headers=HEADERS, timeout=10)
        assert r.status_code == 404, (path, r.text)
    assert (_counts(up)["sleeps"], _counts(up)["wakes"]) == (sleeps, 0)
    raw = _client(e).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=5)
    reply = raw.parse()
    assert raw.status_code == 200
    prompt = int(raw.headers["x-token-count"])
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt, 5)
    # woken once, before the request was forwarded: nothing reached it asleep
    c = _counts(up)
    assert (c["wakes"], c["queued_asleep"]) == (1, 0)
    ev = e.event(raw.headers["x-request-id"])
    assert {k: ev[k] for k in ("status", "error", "prompt_tokens", "completion_tokens",
                               "usage_source", "upstream")} == \
        {"status": 200, "error": None, "prompt_tokens": prompt, "completion_tokens": 5,
         "usage_source": "final", "upstream": f"127.0.0.1:{up.port}"}
    st = e.status()
    assert (st["idle_held"], st["idle_wakes"], st["idle_wake_timeouts"]) == (1, 1, 0)
    assert st["upstreams"][MODEL][f"127.0.0.1:{up.port}"]["outstanding_tokens"] == 0


def test_a_wake_slower_than_the_bound_is_503_then_the_next_request_is_served(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    up = replicas()
    e = _edge(edge_variant_off_vllm, "sleep-slow", [up], idle_s=3, max_hold_ms=300,
              retry_after_s=2)
    _fell_asleep(e, up)
    _counts(up, wake_delay_ms=2000)
    r = _chat(e)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "2"
    assert r.json() == {"error": {
        "message": f"Model {MODEL} is waking up from idle (its replica was put to sleep) and "
                   "was not ready within 300 ms. Please retry after 2 s.",
        "type": "server_error", "param": None, "code": "model_waking"}}
    ev = e.event(r.headers["x-request-id"])
    assert {k: ev[k] for k in ("status", "error", "prompt_tokens", "completion_tokens")} == \
        {"status": 503, "error": "model_waking", "prompt_tokens": 0, "completion_tokens": 0}
    # the wake goes on without the request; once awake the next request is served at once
    _wait(lambda: not _asleep(e, up), "the replica did not wake")
    ok = _chat(e)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 4
    assert e.event(ok.headers["x-request-id"])["completion_tokens"] == 4
    c = _counts(up)
    assert (c["wakes"], c["queued_asleep"]) == (1, 0)
    st = e.status()
    assert (st["idle_held"], st["idle_wake_timeouts"], st["idle_wakes"]) == (1, 1, 1)


def test_a_replica_never_sleeps_under_a_stream(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    # 40 tokens 100 ms apart: a 4 s stream on a replica whose idle_s is 1
    up = replicas(itl_ms=100)
    e = _edge(edge_variant_off_vllm, "sleep-stream", [up], idle_s=1)
    _fell_asleep(e, up)
    raw = _client(e).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=40,
        stream=True, stream_options={"include_usage": True})
    chunks = list(raw.parse())
    pieces = [ch.choices[0].delta.content for ch in chunks if ch.choices]
    assert "".join(p or "" for p in pieces) == " tok" * 40   # not cut short by a /sleep
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 40
    # no sleep while it ran: one sleep before, one wake for it
    c = _counts(up)
    assert (c["sleeps"], c["wakes"], c["queued_asleep"]) == (1, 1, 0)
    ev = e.event(raw.headers["x-request-id"])
    assert (ev["status"], ev["completion_tokens"], ev["prompt_tokens"]) == \
        (200, 40, usage.prompt_tokens)
    # idle again after it ended: asleep again
    _fell_asleep(e, up, sleeps=2)


def test_light_traffic_stays_on_the_awake_replica(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    e, a, b = _both_asleep(edge_variant_off_vllm, replicas, "sleep-two", 1)
    first = _chat(e)
    assert first.status_code == 200
    # the next requests go to the replica that is awake, not to the sleeping one
    served = {first.headers["x-tokengate-upstream"]}
    for _ in range(3):
        r = _chat(e)
        assert r.status_code == 200
        served.add(r.headers["x-tokengate-upstream"])
    assert len(served) == 1
    assert _counts(a)["wakes"] + _counts(b)["wakes"] == 1


def _apply(e: Edge, name: str, **idle: Any) -> None:
    """``tokengate config apply`` of the edge's own file with ``idle_unload`` changed: the
    edge's nginx reloads (new workers, the same shared dicts)."""
    path = EDGE_DIR / name / "tokengate.yaml"
    raw = yaml.safe_load(path.read_text())
    raw["models"][MODEL]["idle_unload"].update(idle)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "tokengate.cli", "config", "apply", str(path),
                        "--edge", str(EDGE_DIR / f"test-nginx-{name}{PORT_OFFSET or ''}")],
                       capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr


def test_turning_idle_unload_off_wakes_the_replicas_it_put_to_sleep(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    e, a, b = _both_asleep(edge_variant_off_vllm, replicas, "sleep-off", 1, ttft_ms=500)
    _apply(e, "sleep-off", idle_s=0)
    # nothing would wake the one that ranks last: the edge wakes both, once each
    _wait(lambda: not _asleep(e, a) and not _asleep(e, b), "a replica stayed marked asleep")
    for up in (a, b):
        assert {k: _counts(up)[k] for k in ("sleeps", "wakes")} == {"sleeps": 1, "wakes": 1}
        assert httpx.get(f"http://127.0.0.1:{up.port}/is_sleeping",
                         timeout=5).json() == {"is_sleeping": False}
    # and both serve: 8 requests at once split 4/4
    answers = at_once(8, lambda: _chat(e))
    assert [r.status_code for r in answers] == [200] * 8
    assert Counter(r.headers["x-tokengate-upstream"] for r in answers) == \
        {f"127.0.0.1:{a.port}": 4, f"127.0.0.1:{b.port}": 4}
    assert (_counts(a)["queued_asleep"], _counts(b)["queued_asleep"]) == (0, 0)


def test_a_replica_woken_by_hand_is_seen_awake(
        edge_variant_off_vllm: Callable[..., Edge],
        replicas: Callable[..., FastUpstream]) -> None:
    e, a, b = _both_asleep(edge_variant_off_vllm, replicas, "sleep-by-hand", 3)
    r = httpx.post(f"http://127.0.0.1:{a.port}/wake_up", timeout=5)
    assert r.json() == {"status": "awake", "tags": None}
    _wait(lambda: not _asleep(e, a), "the replica woken by hand stayed marked asleep")
    # the awake one takes the request; the one still asleep is not woken for it
    served = _chat(e)
    assert (served.status_code, served.headers["x-tokengate-upstream"]) == \
        (200, f"127.0.0.1:{a.port}")
    assert (_counts(a)["wakes"], _counts(b)["wakes"], _counts(a)["queued_asleep"]) == (1, 0, 0)
    assert _asleep(e, b)
