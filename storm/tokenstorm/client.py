"""The load generator's HTTP client: open-loop sends over keep-alive HTTP/1.1.

(Long for one thing: the worker's hot path, its connection protocol and its scheduler,
which share each request's record and are measured together by the ceiling runs.)

One worker process runs one event loop (uvloop when available) with a pool of
keep-alive connections. Requests are sent at their scheduled time whether or not
earlier ones have finished (open loop), on an idle connection or a new one; a request
waits only when the worker's connection cap is reached or its event loop runs late,
and that wait counts as *send lag* (a slow connect does not: it is server latency). All latencies are
measured from the **scheduled** send time, not the actual one, so a generator or
server that falls behind shows it in the latency instead of hiding it (no coordinated
omission). A closed-loop mode (fixed in-flight requests per worker) measures
saturation throughput; there latency runs from the actual send.

The HTTP/1.1 parser is minimal on purpose (status line, a few headers, Content-Length
or chunked bodies, SSE events split on blank lines): it costs a few microseconds per
request where general-purpose clients cost hundreds, which is what lets one core
drive thousands of requests/s. Streamed responses are not JSON-parsed chunk by chunk:
an event is classified by byte search (role chunk, token chunk, usage-only chunk,
error, ``[DONE]``) and only the last event that carries ``usage`` is parsed, since
vLLM's usage is cumulative (last value wins).

Per request the worker records (seconds from the run start, monotonic clock): the
scheduled and actual send times, the first token event (TTFT) and the end; HTTP
status; reported prompt and completion tokens (of a stream that broke off: the last
cumulative usage it carried), and the prompt tokens served from the server's prefix
cache (``usage.prompt_tokens_details.cached_tokens``, 0 when absent); the number of
token events; inter-event gaps (ITL samples); for 429s the limit that refused (requests
or tokens) and ``Retry-After``; the answer's ``X-Request-Id`` (a gateway's id of the
request, "" without one); whether the request went out on a connection opened before
it (kept alive, or pre-opened: a server that closes it at that instant never read the
request).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import socket
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

from tokenstorm.profiles import Plan
from tokenstorm.prompts import PromptBuilder, StreamOptions

monotonic = time.monotonic

# Error codes (column ``error``).
E_NONE, E_CONNECT, E_DISCONNECT, E_TIMEOUT, E_PROTOCOL, E_STREAM, E_INCOMPLETE = range(7)
ERROR_NAMES = {E_NONE: "none", E_CONNECT: "connect", E_DISCONNECT: "disconnected",
               E_TIMEOUT: "timeout", E_PROTOCOL: "bad HTTP", E_STREAM: "error event in stream",
               E_INCOMPLETE: "stream without [DONE]"}
# 429 kinds (column ``limit``).
L_NONE, L_REQUESTS, L_TOKENS, L_UNKNOWN = range(4)
LIMIT_NAMES = {L_REQUESTS: "requests", L_TOKENS: "tokens", L_UNKNOWN: "unknown"}

# Shared progress counters per worker (multiprocessing RawArray of doubles).
P_DONE, P_OK, P_429, P_ERR, P_OUT_TOKENS, P_IN_TOKENS, P_INFLIGHT, P_SENT = range(8)
PROGRESS_FIELDS = 8


@dataclass(frozen=True)
class Target:
    """Where requests go: ``http://host:port`` plus the API base path (``/v1``)."""

    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> Target:
        """From ``http://127.0.0.1:8080/v1``; only plain http (loopback benchmarks)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected an http://host:port/v1 URL, got {url!r}")
        base = parts.path.rstrip("/")
        if base.endswith(("/chat/completions", "/completions")):
            raise ValueError(f"give the API base (…/v1), not an endpoint: {url!r}")
        return cls(parts.hostname, parts.port or 80, base or "/v1")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{self.base_path}"


@dataclass(frozen=True)
class ClientConfig:
    """One worker's client settings.

    ``keys``: API keys used round-robin by request index (none: no Authorization);
    ``send_token_count``: add ``X-Token-Count: <expected prompt tokens>`` (what the
    gateway sends upstream; for direct runs against the fast upstream);
    ``timeout_s``: per-request limit (s); ``connections``: connections opened per
    worker before the start; ``max_connections``: per-worker cap (requests beyond it
    wait, which is send lag); ``concurrency``: closed loop with this many requests in
    flight per worker (0 = open loop on the schedule); ``duration_s``: closed-loop
    length (s); ``headers``: (name, value) pairs added to every request (a gateway's
    routing headers).
    """

    target: Target
    endpoint_path: str = "/v1/chat/completions"
    keys: tuple[str, ...] = ()
    stream: StreamOptions = field(default_factory=StreamOptions)
    send_token_count: bool = False
    timeout_s: float = 60.0
    connections: int = 16
    max_connections: int = 4096
    concurrency: int = 0
    duration_s: float = 10.0
    headers: tuple[tuple[str, str], ...] = ()


@dataclass
class WorkerResult:
    """Per-request columns of one worker (same order as its share of the plan) plus
    ITL samples (s) and the worker's loop start/end (s from the run start)."""

    index: array
    sched: array
    sent: array
    first: array
    end: array
    status: array
    prompt: array
    completion: array
    cached: array
    header_count: array
    chunks: array
    error: array
    limit: array
    retry_after: array
    reused: array
    itl: array
    request_id: list[str] = field(default_factory=list)
    connections_opened: int = 0
    cpu_s: float = 0.0  # the worker's CPU time (user + system, s) during the run itself
    error_samples: list[str] = field(default_factory=list)

    def columns(self) -> dict[str, array]:
        return {k: v for k, v in vars(self).items() if isinstance(v, array) and k != "itl"}


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case) in the lower-cased header block."""
    i = head.find(b"\r\n" + name + b":")
    if i < 0:
        return None
    j = head.find(b"\r\n", i + 2)
    return head[i + len(name) + 3:j].strip()


def _header_int(head: bytes, name: bytes) -> int | None:
    v = _header(head, name)
    if v is None:
        return None
    try:
        return int(float(v))
    except ValueError:
        return None


def classify_429(head: bytes, body: bytes) -> int:
    """Which limit refused a 429: requests (RPM) or tokens (TPM).

    Reads the error message first ("requests per minute"/"tokens per minute", RPM/TPM),
    then ``x-ratelimit-remaining-requests`` / ``-tokens``; ``head`` is the lower-cased
    header block.
    """
    msg = body.lower()
    try:
        err = json.loads(body).get("error") or {}
        msg = " ".join(str(err.get(k) or "") for k in ("message", "code", "type")).lower()\
            .encode()
    except (ValueError, AttributeError):
        pass
    req = b"requests per minute" in msg or b"rpm" in msg or b"request limit" in msg
    tok = b"tokens per minute" in msg or b"tpm" in msg or b"token limit" in msg
    if req != tok:
        return L_REQUESTS if req else L_TOKENS
    if _header_int(head, b"x-ratelimit-remaining-requests") == 0:
        return L_REQUESTS
    if _header_int(head, b"x-ratelimit-remaining-tokens") is not None:
        return L_TOKENS
    return L_UNKNOWN


class Conn(asyncio.Protocol):
    """One keep-alive connection running at most one request at a time."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.transport: asyncio.Transport | None = None
        self.idx = -1
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.head_buf = bytearray()
        self.in_body = False
        self.status = 0
        self.head = b""
        self.chunked = False
        self.remaining = 0
        self.chunk_left = 0
        self.need_crlf = False
        self.in_trailer = False
        self.cbuf = bytearray()
        self.body = bytearray()
        self.sse = False
        self.sbuf = bytearray()
        self.keep_alive = True
        self.first = -1.0
        self.last_tok = 0.0
        self.chunks = 0
        self.usage_ev: bytes | None = None
        self.done_seen = False
        self.stream_error = False

    # asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.idx >= 0:
            self.w.finish(self, E_DISCONNECT)
        else:
            self.w.forget(self)

    def data_received(self, data: bytes) -> None:
        if self.idx < 0:
            if self.transport is not None:
                self.transport.close()
            return
        if not self.in_body:
            self.head_buf += data
            i = self.head_buf.find(b"\r\n\r\n")
            if i < 0:
                return
            head = bytes(self.head_buf[:i + 2]).lower()
            data = bytes(self.head_buf[i + 4:])
            self.head_buf.clear()
            try:
                self.status = int(head[9:12])
            except ValueError:
                self.w.finish(self, E_PROTOCOL)
                return
            if self.status == 100:
                self.head_buf += data
                return
            self.head = head
            self.in_body = True
            self.keep_alive = b"\r\nconnection: close" not in head
            self.chunked = b"\r\ntransfer-encoding: chunked" in head
            self.sse = self.status == 200 and b"text/event-stream" in head
            if not self.chunked:
                cl = _header_int(head, b"content-length")
                if cl is None:
                    self.keep_alive = False
                    self.remaining = -1  # until the server closes
                else:
                    self.remaining = cl
            if not data:
                if not self.chunked and self.remaining == 0:
                    self.w.finish(self, E_NONE)
                return
        if self.chunked:
            self._dechunk(data)
        elif self.remaining < 0:
            self._payload(data)
        else:
            take = data[:self.remaining]
            self.remaining -= len(take)
            self._payload(take)
            if self.remaining == 0:
                self.w.finish(self, E_NONE)

    def eof_received(self) -> bool | None:
        if self.idx >= 0 and self.in_body and self.remaining < 0 and not self.chunked:
            self.keep_alive = False
            self.w.finish(self, E_NONE)
        return None

    # body handling -----------------------------------------------------------------

    def _dechunk(self, data: bytes) -> None:
        buf = self.cbuf
        buf += data
        pos = 0
        n = len(buf)
        while pos < n:
            if self.chunk_left > 0:
                take = min(self.chunk_left, n - pos)
                self._payload(bytes(buf[pos:pos + take]))
                pos += take
                self.chunk_left -= take
                if self.chunk_left == 0:
                    self.need_crlf = True
                continue
            if self.need_crlf:
                if n - pos < 2:
                    break
                pos += 2
                self.need_crlf = False
                continue
            j = buf.find(b"\r\n", pos)
            if j < 0:
                break
            line = bytes(buf[pos:j])
            pos = j + 2
            if self.in_trailer:
                if not line:
                    del buf[:pos]
                    self.w.finish(self, E_NONE)
                    return
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                self.w.finish(self, E_PROTOCOL)
                return
            if size == 0:
                self.in_trailer = True
            else:
                self.chunk_left = size
        del buf[:pos]

    def _payload(self, piece: bytes) -> None:
        if not self.sse:
            self.body += piece
            return
        now = monotonic()
        sbuf = self.sbuf
        sbuf += piece
        pos = 0
        while True:
            j = sbuf.find(b"\n\n", pos)
            if j < 0:
                break
            self._event(bytes(sbuf[pos:j]), now)
            pos = j + 2
        if pos:
            del sbuf[:pos]

    def _event(self, ev: bytes, now: float) -> None:
        if ev.startswith(b"data: [DONE]"):
            self.done_seen = True
            return
        if ev.startswith(b'data: {"error"'):
            self.stream_error = True
            self.body += ev[6:]
            return
        if b'"usage":{' in ev:
            self.usage_ev = ev
        if b'"choices":[]' in ev:
            return
        if b'"role":"assistant"' in ev and b'"content":""' in ev:
            return
        if b'"delta":{}' in ev or b'"delta":{"content":""}' in ev or b'"text":"",' in ev:
            return
        if self.first < 0:
            self.first = now
        else:
            self.w.itl.append(now - self.last_tok)
        self.last_tok = now
        self.chunks += 1


