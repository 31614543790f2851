"""The batch worker's choices that need no process: which batch sends next (keys take
turns, then a key's batches), the window's slow start, halving and one-line cut, the
pacing of sends, the usage of an answer in each API's shape."""

from __future__ import annotations

import itertools
import json
import socket
import threading
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import pytest
import redis
from tokengate import config as tg_config
from tokengate.batch.edge import Answer, EdgeClient
from tokengate.batch.lines import Line, parse
from tokengate.batch.worker import REFUSED_PAUSE_S, Worker, _Batch, retryable, usage_of

pytestmark = pytest.mark.unit


def worker(config_path: Path, max_in_flight: int = 64) -> Worker:
    cfg = tg_config.load(config_path)
    cfg = cfg.model_copy(update={"batch": cfg.batch.model_copy(
        update={"max_in_flight": max_in_flight})})
    return Worker(cfg, store=None, edge=None)  # type: ignore[arg-type]


def test_keys_take_turns_then_a_keys_batches(config_path: Path) -> None:
    w = worker(config_path)
    for batch_id, key in (("a1", "a"), ("a2", "a"), ("b1", "b")):
        w.running[batch_id] = _Batch(batch_id, key, "/v1/chat/completions", [],
                                     deque(range(100)))
    picks = []
    for _ in range(8):
        b = w._next_batch()
        assert b is not None
        picks.append(b.batch_id)
    assert [p[0] for p in picks] == ["b", "a"] * 4
    assert {p for p in picks if p[0] == "a"} == {"a1", "a2"}
    assert picks.count("b1") == 4


def test_window_slow_starts_then_halves_on_a_refusal_then_grows_one_per_window_or_ten(
        config_path: Path) -> None:
    w = worker(config_path, max_in_flight=64)
    for _ in range(10):
        w._grow()
    assert w.window == 12.0
    w._refused(None)
    assert (w.window, w.slow_start_until) == (6.0, 6.0)
    assert w.paused_until > 0
    for _ in range(6):
        w._grow()
    assert 6.9 < w.window < 7.0  # about one more after a window (6) of answers
    w.window = 30.0
    for _ in range(10):
        w._grow()
    assert w.window == pytest.approx(31.0)  # a large window: one more per 10 answers
    for _ in range(100):
        w._grow()
    w._refused(None)
    w.window = 63.5
    w.slow_start_until = 64.0
    w._grow()
    assert w.window == 64.0  # never above batch.max_in_flight


def test_an_overloaded_refusal_takes_one_line_off_the_window_briefly(
        config_path: Path) -> None:
    w = worker(config_path, max_in_flight=64)
    w.clock = lambda: 100.0
    w.window = 40.0
    w._refused(None, by_one=True)
    assert (w.window, w.slow_start_until) == (39.0, 39.0)
    assert w.paused_until == 100.0 + REFUSED_PAUSE_S[0]
    w.window = 1.0
    w._refused(None, by_one=True)
    assert w.window == 1.0
    w.window = 40.0
    w._refused(5.0)  # a limit's refusal: half, and its Retry-After within the bounds
    assert (w.window, w.paused_until) == (20.0, 100.0 + REFUSED_PAUSE_S[1])


class _Attempts:
    """The one Store call sending a line makes: every line on its first attempt."""

    def attempt(self, batch_id: str, index: int) -> int:
        return 0


class _Unanswered:
    """An edge that never answers (the test looks only at what leaves)."""

    post = None


def test_lines_leave_paced_over_the_smoothed_round_trip(config_path: Path) -> None:
    w = worker(config_path, max_in_flight=64)
    w.store, w.edge = _Attempts(), _Unanswered()  # type: ignore[assignment]
    w.pool.submit = lambda *a: Future()  # type: ignore[method-assign]  # never answered
    lines = [Line(i, f"c{i}", b"{}") for i in range(100)]
    w.running["b"] = _Batch("b", "k", "/v1/chat/completions", lines, deque(range(100)))
    now = [10.0]
    w.clock = lambda: now[0]
    w.window = 8.0
    w._dispatch()
    assert len(w.inflight) == 8  # no round trip known yet: the window at once
    w.inflight.clear()
    w.srtt, w.next_send_at, w.slow_start_until = 0.4, 0.0, 4.0
    w._dispatch()  # after slow start: 1.2 windows per srtt, 0.4 / (1.2 x 8) s apart
    assert len(w.inflight) == 1
    assert w.next_send_at == pytest.approx(10.0 + 0.4 / 9.6)
    now[0] += 0.4 / 9.6
    w._dispatch()
    assert len(w.inflight) == 2


