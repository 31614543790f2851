"""How a tokengate gRPC sidecar runs: worker processes, listeners, health, reflection.

Python holds one GIL per process, so a sidecar (``tokengate-counter``,
``tokengate-limits``) runs N worker processes (``run_workers``). Every worker listens on
the same TCP addresses (``SO_REUSEPORT``: the kernel spreads connections; none at all
is allowed when a unix socket is given) and, when a unix socket PATH is given, on its
own socket ``PATH.<i>`` (i = 0..N-1, mode 0660: the owner and the process's group, which
the systemd units set to nginx's workers' group), which the nginx edge lists as the
servers of its upstream. The parent restarts a worker that dies and stops all of them
on SIGTERM/SIGINT; a worker gets SIGTERM when its parent dies (Linux), so none outlives
a parent killed with SIGKILL.

A worker binds its unix socket under a private name and renames it to ``PATH.<i>``
once it listens (a client never sees a half-ready socket, and the rename replaces a
dead worker's file atomically); on exit it removes ``PATH.<i>`` only while that is still
the socket it created. gRPC itself unlinks the path it bound when the server stops,
which is why that path is the private one: a worker that outlived its parent would
otherwise remove the socket of the worker started in its place.

Each worker serves, next to its own services, the standard health service
(``grpc.health.v1.Health``: SERVING for "" and every service once it listens, NOT_SERVING
while it shuts down) and server reflection (``grpcurl`` works without the .proto files).
``serve`` is the blocking flavour (a thread-pool ``grpc.server``), ``serve_async`` the
asyncio one (``grpc.aio.server``); both return after SIGTERM/SIGINT and a graceful stop.

SIGHUP reloads the configuration without dropping a call: the parent passes it on to
every worker, and each worker's ``on_reload`` (given to ``serve``/``serve_async``)
builds its new state from the file and swaps it in; calls in flight finish with the
state they started with, later ones get the new one. A reload that fails (a broken
file) is logged and the worker keeps serving the old configuration.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.context import ForkContext, SpawnContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("tokengate.grpc_server")

# Every worker binds the same TCP port: without SO_REUSEPORT the second one fails.
OPTIONS: list[tuple[str, Any]] = [("grpc.so_reuseport", 1)]
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
RELOAD_POLL_S = 0.1  # how soon serve()'s main thread acts on a SIGHUP, s


SUN_PATH_MAX = 107  # bytes of a unix socket path: sun_path[108] less its NUL, unix(7)


@dataclass(frozen=True)
class Listen:
    """Where the workers listen: ``tcp`` addresses (``host:port``, shared by every
    worker) and, when ``unix_socket`` is set, worker i's own ``<unix_socket>.<i>``.

    Raises ValueError when there is no address, or when a worker's socket path (up to
    100 workers) or the name it binds first (``UnixSocket.private``) is longer than a
    unix socket address holds (``sun_path``: 107 bytes on Linux, see unix(7))."""

    tcp: tuple[str, ...]
    unix_socket: str | None = None

    def __post_init__(self) -> None:
        if not self.tcp and not self.unix_socket:
            raise ValueError("no address to listen on: give a TCP address or a unix socket")
        if self.unix_socket:
            path = Path(f"{self.socket_of(99)}")
            for p in (path, UnixSocket.private_of(path, 4194304)):  # pid_max on 64-bit
                if len(os.fsencode(p)) > SUN_PATH_MAX:
                    raise ValueError(
                        f"unix socket {self.unix_socket}: a worker's path such as {p} is "
                        f"{len(os.fsencode(p))} bytes; a unix socket path holds at most "
                        f"{SUN_PATH_MAX}: choose a shorter folder")

    def socket_of(self, index: int) -> str | None:
        return f"{self.unix_socket}.{index}" if self.unix_socket else None

    def addresses(self, index: int) -> list[str]:
        """gRPC addresses of worker ``index``: the TCP ones, then ``unix:<path>``."""
        sock = self.socket_of(index)
        return [*self.tcp, *([f"unix:{sock}"] if sock else [])]


@dataclass(frozen=True)
class UnixSocket:
    """A worker's unix socket: ``path`` (``PATH.<i>``, what clients connect to) and
    ``private`` (what is bound first: ``.bind.<pid>`` in the same folder, so that a
    rename reaches ``path``; short, as both must fit ``SUN_PATH_MAX``)."""

    path: Path
    private: Path

    @staticmethod
    def private_of(path: Path, pid: int) -> Path:
        return path.with_name(f".bind.{pid}")

    @classmethod
    def of(cls, listen: Listen, index: int) -> UnixSocket | None:
        sock = listen.socket_of(index)
        if not sock:
            return None
        path = Path(sock)
        return cls(path, cls.private_of(path, os.getpid()))

    def publish(self) -> tuple[int, int]:
        """Make the bound socket reachable at ``path``; returns its identity,
        ``(st_dev, st_ino)``."""
        # nginx's workers run as another user: the group (the units' Group=, nginx's
        # workers' group) may connect, other local users may not. Set before the
        # rename: the socket is never reachable with a wider mode.
        os.chmod(self.private, 0o660)
        st = os.stat(self.private)
        os.replace(self.private, self.path)
        return st.st_dev, st.st_ino

    def withdraw(self, identity: tuple[int, int] | None) -> None:
        """Remove ``path`` if it is still the socket published as ``identity`` (a
        worker started in this one's place may have replaced it)."""
        if identity is None:
            return
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == identity:
                self.path.unlink()
        except FileNotFoundError:
            pass


def bind(server: grpc.Server | grpc.aio.Server, listen: Listen, index: int,
          services: Sequence[str],
          servicer: health.HealthServicer | health.aio.HealthServicer
          ) -> tuple[list[str], UnixSocket | None]:
    """Add health, reflection and the worker's ports to ``server``; returns the
    addresses clients use (``unix:PATH.<i>`` last) and the unix socket to publish once
    the server started."""
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (*services, HEALTH_SERVICE, reflection.SERVICE_NAME), server)
    sock = UnixSocket.of(listen, index)
    for addr in listen.tcp:
        server.add_insecure_port(addr)
    if sock is None:
        return list(listen.tcp), None
    sock.path.parent.mkdir(parents=True, exist_ok=True)
    # left by a worker of this pid that was killed (pids are reused); bind would fail
    sock.private.unlink(missing_ok=True)
    server.add_insecure_port(f"unix:{sock.private}")
    return [*listen.tcp, f"unix:{sock.path}"], sock


