"""The edge when its neighbours fail or leave: counter down or slow (fail open with an
estimate, or fail closed), vLLM down or broken (502/503 in OpenAI shape, Retry-After,
never a hang), a client that disconnects mid-stream (billed what was generated, vLLM
stops), usage-file rotation, configuration reload, and a clean error log.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from tokengate.tools import compile_config
from tokengate_dev import devstack

from tests.conftest import (
    MODEL,
    PORT_OFFSET,
    RUN_STARTED,
    TEST_DIR,
    VLLM_PORT,
    key_digest,
    read_until_closed,
)
from tests.fixtures_edge import (
    EDGE_DIR,
    KEYS,
    MAIN_KEY,
    Edge,
    FakeUpstream,
    FixedCounter,
    fake_counter,
    fixed_reply,
    free_port,
    session_for,
)

HEADERS = {"Authorization": f"Bearer {MAIN_KEY}", "Content-Type": "application/json"}


def chat(content: str = "hi", max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True, **extra}


def post(edge: Edge, body: dict[str, Any], key: str = MAIN_KEY,
         session: str | None = None) -> httpx.Response:
    data = json.dumps(body, separators=(",", ":"))
    headers = {**HEADERS, "Authorization": f"Bearer {key}"}
    if session is not None:
        headers["X-Session-Id"] = session
    return httpx.post(edge.base_url + "/chat/completions", content=data, timeout=60,
                      headers=headers)


def no_counter(tmp: str) -> Path:
    return EDGE_DIR / f"{tmp}-no-counter.sock"


def test_counter_down_fails_open_with_an_estimate(edge_variant: Callable[..., Edge]) -> None:
    e = edge_variant("counter-down", counter_socket=no_counter("open"))
    body = chat("How far is the moon?")
    t0 = time.monotonic()
    r = post(e, body)
    assert time.monotonic() - t0 < 5
    assert r.status_code == 200, r.text
    assert r.headers["x-token-count-source"] == "estimate"
    forwarded = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    assert int(r.headers["x-token-count"]) == math.ceil(len(forwarded) / 3)
    ev = e.event(r.headers["x-request-id"])
    assert (ev["count_source"], ev["token_estimate"], ev["usage_source"]) == \
        ("estimate", int(r.headers["x-token-count"]), "final")
    assert ev["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]


def test_an_estimate_over_a_keys_tpm_is_a_retryable_503_not_too_large(
        edge_variant: Callable[..., Edge]) -> None:
    """An estimate is an upper bound: "too large for the key, retrying cannot help" was
    said of prompts that fit once the counter answered again."""
    e = edge_variant("counter-down", counter_socket=no_counter("open"))
    r = post(e, chat("word " * 120), key="tg-test-edge-tpm")  # 120 TPM; ~210 estimated
    assert r.status_code == 503, r.text
    assert r.headers["x-token-count-source"] == "estimate"
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("server_error", "count_unavailable")
    assert err["message"].startswith("The prompt could not be counted in time (the estimate, "
                                     f"{r.headers['x-token-count']} tokens")


def test_counter_down_fails_closed_when_configured(edge_variant: Callable[..., Edge],
                                                   vllm_requests: Callable[[], int]) -> None:
    def closed(raw: dict[str, Any]) -> None:
        raw["edge"]["on_counter_failure"] = "closed"
    e = edge_variant("fail-closed", closed, counter_socket=no_counter("closed"))
    before = vllm_requests()
    r = post(e, chat())
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("server_error", "counter_unavailable")
    assert r.headers["retry-after"] == "1"
    assert vllm_requests() == before


def test_slow_counter_fails_open_within_its_timeout(edge_variant: Callable[..., Edge],
                                                    slow_counter: Path) -> None:
    def tight(raw: dict[str, Any]) -> None:
        raw["edge"]["count_timeout_ms"] = 300
    e = edge_variant("slow-counter", tight, counter_socket=slow_counter)
    t0 = time.monotonic()
    r = post(e, chat())
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.headers["x-token-count-source"] == "estimate"
    assert elapsed < 3, f"took {elapsed:.1f} s with a 300 ms count timeout"


def test_a_counter_outage_is_one_error_log_line_and_one_when_it_is_back(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    """nginx logged each failed connect of each request ([crit] connect() ... failed): a
    counter restart wrote 70 lines in 19 s."""
    def probe_each_request(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [fast_upstream_url.removeprefix("http://")
                                             .removesuffix("/v1")]
        raw["edge"]["counter_backoff_ms"] = 0  # no breaker: every request tries the counter
    path = no_counter("restart")
    for i in (0, 1):  # stopped counter workers withdraw their sockets
        path.with_name(f"{path.name}.{i}").unlink(missing_ok=True)
    e = edge_variant_off_vllm("counter-restart", probe_each_request, counter_socket=path)
    down = [post(e, chat(f"question {i}")) for i in range(10)]
    assert [r.headers["x-token-count-source"] for r in down] == ["estimate"] * 10
    with fake_counter(path, lambda request: fixed_reply(7)):
        back = [post(e, chat(f"again {i}")) for i in range(3)]
    assert [r.headers["x-token-count"] for r in back] == ["7"] * 3
    log = e.log_path.read_text()
    assert (log.count("[crit]"), log.count("counter unavailable"),
            log.count("counter answers again")) == (0, 1, 1), log[-3000:]
    assert "counter unavailable (down: connect: " in log


def test_a_counter_killed_under_traffic_is_one_outage_line_and_no_crit_connect(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str,
        config_path: Path) -> None:
    """A soak's counter kills wrote "[crit] connect() to unix:...counter.sock.N failed (2:
    No such file or directory)", 7 and 10 lines over 3 kills: a counter socket that had
    answered was connected to without a look for its file once nginx had dropped its
    pooled connections. The real counter here, killed (SIGKILL) and its workers stopped
    (their sockets withdrawn) as the supervisor does, then started again."""
    def probe_each_request(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [fast_upstream_url.removeprefix("http://")
                                             .removesuffix("/v1")]
        raw["edge"]["counter_backoff_ms"] = 0  # no breaker: every request tries the counter
    sock = TEST_DIR / "killed-counter.sock"
    counter = devstack.counter_service(config_path, port=free_port(), unix_socket=sock,
                                       workers=2, name=f"test-counter-killed{PORT_OFFSET or ''}")
    counter.start()
    try:
        e = edge_variant_off_vllm("counter-killed", probe_each_request, counter_socket=sock)
        before = [post(e, chat(f"before {i}")) for i in range(16)]
        assert {r.headers["x-token-count-source"] for r in before} == {"counter"}
        assert counter.proc is not None
        os.kill(counter.proc.pid, signal.SIGKILL)
        counter.proc.wait(30)
        counter.stop()  # its workers: SIGTERM, they withdraw their sockets
        assert not any(sock.parent.glob(f"{sock.name}.*"))
        down = [post(e, chat(f"down {i}")) for i in range(16)]
        assert {r.headers["x-token-count-source"] for r in down} == {"estimate"}
        counter.start()
        back = [post(e, chat(f"back {i}")) for i in range(4)]
        assert {r.headers["x-token-count-source"] for r in back} == {"counter"}
    finally:
        counter.stop()
    log = e.log_path.read_text()
    assert (log.count("[crit]"), log.count("counter unavailable"),
            log.count("counter answers again")) == (0, 1, 1), log[-3000:]


@pytest.mark.parametrize("death", ["refuses", "dies with the call"])
def test_a_dead_counter_worker_falls_through_to_the_other_one(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str,
        death: str) -> None:
    # counter worker 0 is dead: its socket refuses connections (the worker exited, the
    # file is left until the next one publishes its own), or it takes each call and
    # dies with it (the connection closes without an answer). Worker 1 counts.
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [fast_upstream_url.removeprefix("http://")
                                             .removesuffix("/v1")]
    calls = []

    def count(request: Any) -> Any:
        calls.append(request.model)
        return fixed_reply(7)
    path = EDGE_DIR / "dead-worker-counter.sock"
    with fake_counter(path, count, broken=0 if death != "refuses" else None) as sock:
        if death == "refuses":
            with socket.socket(socket.AF_UNIX) as s:  # a socket nobody listens on
                worker0 = path.with_name(f"{path.name}.0")
                worker0.unlink()
                s.bind(str(worker0))
        e = edge_variant_off_vllm("dead-worker", edit, counter_socket=sock)
        # every call prefers worker 0 (its session's affinity): each meets the dead one
        answers = [post(e, chat(f"question {i}", max_tokens=1), session=session_for(0))
                   for i in range(12)]
    assert [(r.status_code, r.headers["x-token-count-source"], r.headers["x-token-count"])
            for r in answers] == [(200, "counter", "7")] * 12
    assert len(calls) == 12
    assert e.status()["counter_backing_off"] is False


def test_a_large_body_gets_the_count_deadline_per_256_kib(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    # a counter that takes 450 ms for every call; count_timeout_ms 300 per started 256 KiB
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [fast_upstream_url.removeprefix("http://")
                                             .removesuffix("/v1")]
        raw["edge"]["count_timeout_ms"] = 300
        raw["edge"]["counter_backoff_ms"] = 0

    def slow(request: Any) -> Any:
        time.sleep(0.45)
        return fixed_reply(7)
    with fake_counter(EDGE_DIR / "deadline-counter.sock", slow) as sock:
        e = edge_variant_off_vllm("count-deadline", edit, counter_socket=sock)
        small = post(e, chat("hi", max_tokens=1))
        large = post(e, chat("word " * 60000, max_tokens=1))  # 300 KB: 2 x 300 ms
    assert (small.status_code, small.headers["x-token-count-source"]) == (200, "estimate")
    assert (large.status_code, large.headers["x-token-count-source"],
            large.headers["x-token-count"]) == (200, "counter", "7")


def test_counts_of_identical_bodies_are_cached_per_worker(
        edge_variant: Callable[..., Edge], fixed_counter: FixedCounter) -> None:
    e = edge_variant("count-cache", counter_socket=fixed_counter.path)
    for _ in range(8):
        r = post(e, chat("the same body every time"))
        assert r.status_code == 200
        assert (r.headers["x-token-count"], r.headers["x-token-count-source"]) == ("7", "counter")
    assert 1 <= fixed_counter.calls <= 2  # at most once per nginx worker
    post(e, chat("another body"))
    assert fixed_counter.calls <= 4


def test_vllm_down_is_502_with_retry_after(edge_variant_off_vllm: Callable[..., Edge]) -> None:
    port = free_port()  # nothing listens there

    def dead(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{port}"]
    e = edge_variant_off_vllm("vllm-down", dead)
    t0 = time.monotonic()
    r = post(e, chat())
    assert time.monotonic() - t0 < 5
    assert r.status_code == 502, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("server_error", "upstream_unavailable")
    assert r.headers["retry-after"] == "5"
    ev = e.event(r.headers["x-request-id"])
    assert (ev["status"], ev["error"], ev["usage_source"]) == (502, "upstream_unavailable", "none")
    # the reservation went back: the next answer shows the whole budget again
    r2 = post(e, chat())
    assert int(r2.headers["x-ratelimit-remaining-tokens"]) == \
        KEYS["edge-main"][2] - int(r2.headers["x-token-count"]) - 2


def _edge_on(edge_variant: Callable[..., Edge], name: str, up: FakeUpstream) -> Edge:
    def fake(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{up.port}"]
    return edge_variant(name, fake)


def test_backend_closing_without_answer_is_502(edge_variant_off_vllm: Callable[..., Edge],
                                               fake_upstream: Callable[[str], FakeUpstream]
                                               ) -> None:
    up = fake_upstream("close")
    e = _edge_on(edge_variant_off_vllm, "backend-close", up)
    r = post(e, chat())
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"
    assert r.headers["retry-after"] == "5"
    assert up.requests == 1, "a POST must not be retried"


@pytest.mark.parametrize(("status", "message", "etype"), [
    (500, "The model backend failed with HTTP 500.", "server_error"),
    (413, "The model backend refused the request with HTTP 413.", "invalid_request_error"),
])
def test_backend_html_error_becomes_openai_shape(edge_variant_off_vllm: Callable[..., Edge],
                                                 fake_upstream: Callable[[str], FakeUpstream],
                                                 status: int, message: str, etype: str
                                                 ) -> None:
    """A backend's (or a proxy's in front of it) non-JSON error keeps its status and
    becomes OpenAI's error shape: a 4xx is the request's fault, not a server error."""
    e = _edge_on(edge_variant_off_vllm, f"backend-html{status}", fake_upstream(f"html{status}"))
    r = post(e, chat())
    assert r.status_code == status
    assert r.json() == {"error": {"message": message, "type": etype, "param": None,
                                  "code": "upstream_error"}}


def test_backend_dying_mid_stream_bills_the_last_usage(
        edge_variant_off_vllm: Callable[..., Edge],
        fake_upstream: Callable[[str], FakeUpstream]) -> None:
    e = _edge_on(edge_variant_off_vllm, "backend-crash", fake_upstream("crash_stream"))
    with httpx.stream("POST", e.base_url + "/chat/completions", headers=HEADERS,
                      content=json.dumps(chat(stream=True, max_tokens=50)), timeout=30) as r:
        rid = r.headers["x-request-id"]
        try:
            text = b"".join(r.iter_raw()).decode()
        except httpx.HTTPError:
            text = ""
    ev = e.event(rid)
    assert (ev["usage_source"], ev["completion_tokens"], ev["client_aborted"], ev["error"]) == \
        ("running", 3, False, "upstream_incomplete")
    assert '"usage"' not in text  # the client did not ask for usage


def test_vllm_error_passes_through(edge: Edge) -> None:
    # vLLM refuses n > 1 with greedy sampling; its OpenAI-shaped error reaches the client
    r = post(edge, chat(n=2, temperature=0))
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    ev = edge.event(r.headers["x-request-id"])
    assert ev["status"] == 400 and ev["usage_source"] == "none" and ev["error"]


def _vllm_metric(name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{VLLM_PORT}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def test_client_disconnect_mid_stream_is_billed_what_was_generated(edge: Edge) -> None:
    client = openai.OpenAI(base_url=edge.base_url, api_key=MAIN_KEY, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
    stream = raw.parse()
    for seen, _chunk in enumerate(stream, 1):
        if seen == 6:
            break
    stream.close()
    ev = edge.event(raw.headers["x-request-id"], timeout_s=30)
    assert ev["client_aborted"] is True and ev["status"] == 200
    assert ev["usage_source"] == "running"
    assert 5 <= ev["completion_tokens"] < 3000
    assert ev["prompt_tokens"] == int(raw.headers["x-token-count"])
    # vLLM stopped generating for it
    deadline = time.monotonic() + 20
    while _vllm_metric("vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _vllm_metric("vllm:num_requests_running") == 0
    assert ev["total_ms"] < 15000


def test_client_abort_of_a_non_streaming_request_is_billed_its_reservation(
        edge_variant_off_vllm: Callable[..., Edge]) -> None:
    # A backend that takes 3 s to answer (vLLM busy generating); the client gives up
    # after 0.5 s. No usage ever comes back, so the reservation is billed, not refunded.
    from tokengate_dev import devstack

    port = free_port()
    up = devstack.fast_upstream_service(port=port, ttft_ms=3000,
                                        name=f"abort-upstream{os.getpid()}").start()
    try:
        def slow(raw: dict[str, Any]) -> None:
            raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{port}"]
        e = edge_variant_off_vllm("client-abort", slow)
        with e.window_clock():
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(e.base_url + "/chat/completions", timeout=0.5, headers=HEADERS,
                           content=json.dumps(chat("Tell a long story.", max_tokens=100)))
            deadline = time.monotonic() + 10
            while not [ev for ev in e.events() if ev["status"] == 499]:
                assert time.monotonic() < deadline, "no usage event for the aborted request"
                time.sleep(0.05)
            ev = next(ev for ev in e.events() if ev["status"] == 499)
            prompt = ev["token_estimate"]
            assert (ev["client_aborted"], ev["usage_source"], ev["reserved"], ev["prompt_tokens"],
                    ev["completion_tokens"], ev["error"]) == \
                (True, "estimate", prompt + 100, prompt, 100, None)
            # the limiter keeps the whole reservation: a refused request shows what is left
            r = post(e, chat(max_tokens=0))
            assert r.status_code == 400
            assert int(r.headers["x-ratelimit-remaining-tokens"]) == \
                KEYS["edge-main"][2] - (prompt + 100)
    finally:
        up.stop()


def test_usage_file_survives_rotation(edge: Edge) -> None:
    first = post(edge, chat())
    edge.event(first.headers["x-request-id"])
    rotated = edge.usage_file.with_name(f"usage.jsonl.rotated-{os.getpid()}")
    edge.usage_file.rename(rotated)
    # nginx keeps the file open: a line written before the reopen lands in the renamed
    # file (the ledger finishes it); `nginx -s reopen` (SIGUSR1) starts the new one
    between = post(edge, chat())
    deadline = time.monotonic() + 5
    while between.headers["x-request-id"] not in rotated.read_text():
        assert time.monotonic() < deadline, "the line before the reopen went elsewhere"
        time.sleep(0.05)
    prefix = Path(edge.service.argv[edge.service.argv.index("-p") + 1])
    os.kill(int((prefix / "nginx.pid").read_text()), signal.SIGUSR1)
    # each worker reopens when the master tells it: until then its lines still go to
    # the renamed file, never anywhere else
    after: list[str] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after.append(post(edge, chat()).headers["x-request-id"])
        if edge.usage_file.exists() and after[-1] in edge.usage_file.read_text():
            break
    new = [json.loads(x)["request_id"] for x in edge.usage_file.read_text().splitlines()]
    old = rotated.read_text()
    assert new and set(new) <= set(after)
    assert all((rid in old) != (rid in new) for rid in after)
    assert first.headers["x-request-id"] in old


def test_reload_reads_the_recompiled_config(edge_variant: Callable[..., Edge]) -> None:
    e = edge_variant("reload")
    assert post(e, chat(), key="tg-added-later").status_code == 401
    prefix = Path(e.service.argv[e.service.argv.index("-p") + 1])
    yaml_path = EDGE_DIR / "reload" / "tokengate.yaml"
    import yaml
    raw = yaml.safe_load(yaml_path.read_text())
    raw["keys"]["added"] = {"sha256": key_digest("tg-added-later"), "rpm": 7, "tpm": 7000}
    yaml_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    compile_config.write(yaml_path, prefix / "edge.json")
    os.kill(int((prefix / "nginx.pid").read_text()), signal.SIGHUP)
    deadline = time.monotonic() + 10
    while True:
        r = post(e, chat(), key="tg-added-later")
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-limit-requests"] == "7"


def _workers(master: int) -> set[int]:
    """The pids of nginx's worker processes (the master's children)."""
    return {int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()}


def _edge_and_master(start: Callable[..., Edge], name: str,
                     upstream_url: str) -> tuple[Edge, int]:
    """An edge whose model is served by the upstream at ``upstream_url``, and the pid of
    its nginx master (what a reload is sent to)."""
    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [upstream_url.removeprefix("http://")
                                             .removesuffix("/v1")]
    e = start(name, edit)
    master = int((Path(e.service.argv[e.service.argv.index("-p") + 1]) / "nginx.pid")
                 .read_text())
    return e, master


def test_an_answer_from_a_worker_shutting_down_says_connection_close(
        edge_variant_off_vllm: Callable[..., Edge], slow_upstream_url: str) -> None:
    """An old worker closes the connection after the answer it was serving when nginx
    reloaded; its answer said keep-alive, so a client sent its next request on it and
    met a reset."""
    e, master = _edge_and_master(edge_variant_off_vllm, "reload-close", slow_upstream_url)
    body = json.dumps(chat("hi", max_tokens=3000)).encode()  # 2 ms a token: ~6 s
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Authorization: Bearer " + MAIN_KEY.encode() + b"\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
               + body)
    with socket.create_connection(("127.0.0.1", e.port), timeout=60) as s:
        s.sendall(request)
        old = _workers(master)
        os.kill(master, signal.SIGHUP)
        deadline = time.monotonic() + 30
        while not _workers(master) - old:  # the new workers started: the old ones exit
            assert time.monotonic() < deadline, "no new workers"
            time.sleep(0.05)
        data = read_until_closed(s)
    # the old worker exits once the request's log phase and settlement timers are done;
    # stopping the edge before that ends it with their sockets open ([alert] in the log)
    while _workers(master) & old:
        assert time.monotonic() < deadline + 30, "an old worker did not exit"
        time.sleep(0.05)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    connection = [v.strip().lower() for k, _, v in (x.partition(":") for x in lines[1:])
                  if k.lower() == "connection"]
    assert (lines[0], "close" in connection) == ("HTTP/1.1 200 OK", True)
    assert json.loads(rest)["usage"]["completion_tokens"] == 3000


def test_reloads_under_a_steady_stream_reset_only_idle_reused_connections(
        edge_variant_off_vllm: Callable[..., Edge], fast_upstream_url: str) -> None:
    """`config apply` and SIGHUP reload nginx: four requests of a soak got a reset, no
    answer and no event. Keep-alive clients and new connections, streamed and not, send
    without pause through five reloads. A new connection is never reset (the listening
    socket is the master's, handed to the new workers). A reused one can be: the old
    worker closes its idle keep-alive connections at once, and the connections whose
    answer began before the reload right after that answer, and a request sent in that
    instant meets the close. nginx never read such a request (no usage event), so a
    client retries it on a new connection, as the openai and anthropic SDKs do."""
    e, master = _edge_and_master(edge_variant_off_vllm, "reload-stream", fast_upstream_url)
    stop = threading.Event()
    answered: list[int] = []
    resets: list[str] = []

    def client(stream: bool, keepalive: bool) -> None:
        body = chat("hi", max_tokens=4)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        with httpx.Client(timeout=30, headers=HEADERS) as c:
            while not stop.is_set():
                for attempt in (1, 2):  # the retry an SDK makes on a reset
                    try:
                        if keepalive:
                            r = c.post(e.base_url + "/chat/completions", json=body)
                        else:
                            r = httpx.post(e.base_url + "/chat/completions", json=body,
                                           headers=HEADERS, timeout=30)
                        answered.append(r.status_code)
                        break
                    except httpx.TransportError as err:
                        resets.append(f"{type(err).__name__} (stream={stream}, "
                                      f"keepalive={keepalive}, attempt {attempt})")
    threads = [threading.Thread(target=client, args=(stream, keepalive), daemon=True)
               for stream in (False, True) for keepalive in (True, True, False)]
    for t in threads:
        t.start()
    try:
        for _ in range(5):
            old = _workers(master)
            seen = len(answered)
            os.kill(master, signal.SIGHUP)
            wait = time.monotonic() + 30
            # the old workers gone, and requests answered since by the new ones
            while _workers(master) & old or len(answered) < seen + 50:
                assert time.monotonic() < wait, "the reload did not finish"
                time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert [x for x in resets if "keepalive=False" in x or "attempt 2" in x] == []
    assert set(answered) == {200}
    deadline = time.monotonic() + 10
    while len(e.events()) < len(answered):  # the log phase runs after the answer
        assert time.monotonic() < deadline, "an answered request has no event"
        time.sleep(0.05)
    assert len(e.events()) == len(answered)  # none for a request that met a reset


# a worker the test itself killed with SIGKILL (tests/edge/test_edge_queue.py's kills,
# on any xdist worker, in any order): nginx's own [alert] for it, not a fault of the edge
_KILLED = re.compile(r"^.*\[alert\] \d+#\d+: worker process \d+ exited on signal 9\n?",
                     re.MULTILINE)


def test_error_logs_have_no_lua_errors(edge: Edge) -> None:
    """The error logs of every edge this run started (any xdist worker's; a log of an
    earlier run left in var/ is not this run's) hold no Lua error and no [alert]."""
    logs = [edge.log_path, *(log for log in edge.log_path.parent.glob("test-nginx-*.log")
                             if log.stat().st_mtime >= RUN_STARTED)]
    for log in logs:
        text = _KILLED.sub("", log.read_text(errors="replace"))
        for bad in ("writing a global Lua variable", "runtime error", "[alert]", "[emerg]",
                    "lua entry thread aborted"):
            assert bad not in text, f"{log.name}: {bad}"
