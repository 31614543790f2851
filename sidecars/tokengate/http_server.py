"""A bounded HTTP listener for the WSGI apps of the sidecars (the console, the batch
service), on a TCP port or a unix socket: the standard library's WSGI server, with
bounds so that slow
or many clients cannot take its threads or memory:

- ``WORKERS`` threads serve connections; up to ``QUEUED`` more wait for one; beyond
  that a connection is answered 503 and closed at once (no thread);
- every read of a connection times out after ``READ_TIMEOUT_S`` (a client that stops
  sending loses its connection, and its worker goes to the next), and the whole request
  (line, headers and body) must arrive within ``REQUEST_DEADLINE_S`` (one byte every few
  seconds does not hold a worker either);
- the listen backlog is ``BACKLOG`` (socketserver's default is 5).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

WORKERS = 8              # threads serving connections
QUEUED = 64              # connections waiting for a worker; more: 503 and closed
READ_TIMEOUT_S = 10.0    # each read of a request (and each write of its answer)
REQUEST_DEADLINE_S = 30.0  # the whole request read, from the connection's accept
BACKLOG = 128            # the listen socket's backlog of unaccepted connections
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
        b"Retry-After: 1\r\nContent-Length: 24\r\nConnection: close\r\n\r\n"
        b"the console is too busy\n")


class _Server(WSGIServer):
    """A WSGI server whose connections are served by a bounded pool of threads."""

    allow_reuse_address = True
    request_queue_size = BACKLOG
    workers = WORKERS
    queued = QUEUED

    def server_activate(self) -> None:
        super().server_activate()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="console")
        # a connection holds a slot from accept to close: served or waiting
        self._slots = threading.BoundedSemaphore(self.workers + self.queued)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 (socketserver's own way: log, close, go on)
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that stopped sending (the read timed out) or went away is no error
        import sys

        if not isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _UnixServer(_Server):
    """The bounded server on a unix socket of mode 0660: its owner and its group (the
    units' www-data: nginx's workers) connect, no other local user does."""

    address_family = socket.AF_UNIX
    allow_reuse_address = False

    def __init__(self, path: str, handler: type[_Handler]) -> None:
        self.path = path
        # socketserver takes the path as the address (typed as a host and port there)
        super().__init__(path, handler)  # type: ignore[arg-type]

    def server_bind(self) -> None:
        path = self.path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # the socket of a run that was killed
        self.socket.bind(path)
        os.chmod(path, 0o660)
        self.server_name, self.server_port = "localhost", 0
        self.setup_environ()

    def get_request(self) -> tuple[socket.socket, tuple[str, int]]:
        conn, _ = self.socket.accept()
        return conn, ("unix", 0)  # a unix peer has no address; WSGI wants a host

    def server_close(self) -> None:
        super().server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _DeadlineSocket(io.RawIOBase):
    """A connection's reads, each of which ends by one deadline (monotonic): every
    ``recv`` waits at most what is left of it (and at most the read timeout), and one
    that starts past it raises ``TimeoutError``; a buffered reader's ``readline``
    (a header trickled a byte at a time) is many of them."""

    def __init__(self, sock: socket.socket, timeout_s: float, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._timeout_s = timeout_s
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within its deadline")
        self._sock.settimeout(min(self._timeout_s, left))
        return self._sock.recv_into(buffer)


class _Handler(WSGIRequestHandler):
    # a form's fields come in the body; an overlong request line or header is refused
    # by http.server itself (414 / 431)
    timeout = READ_TIMEOUT_S   # StreamRequestHandler: the connection's socket timeout
    deadline_s = REQUEST_DEADLINE_S

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own reader, unused (it holds a reference)
        self.rfile = io.BufferedReader(_DeadlineSocket(
            self.connection, self.timeout, time.monotonic() + self.deadline_s))

    def log_message(self, format: str, *args: Any) -> None:
        pass


def listen(host: str, port: int, app: Callable[..., Any]) -> WSGIServer:
    """A bounded server of ``app`` bound to ``host``:``port`` (not yet serving:
    ``serve``, or its ``serve_forever``). Raises ``OSError``."""
    return make_server(host, port, app, _Server6 if ":" in host else _Server,
                       handler_class=_Handler)


def listen_unix(path: str, app: Callable[..., Any]) -> WSGIServer:
    """A bounded server of ``app`` on the unix socket ``path`` (mode 0660; a file left
    there is replaced), not yet serving. Raises ``OSError``."""
    server = _UnixServer(path, _Handler)
    server.set_app(app)
    return server


def serve(server: WSGIServer) -> threading.Event:
    """Serve ``server`` on a thread of its own; returns the event that SIGTERM and SIGINT
    set (the caller stops: ``server.shutdown()``, ``server.server_close()``)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=server.serve_forever, name="http-accept", daemon=True).start()
    return stop