def test_usage_of_reads_chat_responses_and_embeddings_shapes() -> None:
    chat = {"usage": {"prompt_tokens": 10, "completion_tokens": 3,
                      "prompt_tokens_details": {"cached_tokens": 4}}}
    responses = {"usage": {"input_tokens": 8, "output_tokens": 2,
                           "input_tokens_details": {"cached_tokens": 0}}}
    embeddings = {"usage": {"prompt_tokens": 5, "total_tokens": 5}}
    assert [usage_of(b) for b in (chat, responses, embeddings, {})] == [
        (10, 4, 3), (8, 0, 2), (5, 0, 0), (0, 0, 0)]


@pytest.mark.parametrize(("status", "code", "should_retry", "want"), [
    (429, "rate_limit_exceeded", True, True),
    (503, "overloaded", True, True),
    (429, "insufficient_quota", True, False),
    (429, "rate_limit_exceeded", False, False),
    (400, "invalid_request", True, False),
])
def test_only_refusals_that_may_pass_later_are_retried(status: int, code: str,
                                                        should_retry: bool,
                                                        want: bool) -> None:
    body = json.dumps({"error": {"message": "m", "type": "t", "param": None,
                                 "code": code}}).encode()
    assert retryable(Answer(status, body, None, 1.0, should_retry)) is want


class _RedisDown:
    """A store whose Redis is down until ``up`` is set; ``next_attempt`` counts."""

    def __init__(self) -> None:
        self.up = False
        self.attempts: dict[int, int] = {}

    def attempt(self, batch_id: str, index: int) -> int:
        if not self.up:
            raise redis.ConnectionError("Connection refused.")
        return self.attempts.get(index, 0)

    def next_attempt(self, batch_id: str, index: int) -> int:
        if not self.up:
            raise redis.ConnectionError("Connection refused.")
        self.attempts[index] = self.attempts.get(index, 0) + 1
        return self.attempts[index]


def test_redis_down_mid_step_drops_no_line_from_those_to_send_or_out(
        config_path: Path) -> None:
    """A line whose attempt cannot be read stays to send; a refusal whose new attempt
    cannot be written stays out, taken again once Redis is back (a line in neither
    would leave its batch in progress for ever)."""
    w = worker(config_path, max_in_flight=64)
    store = _RedisDown()
    w.store, w.edge = store, _Unanswered()  # type: ignore[assignment]
    w.pool.submit = lambda *a: Future()  # type: ignore[method-assign]
    lines = [Line(i, f"c{i}", b"{}") for i in range(3)]
    b = _Batch("b", "k", "/v1/chat/completions", lines, deque(range(3)))
    w.running["b"] = b
    with pytest.raises(redis.ConnectionError):
        w._dispatch()
    assert (list(b.pending), b.out) == ([0, 1, 2], set())
    store.up = True
    w._dispatch()
    assert (list(b.pending), b.out) == ([2], {0, 1})  # the window: two lines
    refused = json.dumps({"error": {"message": "m", "type": "t", "param": None,
                                    "code": "overloaded"}}).encode()
    for fut in w.inflight:
        fut.set_result(Answer(503, refused, None, 1.0, True))
    store.up = False
    with pytest.raises(redis.ConnectionError):
        w._collect()
    assert (list(b.pending), b.out, len(w.inflight)) == ([2], {0, 1}, 2)
    store.up = True
    w._collect()
    assert (sorted(b.pending), b.out, w.inflight) == ([0, 1, 2], set(), {})
    assert store.attempts == {0: 1, 1: 1}  # each refused line's next id, once