def reload(on_reload: Callable[[], None] | None) -> None:
    """Run a SIGHUP's ``on_reload``; a failure is logged, the old state keeps serving."""
    if on_reload is None:
        log.info("SIGHUP: nothing to reload")
        return
    try:
        on_reload()
    except Exception:  # a broken file must not stop a serving worker
        log.exception("reload failed, serving the previous configuration")


def serve(server: grpc.Server, services: Sequence[str], listen: Listen, index: int,
          grace_s: float, on_ready: Callable[[list[str]], None] | None = None,
          on_reload: Callable[[], None] | None = None) -> None:
    """Serve ``server`` (its servicers already added) as worker ``index`` until
    SIGTERM/SIGINT, then stop, letting calls in flight finish for ``grace_s`` seconds.
    ``services``: full names reported SERVING; ``on_ready(addresses)`` once listening;
    ``on_reload()`` on SIGHUP, in the main thread while the server's threads serve."""
    servicer = health.HealthServicer()
    addresses, sock = bind(server, listen, index, services, servicer)
    stop = threading.Event()
    hup = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
    identity = None
    try:
        server.start()
        identity = sock.publish() if sock else None
        for name in ("", *services):
            servicer.set(name, SERVING)
        if on_ready is not None:
            on_ready(addresses)
        while not stop.wait(RELOAD_POLL_S):
            if hup.is_set():
                hup.clear()
                reload(on_reload)
        servicer.enter_graceful_shutdown()
    finally:
        # first: new connections go to the other workers while calls in flight finish
        if sock is not None:
            sock.withdraw(identity)
        server.stop(grace=grace_s).wait()