class Worker:
    """Runs one worker's share of a plan on one event loop; see the module docstring."""

    def __init__(self, cfg: ClientConfig, builder: PromptBuilder, plan: Plan,
                 indices: Sequence[int], progress: Any = None, slot: int = 0) -> None:
        self.cfg = cfg
        self.builder = builder
        self.plan = plan
        self.indices = list(indices)
        self.progress = progress
        self.base = slot * PROGRESS_FIELDS
        n = len(self.indices)
        nan = float("nan")
        self.res = WorkerResult(
            index=array("q", self.indices), sched=array("d", [nan]) * n,
            sent=array("d", [nan]) * n, first=array("d", [nan]) * n,
            end=array("d", [nan]) * n, status=array("i", [0]) * n,
            prompt=array("i", [-1]) * n, completion=array("i", [-1]) * n,
            cached=array("i", [-1]) * n, header_count=array("i", [-1]) * n, chunks=array("i", [0]) * n,
            error=array("b", [0]) * n, limit=array("b", [0]) * n,
            retry_after=array("d", [nan]) * n, reused=array("b", [0]) * n, itl=array("d"),
            request_id=[""] * n)
        self.itl = self.res.itl
        self.idle: list[Conn] = []
        self.waiting: deque[tuple[int, bytes]] = deque()
        self.busy: set[Conn] = set()
        self.n_conns = 0
        self.start = 0.0
        self.outstanding = 0
        self.next_closed = 0
        self.stop_closed_at = math.inf
        self.all_done: asyncio.Future[None] | None = None
        t = cfg.target
        self._heads = [self._head(k) for k in (cfg.keys or ("",))]
        self._host = (t.host, t.port)

    def _head(self, key: str) -> bytes:
        t = self.cfg.target
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        extra = "".join(f"{name}: {value}\r\n" for name, value in self.cfg.headers)
        return (f"POST {self.cfg.endpoint_path} HTTP/1.1\r\nHost: {t.host}:{t.port}\r\n"
                f"{auth}{extra}Content-Type: application/json\r\nContent-Length: ").encode()

    # -- request building -----------------------------------------------------------

    def request(self, j: int) -> bytes:
        """Wire bytes of this worker's j-th request."""
        i = self.indices[j]
        inp = int(self.plan.inputs[i])
        body = self.builder.body(i, inp, int(self.plan.outputs[i]), self.cfg.stream)
        extra = b"\r\nX-Token-Count: %d" % inp if self.cfg.send_token_count else b""
        return b"".join((self._heads[i % len(self._heads)], b"%d" % len(body), extra,
                         b"\r\n\r\n", body))

    # -- connections ----------------------------------------------------------------

    async def open_connection(self) -> Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: Conn(self), *self._host)
        self.res.connections_opened += 1
        return conn

    async def preopen(self, n: int) -> None:
        """Open ``n`` idle connections before the start (not part of any latency)."""
        conns = await asyncio.gather(*(self.open_connection() for _ in range(n)))
        self.idle.extend(conns)
        self.n_conns += len(conns)

    def forget(self, conn: Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
            self.n_conns -= 1

    def launch(self, j: int, data: bytes) -> None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                self._send(conn, j, data)
                return
            self.n_conns -= 1
        if self.n_conns < self.cfg.max_connections:
            # Dispatched now: the connect is the server's time (latency), not send lag.
            self.res.sent[j] = monotonic() - self.start
            self.n_conns += 1
            asyncio.get_running_loop().create_task(self._connect_and_send(j, data))
        else:
            self.waiting.append((j, data))

    async def _connect_and_send(self, j: int, data: bytes) -> None:
        try:
            conn = await self.open_connection()
        except OSError as e:
            self.n_conns -= 1
            self._record_failure(j, E_CONNECT, str(e))
            return
        self._send(conn, j, data, dispatched=True)

    def _send(self, conn: Conn, j: int, data: bytes, dispatched: bool = False) -> None:
        conn._reset()
        conn.idx = j
        if not dispatched:  # on a connection that was open before: idle or pre-opened
            self.res.sent[j] = monotonic() - self.start
            self.res.reused[j] = 1
        self.busy.add(conn)
        assert conn.transport is not None
        conn.transport.write(data)
        if self.progress is not None:
            self.progress[self.base + P_SENT] += 1
            self.progress[self.base + P_INFLIGHT] += 1

    # -- completion -----------------------------------------------------------------

    def _record_failure(self, j: int, code: int, text: str) -> None:
        r = self.res
        r.end[j] = monotonic() - self.start
        r.error[j] = code
        if len(r.error_samples) < 20:
            r.error_samples.append(f"{ERROR_NAMES[code]}: {text}"[:300])
        if self.progress is not None:
            self.progress[self.base + P_DONE] += 1
            self.progress[self.base + P_ERR] += 1
        if self.waiting and self.n_conns < self.cfg.max_connections:
            self.launch(*self.waiting.popleft())
        self._one_done()

    def finish(self, conn: Conn, code: int) -> None:
        """A response ended (``code`` E_NONE) or failed; record it, reuse the conn."""
        j = conn.idx
        if j < 0:
            return
        conn.idx = -1
        self.busy.discard(conn)
        r = self.res
        now = monotonic() - self.start
        r.end[j] = now
        r.status[j] = conn.status
        prog = self.progress
        if prog is not None:
            prog[self.base + P_INFLIGHT] -= 1
        if conn.head:
            rid = _header(conn.head, b"x-request-id")
            if rid:
                r.request_id[j] = rid.decode("latin-1")
        if code == E_NONE:
            code = self._parse(conn, j)
        elif conn.usage_ev:
            self._usage(conn.usage_ev, j)
        r.error[j] = code
        if conn.first >= 0:
            r.first[j] = conn.first - self.start
        r.chunks[j] = conn.chunks
        if prog is not None:
            b = self.base
            prog[b + P_DONE] += 1
            if code != E_NONE:
                prog[b + P_ERR] += 1
            elif conn.status == 429:
                prog[b + P_429] += 1
            elif conn.status == 200:
                prog[b + P_OK] += 1
                prog[b + P_OUT_TOKENS] += max(r.completion[j], 0)
                prog[b + P_IN_TOKENS] += max(r.prompt[j], 0)
            else:
                prog[b + P_ERR] += 1
        if code != E_NONE and len(r.error_samples) < 20:
            r.error_samples.append(f"{ERROR_NAMES[code]} (status {conn.status}): "
                                   f"{bytes(conn.body[:200])!r}")
        if code == E_NONE and conn.keep_alive and not conn.closed:
            if self.waiting:
                self._send(conn, *self.waiting.popleft())
            else:
                self.idle.append(conn)
        else:
            if conn.transport is not None and not conn.closed:
                conn.transport.close()
            conn.closed = True
            self.n_conns -= 1
            if self.waiting:
                self.launch(*self.waiting.popleft())
        self._one_done()

    def _parse(self, conn: Conn, j: int) -> int:
        r = self.res
        hc = _header_int(conn.head, b"x-token-count")
        if hc is not None:
            r.header_count[j] = hc
        if conn.status == 200:
            try:
                if conn.sse:
                    if conn.stream_error:
                        return E_STREAM
                    if not conn.done_seen:
                        if conn.usage_ev:
                            self._usage(conn.usage_ev, j)
                        return E_INCOMPLETE
                    usage = json.loads(conn.usage_ev[6:])["usage"] if conn.usage_ev else None
                else:
                    usage = json.loads(conn.body).get("usage")
            except (ValueError, KeyError, TypeError, AttributeError):
                return E_PROTOCOL
            if usage:
                self._store_usage(usage, j)
            if not conn.sse:
                # Non-streaming: the whole answer is the first token.
                r.first[j] = r.end[j]
            return E_NONE
        if conn.status == 429:
            r.limit[j] = classify_429(conn.head, bytes(conn.body))
            ra = _header_int(conn.head, b"retry-after")
            if ra is not None:
                r.retry_after[j] = ra
        elif len(r.error_samples) < 20:
            r.error_samples.append(f"status {conn.status}: {bytes(conn.body[:300])!r}")
        return E_NONE

    def _store_usage(self, usage: dict[str, Any], j: int) -> None:
        r = self.res
        r.prompt[j] = int(usage.get("prompt_tokens", -1))
        r.completion[j] = int(usage.get("completion_tokens", -1))
        details = usage.get("prompt_tokens_details") or {}
        r.cached[j] = int(details.get("cached_tokens") or 0)

    def _usage(self, event: bytes, j: int) -> None:
        """The cumulative usage of the last SSE event that carried one, of a stream that
        broke off (none stored when it does not parse)."""
        try:
            usage = json.loads(event[6:])["usage"]
            if isinstance(usage, dict):
                self._store_usage(usage, j)
        except (ValueError, KeyError, TypeError):
            pass

    def _one_done(self) -> None:
        self.outstanding -= 1
        if self.cfg.concurrency and self.next_closed < len(self.indices) \
                and monotonic() < self.stop_closed_at:
            j = self.next_closed
            self.next_closed += 1
            self.outstanding += 1
            self.res.sched[j] = monotonic() - self.start
            self.launch(j, self.request(j))
            return
        if self.outstanding <= 0 and self.all_done is not None and not self.all_done.done():
            self.all_done.set_result(None)

    # -- the run --------------------------------------------------------------------

    async def _sweep(self) -> None:
        """Fail requests that ran past ``timeout_s``."""
        while True:
            await asyncio.sleep(0.25)
            now = monotonic() - self.start
            for conn in list(self.busy):
                j = conn.idx
                if j >= 0 and now - self.res.sched[j] > self.cfg.timeout_s:
                    conn.status = 0
                    self.finish(conn, E_TIMEOUT)

    async def run(self, start: float) -> WorkerResult:
        """Send everything, wait for the answers (or timeouts); ``start`` is the
        monotonic time of offset 0, shared by all workers."""
        loop = asyncio.get_running_loop()
        self.start = start
        self.all_done = loop.create_future()
        sweeper = loop.create_task(self._sweep())
        n = len(self.indices)
        delay = start - monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if self.cfg.concurrency:
            self.stop_closed_at = start + self.cfg.duration_s
            first = min(self.cfg.concurrency, n)
            self.outstanding = first
            self.next_closed = first
            for j in range(first):
                self.res.sched[j] = monotonic() - start
                self.launch(j, self.request(j))
        else:
            times = [float(self.plan.times[i]) for i in self.indices]
            sched = self.res.sched
            self.outstanding = n
            j = 0
            while j < n:
                now = monotonic() - start
                while j < n and times[j] <= now:
                    sched[j] = times[j]
                    self.launch(j, self.request(j))
                    j += 1
                if j < n:
                    wait = times[j] - (monotonic() - start)
                    if wait > 0:
                        await asyncio.sleep(wait)
        if self.outstanding > 0:
            await self.all_done
        sweeper.cancel()
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        # Closed loop: only the requests actually sent are results.
        if self.cfg.concurrency:
            k = self.next_closed
            for col in self.res.columns().values():
                del col[k:]
            del self.res.request_id[k:]
        return self.res


def run_worker(cfg: ClientConfig, builder: PromptBuilder, plan: Plan, indices: Sequence[int],
               progress: Any, slot: int, pipe: Any) -> None:
    """Process entry point: pre-open connections, report ready, wait for the start
    time on ``pipe``, run, send the ``WorkerResult`` back on ``pipe``."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    worker = Worker(cfg, builder, plan, indices, progress, slot)
    try:
        loop.run_until_complete(worker.preopen(max(0, min(cfg.connections,
                                                          cfg.max_connections))))
    except OSError as e:
        pipe.send(("error", f"cannot connect to {cfg.target.url}: {e}"))
        return
    # A full collection of the inherited heap takes a while: do it before the start,
    # then keep the collector out of the timed loop.
    gc.collect()
    gc.freeze()
    gc.disable()
    pipe.send(("ready", None))
    msg, start = pipe.recv()
    if msg != "start":
        return
    cpu0 = time.process_time()
    result = loop.run_until_complete(worker.run(start))
    result.cpu_s = time.process_time() - cpu0
    pipe.send(("result", result))
    loop.close()
