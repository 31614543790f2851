"""Fixtures of the nginx edge tests: real nginx + ngx_lua, real counter, real vLLM CPU.
(Over 600 lines: the edge's fixtures and the fakes they run against, which every edge
test imports from one place.)

- ``edge_config_path``: the test configuration plus the edge's test keys (small limits
  for the limit tests) and a usage file of its own.
- ``edge``: the main edge instance (``devstack.nginx_service``, the builder ``make run``
  uses) in front of the session's counter and vLLM, on 127.0.0.1:18080.
- ``edge_variant``: starts another instance with a different configuration (counter
  down, fail closed, vLLM down, fake upstream); each is stopped at the end of the test.
  ``edge_variant_off_vllm`` is the same for variants in front of another upstream than
  vLLM (no vLLM started: ``make test-fast`` runs those).
- ``vllm_requests``: vLLM's own count of HTTP requests, to prove that nothing reached it.
- ``replicas``: starts fast upstreams (TokenStorm's, answering like vLLM) as replicas.
- ``run_lua``: runs a chunk of Lua inside nginx's own LuaJIT with the edge's modules on
  the path (for pure functions: codecs, the sampling rule).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import socket
import socketserver
import subprocess
import tempfile
import threading
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from tokengate_dev import devstack
from tokenstorm.null_server import FastUpstream
from tokenstorm.process import free_port
from tokenstorm.upstream import UpstreamOptions

from tests.conftest import MODEL, PORT_OFFSET, TEST_DIR, VLLM_PORT, key_digest

T = TypeVar("T")

EDGE_PORT = 18080 + PORT_OFFSET
# each edge's status server: its API port + this; the extra edges' ports. The workers'
# offsets are 500 apart: no fixed port of one worker may be 500 * k away from another
# fixed port (with +1000 and 19100-19199, worker k's status ports were worker k+2's
# edge ports, and worker k+2's fast upstream worker k's first extra edge: "address
# already in use"); tests/test_conftest.py checks every fixed range of the suite
STATUS_PORT_DELTA = 150
VARIANT_RANGE = range(19240 + PORT_OFFSET, 19340 + PORT_OFFSET)


def _variant_ports() -> Iterator[int]:
    """Ports of the extra edges of a session (their status servers at +
    STATUS_PORT_DELTA), off the main edge's status port: the 100 of VARIANT_RANGE in
    turn, again from the first once all were given (a stopped edge's port is free
    again), a port something holds skipped; RuntimeError when none is free."""
    while True:
        free = 0
        for port in VARIANT_RANGE:
            try:
                for p in (port, port + STATUS_PORT_DELTA):
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", p))
            except OSError:
                continue
            free += 1
            yield port
        if not free:
            raise RuntimeError(f"no free port for another edge in {VARIANT_RANGE}")


VARIANT_PORTS = _variant_ports()
EDGE_DIR = TEST_DIR / "edge"

# API keys of the edge tests: id -> (key, rpm, tpm). Each limit test owns its key, so the
# shared-dict windows of one test never disturb another.
KEYS: dict[str, tuple[str, int, int]] = {
    "edge-main": ("tg-test-edge-main", 100000, 100_000_000),
    "edge-rpm": ("tg-test-edge-rpm", 3, 1_000_000),
    "edge-tpm": ("tg-test-edge-tpm", 1000, 120),
    "edge-burst": ("tg-test-edge-burst", 1000, 1000),
    "edge-settle": ("tg-test-edge-settle", 1000, 100_000),
    "edge-countdown": ("tg-test-edge-countdown", 50, 100_000),
    "edge-override": ("tg-test-edge-override", 1000, 100_000),
    "edge-messages-rpm": ("tg-test-edge-messages-rpm", 2, 1_000_000),
    "edge-other": ("tg-test-edge-other", 1000, 1_000_000),
}
MAIN_KEY = KEYS["edge-main"][0]


def key_of(key_id: str) -> str:
    return KEYS[key_id][0]


def _edge_yaml(base: Path, out: Path, edit: Callable[[dict[str, Any]], None] | None = None,
               usage_file: Path | None = None) -> Path:
    raw = yaml.safe_load(base.read_text())
    keys = raw.setdefault("keys", {})
    for key_id, (key, rpm, tpm) in KEYS.items():
        keys[key_id] = {"sha256": key_digest(key), "rpm": rpm, "tpm": tpm}
    keys["edge-override"]["models"] = {MODEL: {"rpm": 2, "tpm": 50_000}}
    edge = raw.setdefault("edge", {})
    edge["usage_file"] = str(usage_file or EDGE_DIR / "usage.jsonl")
    # this 2-core machine also runs vLLM CPU: give the counter room before failing open
    edge["count_timeout_ms"] = 3000
    if edit is not None:
        edit(raw)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


def patient_redis_config(config_path: Path, name: str) -> Path:
    """A copy of ``config_path`` (``TEST_DIR/<name>.yaml``) whose Redis deadline suits a
    loaded 2-core machine: 2 s, the edge's wait for the sidecar 5 s. For the limits
    sidecars of tests that are not about a slow Redis: at the default 50 ms a fresh or
    busy Redis answered late in clean-clone runs, and the global tier fell back to the
    local one (or a budget never heard from was refused)."""
    raw = yaml.safe_load(config_path.read_text())
    raw["redis"]["timeout_ms"] = 2000
    raw.setdefault("edge", {})["global_limits_timeout_ms"] = 5000
    path = TEST_DIR / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def edge_config_path(config_path: Path) -> Path:
    """tokengate.yaml of the edge tests (models as in ``config_path``, plus ``KEYS``)."""
    return _edge_yaml(config_path, EDGE_DIR / "tokengate.yaml")


# The Lua folder of the test edges (LUA_PATH): tokengate_test.window_clock, the movable
# clock of the limit windows (see lua/tokengate/clock.lua). ";;": LuaJIT's own path.
TEST_LUA_PATH = f"{Path(__file__).parent / 'edge' / 'lua'}/?.lua;;"
_FRESH_WINDOWS = itertools.count(1)  # each window_clock() gets windows no one has used
WINDOW_S = 60  # the limit windows' length (tokengate.local_limit)


@dataclass
class WindowClock:
    """The clock of a test edge's limit windows, set through the file ``window_clock``
    in the edge's prefix (read by tokengate_test.window_clock on every call).

    ``t``: where a stopped clock stands (seconds since the epoch); ``offset``: what a
    running one adds to the real time (s). ``t`` starts ``second`` s into a window that no
    request has used, so its previous window is empty too."""

    path: Path
    t: float
    offset: float | None = None  # None: stopped at t

    @property
    def elapsed(self) -> float:
        """Seconds of the current window gone (of a stopped clock)."""
        return self.t % WINDOW_S

    def move(self, seconds: float) -> None:
        """Moves a stopped clock forward by ``seconds``."""
        assert self.offset is None, "a running clock moves by itself"
        self.t += seconds
        self._write()

    def real_time(self, t: float) -> float:
        """The real time (time.time()) at which a running clock reads ``t``."""
        assert self.offset is not None, "a stopped clock never reads another time"
        return t - self.offset

    def _write(self) -> None:
        line = f"at {self.t!r}" if self.offset is None else f"offset {self.offset!r}"
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(line + "\n")
        tmp.replace(self.path)  # every worker reads a whole line, old or new


@dataclass
class Edge:
    """A running edge instance."""

    base_url: str            # http://127.0.0.1:<port>/v1
    port: int
    usage_file: Path
    service: devstack.Service
    status_port: int         # the loopback status server (edge.status_listen)

    @property
    def log_path(self) -> Path:
        return self.service.log_path

    @property
    def status_url(self) -> str:
        return f"http://127.0.0.1:{self.status_port}/tokengate/status"

    def status(self) -> dict[str, Any]:
        """The edge's counters, from its status server (``/tokengate/status``)."""
        import httpx
        r = httpx.get(self.status_url, timeout=10)
        r.raise_for_status()
        return dict(r.json())

    @contextlib.contextmanager
    def window_clock(self, second: float = 1.0, running: bool = False, here: bool = False
                     ) -> Iterator[WindowClock]:
        """The edge's limit windows on a clock of the test's own, ``second`` s into a
        window no request has used yet (the key's counts start at 0); stopped there
        until moved (``WindowClock.move``), or ``running`` at the real clock's pace.
        ``here``: stopped at the real time instead (the current window and budget
        periods with what they hold; nothing slides out while the block runs). Back on
        the real clock when the block ends. Only edges started with ``TEST_LUA_PATH``
        (every edge of these fixtures) have the movable clock."""
        assert self.service.env.get("LUA_PATH") == TEST_LUA_PATH, \
            f"{self.service.name} has no movable clock: start it with TEST_LUA_PATH"
        prefix = Path(self.service.argv[self.service.argv.index("-p") + 1])
        window = (time.time() // WINDOW_S + 1440 * next(_FRESH_WINDOWS)) * WINDOW_S
        clock = WindowClock(prefix / "window_clock",
                            time.time() if here else window + second)
        if running:
            clock.offset = clock.t - time.time()
        clock._write()
        try:
            yield clock
        finally:
            clock.path.unlink(missing_ok=True)

    def events(self) -> list[dict[str, Any]]:
        """Every usage event written so far, in order: the complete lines (a line the
        edge is writing is not an event yet)."""
        return [json.loads(line) for line in self._lines()]

    def _lines(self) -> list[str]:
        """The complete, non-empty lines of the usage file ([] before it exists)."""
        if not self.usage_file.exists():
            return []
        data = self.usage_file.read_text()
        return [line for line in data[: data.rfind("\n") + 1].splitlines() if line]

    def event(self, request_id: str, timeout_s: float = 5.0) -> dict[str, Any]:
        """The usage event of one request (waits for the log phase to write it)."""
        # a session's usage file holds thousands of events: parse only the lines that
        # can be this one's (an id that JSON writes as it is appears in its event's line)
        verbatim = request_id.isascii() and request_id.isprintable() and \
            not any(c in request_id for c in '"\\/')
        deadline = time.monotonic() + timeout_s
        while True:
            for line in reversed(self._lines()):
                if (request_id in line or not verbatim) and \
                        (ev := json.loads(line))["request_id"] == request_id:
                    return ev
            if time.monotonic() > deadline:
                raise AssertionError(f"no usage event for request {request_id}")
            time.sleep(0.05)

    def assert_no_event(self, request_id: str, settle_s: float = 0.3) -> None:
        """No usage event for ``request_id`` (requests without a valid key write none);
        waits ``settle_s`` first, as the log phase runs after the answer was sent."""
        time.sleep(settle_s)
        found = [ev for ev in self.events() if ev["request_id"] == request_id]
        assert not found, f"a usage event was written: {found[0]}"


def _start_edge(config_path: Path, port: int, name: str, counter_socket: Path,
                usage_file: Path) -> Edge:
    status_port = port + STATUS_PORT_DELTA
    svc = devstack.nginx_service(config_path, port=port, counter_socket=counter_socket,
                                 counter_workers=2, workers=2, name=name,
                                 prefix=EDGE_DIR / name, status_port=status_port)
    movable_clock(svc, EDGE_DIR / name)
    svc.log_path.unlink(missing_ok=True)
    svc.start()
    return Edge(f"http://127.0.0.1:{port}/v1", port, usage_file, svc, status_port)


def movable_clock(svc: devstack.Service, prefix: Path) -> None:
    """Give a test edge not yet started (nginx prefix ``prefix``) the movable clock of
    ``Edge.window_clock``: ``TEST_LUA_PATH``, and no clock file a session cut short left
    (the edge would start on it)."""
    svc.env["LUA_PATH"] = TEST_LUA_PATH
    (prefix / "window_clock").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def edge(edge_config_path: Path, counter_addr: str, vllm_url: str) -> Iterator[Edge]:
    """The main edge: real counter (2 workers), real vLLM, 2 nginx workers."""
    e = _start_edge(edge_config_path, EDGE_PORT, f"test-nginx{PORT_OFFSET or ''}",
                    TEST_DIR / "counter.sock", EDGE_DIR / "usage.jsonl")
    try:
        yield e
    finally:
        e.service.stop()


def _variants(config_path: Path) -> Iterator[Callable[..., Edge]]:
    started: list[Edge] = []

    def start(name: str, edit: Callable[[dict[str, Any]], None] | None = None,
              counter_socket: Path | None = None) -> Edge:
        usage = EDGE_DIR / name / "usage.jsonl"
        usage.unlink(missing_ok=True)
        path = _edge_yaml(config_path, EDGE_DIR / name / "tokengate.yaml", edit, usage)
        e = _start_edge(path, next(VARIANT_PORTS), f"test-nginx-{name}{PORT_OFFSET or ''}",
                        counter_socket or TEST_DIR / "counter.sock", usage)
        started.append(e)
        return e

    try:
        yield start
    finally:
        for e in started:
            e.service.stop()


@pytest.fixture
def edge_variant(config_path: Path, vllm_url: str) -> Iterator[Callable[..., Edge]]:
    """Factory: ``edge_variant(name, edit=fn(raw_yaml), counter_socket=Path)`` starts an
    extra edge whose YAML is edited by ``edit``; stopped when the test ends."""
    yield from _variants(config_path)


@pytest.fixture
def edge_variant_off_vllm(config_path: Path,
                          counter_addr: str) -> Iterator[Callable[..., Edge]]:
    """``edge_variant`` for variants whose ``edit`` points the model at another upstream
    (a fake, the fast upstream, a dead port): the session's counter, no vLLM, so
    ``make test-fast`` runs them."""
    yield from _variants(config_path)


def at_once(n: int, call: Callable[[], T]) -> list[T]:
    """``call()`` made by n threads released together (a burst), the results in order."""
    start = threading.Barrier(n)

    def one(_: int) -> T:
        start.wait()
        return call()

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


class QuietUpstreamHandler(BaseHTTPRequestHandler):
    """The base of a test's fake vLLM (http.server): logs nothing and answers the edge's
    own GETs (its health and metrics reads) 404; a subclass answers the API's POSTs."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()


class FakeUpstream:
    """A broken vLLM for the crash cases, on 127.0.0.1:<port>. ``mode``:

    - ``close``: reads the request and closes the connection without answering;
    - ``html<status>`` (``html500``, ``html413``): answers that status with an HTML page
      (not OpenAI's shape), as a proxy in front of vLLM does;
    - ``crash_stream``: starts an SSE stream with cumulative usage (completion 1, 2, 3
      tokens), then dies mid-stream.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.port = free_port()
        self.requests = 0  # API requests (POST) received
        self._srv = socket.create_server(("127.0.0.1", self.port))
        self._srv.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    @staticmethod
    def read_head(conn: socket.socket) -> bytes | None:
        """The request's bytes up to the end of its headers (some of the body may
        follow); None when the client closed first."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        return data

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            data = self.read_head(conn)
            if data is None:
                return
            if data.startswith(b"POST "):  # not the edge's GET /health and /metrics
                self.requests += 1
            if self.mode.startswith("html"):
                page = b"<html><body>Error</body></html>"
                conn.sendall(b"HTTP/1.1 %s Error\r\nContent-Type: text/html\r\n"
                             b"Content-Length: %d\r\n\r\n%s"
                             % (self.mode[4:].encode(), len(page), page))
            elif self.mode == "crash_stream":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for i in range(1, 4):
                    ev = (b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,'
                          b'"delta":{"content":"a"}}],"usage":{"prompt_tokens":9,'
                          b'"total_tokens":%d,"completion_tokens":%d}}\n\n' % (9 + i, i))
                    conn.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
                    time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._srv.close()


@pytest.fixture
def fake_upstream() -> Iterator[Callable[[str], FakeUpstream]]:
    """Factory of ``FakeUpstream``s, closed when the test ends."""
    made: list[FakeUpstream] = []

    def make(mode: str) -> FakeUpstream:
        f = FakeUpstream(mode)
        made.append(f)
        return f

    try:
        yield make
    finally:
        for f in made:
            f.close()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Callable[..., FastUpstream]]:
    """Factory: ``replicas(**opts)`` starts a fast upstream of the test model (a vLLM
    replica; ``opts``: ``UpstreamOptions`` keywords, ``ttft_ms``, ``itl_ms``,
    ``prompt_tokens_delta``, ...); all stop at the end of the test."""
    started: list[FastUpstream] = []

    def start(**opts: Any) -> FastUpstream:
        up = FastUpstream(UpstreamOptions(**{"model": MODEL, **opts}),
                          name=f"replica{len(started)}", state_dir=tmp_path)
        started.append(up.start())
        return up

    try:
        yield start
    finally:
        for up in started:
            up.stop()


@pytest.fixture
def fast_edge(request: pytest.FixtureRequest, edge_variant_off_vllm: Callable[..., Edge],
              replicas: Callable[..., FastUpstream]) -> Edge:
    """An edge variant (named after the test module) whose model's only upstream is a
    fast upstream (the fast upstream's own validation stands in for vLLM's)."""
    up = replicas()

    def edit(raw: dict[str, Any]) -> None:
        raw["models"][MODEL]["upstreams"] = [f"127.0.0.1:{up.port}"]
        raw["models"][MODEL]["embedded"] = False
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    return edge_variant_off_vllm(f"{name}-fast", edit)


class _Frames(socketserver.StreamRequestHandler):
    """One connection of a fake counter: counter frames in, ``frames.answer`` out."""

    def handle(self) -> None:
        from tokengate.counter import frames

        while True:
            head = self.rfile.read(frames.MESSAGE_HEADER.size)
            if len(head) < frames.MESSAGE_HEADER.size:
                return
            _, n = frames.MESSAGE_HEADER.unpack(head)
            message = self.rfile.read(n)
            if self.server.broken:  # type: ignore[attr-defined]
                return  # a worker that dies with the call: the connection closes
            if self.server.served is not None:  # type: ignore[attr-defined]
                self.server.served.append(self.server.index)  # type: ignore[attr-defined]
            if self.server.gate is not None:  # type: ignore[attr-defined]
                self.server.gate(self.server.index)  # type: ignore[attr-defined]
            self.wfile.write(frames.answer(self.server.count, message))  # type: ignore[attr-defined]


@contextlib.contextmanager
def fake_counter(path: Path, count: Callable[[Any], Any], broken: int | None = None,
                 served: list[int] | None = None,
                 gate: Callable[[int], Any] | None = None) -> Iterator[Path]:
    """A fake counter speaking the real counter frames (tokengate.counter.frames) on two
    unix sockets, ``<path>.0`` and ``.1``, a thread per connection; ``count(request)``
    answers each CountRequest (a CountReply, or raises CountFailure). ``broken``: the
    index of a socket whose worker reads each call and closes the connection without an
    answer. ``served``: gets the index of the socket of each call, as it arrives;
    ``gate(index)``: called next, before the call is answered (a test holds a worker's
    calls there). Yields ``path`` (the edge's counter_socket)."""
    servers = []
    path.parent.mkdir(parents=True, exist_ok=True)  # whichever test runs first
    for i in range(2):
        sock = path.with_name(f"{path.name}.{i}")
        sock.unlink(missing_ok=True)
        server = socketserver.ThreadingUnixStreamServer(str(sock), _Frames)
        server.daemon_threads = True
        server.count = count  # type: ignore[attr-defined]
        server.broken = i == broken  # type: ignore[attr-defined]
        server.served, server.gate, server.index = served, gate, i  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield path
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def slow_counter() -> Iterator[Path]:
    """A counter that answers after 5 s, on two unix sockets (``<path>.0``, ``.1``);
    yields ``<path>`` (the edge's counter_socket)."""
    from tokengate.v1 import counter_pb2

    def slow(request: Any) -> Any:
        time.sleep(5)
        return counter_pb2.CountReply(prompt_tokens=1)

    with fake_counter(EDGE_DIR / "slow-counter.sock", slow) as path:
        yield path


@dataclass
class FixedCounter:
    """A counter that answers every call with ``prompt_tokens`` and counts calls."""

    path: Path               # the edge's counter_socket (workers listen on <path>.<i>)
    prompt_tokens: int
    calls: int = 0


@pytest.fixture
def fixed_counter() -> Iterator[FixedCounter]:
    """A fast fake counter (7 prompt tokens for every body) on two unix sockets."""
    fc = FixedCounter(EDGE_DIR / "fixed-counter.sock", 7)

    def fixed(request: Any) -> Any:
        fc.calls += 1
        return fixed_reply(fc.prompt_tokens)

    with fake_counter(fc.path, fixed):
        yield fc


def fixed_reply(prompt_tokens: int) -> Any:
    """A CountReply of ``prompt_tokens`` for a one-prompt request (the fake counters')."""
    from tokengate.v1 import counter_pb2

    return counter_pb2.CountReply(prompt_tokens=prompt_tokens, max_model_len=8192,
                                  max_tokens_effective=1, max_tokens_requested=1,
                                  prompt_count=1)


def session_for(worker: int) -> str:
    """A session id whose counts prefer counter worker ``worker`` (of two): CRC-32 (IEEE,
    nginx's ngx_crc32_short, as zlib's) modulo the workers (tokengate.sidecar)."""
    return next(s for s in (f"conversation-{i}" for i in range(100))
                if zlib.crc32(s.encode()) % 2 == worker)


_HTTP_REQUESTS = re.compile(r'^http_requests_total\{handler="([^"]*)",method="([^"]*)",'
                            r'status="([^"]*)"\} ([0-9.e+]+)$', re.MULTILINE)


def vllm_request_count() -> int:
    """vLLM's total of HTTP requests to its OpenAI endpoints (from /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{VLLM_PORT}/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(float(v) for h, _m, _s, v in _HTTP_REQUESTS.findall(text)
                   if h.startswith("/v1/")))


@pytest.fixture
def vllm_requests(vllm_url: str) -> Callable[[], int]:
    """Callable: requests vLLM has received so far (compare before/after)."""
    return vllm_request_count


_INIT_NGINX = """
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
daemon off;
master_process off;
pid {d}/nginx.pid;
error_log stderr notice;
events {{}}
http {{
    client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d};
    uwsgi_temp_path {d}; scgi_temp_path {d};
    lua_package_path "{lua}/?.lua;;";
    lua_shared_dict tokengate_limits 1m;
    init_by_lua_block {{
{init}
        os.exit(0)
    }}
}}
"""


def run_init_lua(folder: Path, init: str, timeout_s: float = 30.0
                 ) -> subprocess.CompletedProcess[str]:
    """Runs Lua ``init`` in init_by_lua of a throwaway nginx with prefix ``folder``
    (Debian's ngx_lua: the edge's own LuaJIT, ``ngx``, the edge's modules and an empty
    shared dict ``tokengate_limits``), which exits right after, before opening any
    socket; returns the finished process (stdout, stderr). ``nginx -t`` does not run
    init_by_lua, so nginx really starts. ``LUA_PATH`` and ``LUA_CPATH`` are dropped from
    its environment: the ``;;`` of ``lua_package_path`` then means LuaJIT's own default
    path, whatever the caller's shell holds (a test edge's path puts a movable clock on
    it, see tokengate.clock). Raises OSError or subprocess.TimeoutExpired."""
    conf = folder / "nginx.conf"
    conf.write_text(_INIT_NGINX.format(d=folder, lua=devstack.LUA_DIR, init=init))
    env = {k: v for k, v in os.environ.items() if k not in ("LUA_PATH", "LUA_CPATH")}
    return subprocess.run(["nginx", "-p", str(folder), "-c", str(conf), "-e", "stderr"],
                          capture_output=True, text=True, timeout=timeout_s, check=False,
                          env=env)


def run_lua(chunk: str) -> str:
    """Runs ``chunk`` (Lua, ``return <string>``) in ``run_init_lua``'s nginx; returns the
    chunk's string. Raises AssertionError with the Lua error."""
    with tempfile.TemporaryDirectory(prefix="tg-lua-") as d:
        Path(d, "chunk.lua").write_text(chunk)
        r = run_init_lua(Path(d), f"""
        local f = assert(loadfile("{d}/chunk.lua"))
        local ok, out = pcall(f)
        io.stdout:write(ok and "OK\\n" or "ERR\\n", tostring(out))
        io.stdout:flush()""")
    status, _, out = r.stdout.partition("\n")
    assert status == "OK", f"Lua failed: {out or r.stderr}"
    return out


__all__ = ["EDGE_PORT", "KEYS", "MAIN_KEY", "Edge", "FakeUpstream", "FixedCounter",
           "QuietUpstreamHandler", "free_port", "key_of", "run_init_lua", "run_lua"]