class KeepAliveEdge:
    """A fake edge speaking HTTP/1.1 on a loopback socket that closes kept-alive
    connections as nginx does past its keepalive_timeout: ``close_idle``: each
    connection after its first answer (the client finds it closed before its next
    request); ``close_on_request``: on the second request it reads, without an answer
    (nginx's timeout ran out as the request came). ``connections``: how many it
    accepted; ``requests``: the X-Tokengate-Batch-Line of each request it read."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.connections = 0
        self.requests: list[str] = []
        self.closed = threading.Semaphore(0)   # released as each connection is closed
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            with conn, conn.makefile("rb") as f:
                for n in itertools.count():
                    head = []
                    while (line := f.readline()) not in (b"\r\n", b""):
                        head.append(line.decode())
                    if not head:
                        break
                    fields = dict(h.rstrip("\r\n").split(": ", 1) for h in head[1:])
                    f.read(int(fields["Content-Length"]))
                    self.requests.append(fields.get("X-Tokengate-Batch-Line", ""))
                    if self.mode == "close_on_request" and n == 1:
                        break
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 2\r\n\r\n{}")
                    if self.mode == "close_idle":
                        break
            self.closed.release()

    def close(self) -> None:
        self.server.close()


def test_a_kept_alive_connection_the_edge_closed_while_idle_is_replaced() -> None:
    """Lines sent after the edge closed the batch service's idle connection go on a
    new one; before, each such line failed as an unknown outcome (Broken pipe: a 1 s
    pause and a smaller window)."""
    edge = KeepAliveEdge("close_idle")
    try:
        client = EdgeClient(f"http://127.0.0.1:{edge.port}", "secret", timeout_s=10)
        for i in range(3):
            a = client.post("/v1/chat/completions", b"{}", "k", "batch_1", f"c{i}", f"r{i}")
            assert a.status == 200
            assert edge.closed.acquire(timeout=10)   # closed while idle, as nginx does
    finally:
        edge.close()
    assert (edge.connections, edge.requests) == (3, ["r0", "r1", "r2"])


def test_a_connection_that_breaks_with_the_line_out_is_not_sent_again() -> None:
    """The edge read the line and the connection broke without an answer (a kill): the
    outcome is unknown to the worker, which sends the line again later with the same
    request id; the client does not send it a second time itself (a refusal of that
    second send would give the line a new id while the first may have run)."""
    edge = KeepAliveEdge("close_on_request")
    try:
        client = EdgeClient(f"http://127.0.0.1:{edge.port}", "secret", timeout_s=10)
        assert client.post("/v1/chat/completions", b"{}", "k", "b", "c0", "r0").status == 200
        with pytest.raises(ConnectionError):
            client.post("/v1/chat/completions", b"{}", "k", "b", "c1", "r1")
        assert client.post("/v1/chat/completions", b"{}", "k", "b", "c1", "r1").status == 200
    finally:
        edge.close()
    assert (edge.connections, edge.requests) == (2, ["r0", "r1", "r1"])


def test_an_edge_that_cannot_be_reached_still_raises() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()
    with pytest.raises(OSError):
        EdgeClient(f"http://127.0.0.1:{port}", "secret", timeout_s=5).post(
            "/v1/chat/completions", b"{}", "k", "batch_1", "c", "r")


def test_a_byte_order_mark_opening_the_file_is_not_part_of_its_first_line() -> None:
    row = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "m", "messages": []}}).encode()
    lines, errors = parse(b"\xef\xbb\xbf" + row + b"\r\n" + row.replace(b'"a"', b'"b"'),
                          "/v1/chat/completions", 10, 1 << 20)
    assert errors == [] and [ln.custom_id for ln in lines] == ["a", "b"]
    # anywhere else it is what it is: bytes that are not JSON
    _, errors = parse(row + b"\n\xef\xbb\xbf" + row.replace(b'"a"', b'"b"'),
                      "/v1/chat/completions", 10, 1 << 20)
    assert [e.code for e in errors] == ["invalid_json_line"]
