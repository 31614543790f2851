"""A loopback HTTP/1.1 forwarder that records what a client sent and what it got back.

The agent tests put it between a real client (Codex CLI, Claude Code, the Agents SDK,
LangChain) and the edge, so they know every request the client made, independently of
the edge's own usage events: method, path, the headers that carry a session, the body's
output limit and size, and the answer's status, ``X-Request-Id`` and ``X-Token-Count``.
Bodies and answers pass unchanged, streams chunk by chunk as they arrive.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# hop-by-hop headers (RFC 9110 7.6.1) and the ones this forwarder sets itself
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer",
        "transfer-encoding", "upgrade", "content-length", "host"}


@dataclass
class Exchange:
    """One request a client sent through the proxy, and the answer's head."""

    method: str
    path: str
    headers: dict[str, str]          # request headers, names lower-cased
    body: dict[str, Any] | None      # the JSON body (None: none, or not JSON)
    body_bytes: int
    status: int = 0
    response_headers: dict[str, str] = field(default_factory=dict)  # lower-cased names

    @property
    def request_id(self) -> str | None:
        return self.response_headers.get("x-request-id")

    @property
    def token_count(self) -> int | None:
        value = self.response_headers.get("x-token-count")
        return int(value) if value is not None else None


class RecordingProxy:
    """Forwards every request on ``http://127.0.0.1:<port>`` to ``upstream``
    (``host:port``) and appends an ``Exchange`` to ``exchanges`` when the answer's head
    has been sent on. ``start()``, then ``stop()``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                body = self._read_body()
                ex = Exchange(self.command, self.path,
                              {k.lower(): v for k, v in self.headers.items()},
                              _json_or_none(body), len(body))
                host, _, port = proxy.upstream.rpartition(":")
                conn = http.client.HTTPConnection(host, int(port), timeout=600)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                    conn.putheader("Host", proxy.upstream)
                    for k, v in self.headers.items():
                        if k.lower() not in _HOP:
                            conn.putheader(k, v)
                    if body or self.command in ("POST", "PUT", "PATCH"):
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body or None)
                    resp = conn.getresponse()
                    ex.status = resp.status
                    ex.response_headers = {k.lower(): v for k, v in resp.getheaders()}
                    with proxy._lock:
                        proxy.exchanges.append(ex)
                    self._send_back(resp)
                finally:
                    conn.close()

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send_back(self, resp: http.client.HTTPResponse) -> None:
                self.send_response_only(resp.status, resp.reason)
                length = resp.getheader("Content-Length")
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                head_only = self.command == "HEAD" or resp.status in (204, 304)
                if length is not None or head_only:
                    if length is not None:
                        self.send_header("Content-Length", length)
                    self.end_headers()
                    if not head_only:
                        self.wfile.write(resp.read())
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def posts(self) -> list[Exchange]:
        """The POST requests so far (the API calls; not HEAD / probes or GET /v1/models)."""
        with self._lock:
            return [ex for ex in self.exchanges if ex.method == "POST"]


def _json_or_none(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