async def serve_async(server: grpc.aio.Server, services: Sequence[str], listen: Listen,
                      index: int, grace_s: float,
                      on_ready: Callable[[list[str]], None] | None = None,
                      servicer: health.aio.HealthServicer | None = None,
                      on_reload: Callable[[], None] | None = None) -> None:
    """``serve`` for an asyncio server. ``servicer``: the health servicer, when the
    caller reports more than SERVING at start (a service that turns NOT_SERVING while
    its backend is down); a new one otherwise. ``on_reload()`` runs in the event loop."""
    servicer = servicer or health.aio.HealthServicer()
    addresses, sock = bind(server, listen, index, services, servicer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload, on_reload)
    identity = None
    try:
        await server.start()
        identity = sock.publish() if sock else None
        for name in ("", *services):
            await servicer.set(name, SERVING)
        if on_ready is not None:
            on_ready(addresses)
        await stop.wait()
        await servicer.enter_graceful_shutdown()
    finally:
        if sock is not None:
            sock.withdraw(identity)
        await server.stop(grace=grace_s)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel send this process SIGTERM when its parent dies (a
    SIGKILLed parent cannot stop its workers itself); exits at once when the parent is
    already gone. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    # the parent may have died before prctl: then no signal will ever come
    if os.getppid() != parent_pid:
        sys.exit(f"worker: parent {parent_pid} exited before this worker started")


def _worker(parent_pid: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    # a SIGHUP before serve() installs its handler would end the process (the default
    # action): this worker is reading the file then anyway
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # a forked worker has the parent's handlers, which only note a stop: until serve()
    # installs its own, SIGTERM and SIGINT end it as they end a spawned one
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with_parent(parent_pid)
    target(*args)


def run_workers(name: str, target: Callable[..., None], args: tuple[Any, ...],
                workers: int, listen: Listen | None = None,
                preload: Callable[[], object] | None = None) -> None:
    """Run ``target(*args, index)`` for index 0..workers-1, each in its own process,
    until SIGTERM/SIGINT; a worker that dies is started again, a worker whose parent
    dies gets SIGTERM; SIGHUP is passed on to every worker. With one worker it runs in
    this process. Returns once every worker stopped (SIGKILL after 5 s).
    ``listen``: the workers' addresses; the unix socket of a worker that died (killed:
    it could not withdraw it) is removed before the next one starts, so that a client
    finds no file, as after a clean stop, instead of one that refuses connections
    (nginx logs each refused connect, not a missing file the edge looked for first).
    ``preload``: called once in this process before the first worker starts; the
    workers are then forked from it and share what it loaded (copy-on-write: the
    counter's parsed tokenizers; a worker started in a dead one's place is serving in
    a fraction of a spawned one's time). It must start no thread, create no gRPC
    server or channel and, for metrics in the workers, run after ``metrics.serve``
    (prometheus_client picks its multiprocess mode when first imported). Without it
    the workers are spawned: each imports everything anew."""
    if workers <= 1:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve() handles it
        target(*args, 0)
        return
    if preload is not None:
        preload()
    ctx: ForkContext | SpawnContext = (multiprocessing.get_context("spawn") if preload is None
                                       else multiprocessing.get_context("fork"))
    procs: dict[int, BaseProcess] = {}
    stopping = False

    def start(i: int) -> None:
        # started from this (the main) thread: PDEATHSIG fires when the thread that
        # forked exits, which here is when the process does
        procs[i] = ctx.Process(target=_worker, args=(os.getpid(), target, (*args, i)),
                               name=f"{name}-{i}", daemon=True)
        procs[i].start()

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def on_hup(signum: int, frame: object) -> None:
        for p in list(procs.values()):
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGHUP)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hup)
    for i in range(workers):
        start(i)
    while not stopping:
        time.sleep(0.5)
        for i, p in list(procs.items()):
            if not p.is_alive() and not stopping:
                print(f"{name} worker {i} exited with {p.exitcode}; restarting", flush=True)
                sock = listen.socket_of(i) if listen is not None else None
                if sock:
                    Path(sock).unlink(missing_ok=True)
                start(i)
    for p in procs.values():
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    for p in procs.values():
        p.join(5)
        if p.is_alive():
            p.kill()
