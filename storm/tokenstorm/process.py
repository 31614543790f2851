"""Child processes with a readiness probe: what TokenStorm's fast upstream and simulated
replicas, the development stack and the tests start, and the supervisor that keeps the
stack up. It lives in TokenStorm, which the development tooling and the tests depend on,
so that the runtime package (``tokengate``), which never starts a child this way, does
not ship it.

A ``Service`` is an argv, an environment, a readiness probe and a log file. ``start``
runs it in its own session and process group and waits until the probe answers; a
process that exits or stays unready raises ``ServiceError`` with the tail of its log.
``stop`` signals the whole group and waits until none of it is alive, so the workers
of a main process that was killed with SIGKILL (nginx's, vLLM's engine core) go too.

A ``Supervisor`` starts services in order and restarts one that dies, after a delay
that doubles while it keeps dying (``Backoff``), until ``request_stop``.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class ServiceError(RuntimeError):
    """A service exited or did not become ready in time; the message quotes its log."""


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes of process group ``pgid`` (zombies, which are dead and
    only wait for their parent, excluded). Linux reads /proc; elsewhere ``[pgid]``
    while anything of the group can be signalled."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
        fields = stat[stat.rindex(b")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            pids.append(int(entry))
    return pids


def tcp_ready(host: str, port: int) -> Callable[[], bool]:
    """Probe: a TCP connect to host:port succeeds."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    return probe


def unix_ready(path: str) -> Callable[[], bool]:
    """Probe: a connect to the unix socket at path succeeds."""

    def probe() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            try:
                s.connect(path)
                return True
            except OSError:
                return False

    return probe


def http_ready(url: str) -> Callable[[], bool]:
    """Probe: GET url answers 200."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    return probe


_HANDED_OUT = Path(tempfile.gettempdir()) / "tokengate-free-ports"
_HELD_S = 300.0


def _above_ephemeral() -> range:
    """The ports above Linux's ephemeral range (``ip_local_port_range``, 32768-60999 by
    default), which the kernel never picks for a bind to port 0; empty where the range
    reaches 65535 or cannot be read."""
    try:
        hi = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(hi + 1, 65536)


# Ports free_port() hands out: above the kernel's ephemeral range, where every bind to
# port 0 lands (a torch.distributed store, a chromedriver, a connection's source port),
# and far above the tests' fixed ports (tests/test_conftest.py).
FREE_PORTS = _above_ephemeral()


def free_port() -> int:
    """A free TCP port on loopback from ``FREE_PORTS`` (the kernel's choice where that
    range is too small) that no other ``free_port()`` on this machine handed out in the
    last 5 minutes.

    The port is free when this returns, and stays so only until the caller's process
    binds it, seconds later. Two things could take it meanwhile: another process's
    ``free_port()`` (seen with three test workers: two services on one port, "address
    already in use"), so each port handed out is marked by a file in
    ``$TMPDIR/tokengate-free-ports`` (created exclusively; older than 5 minutes it no
    longer counts) and a marked port is passed over; and any process that binds port 0
    (the kernel's choice, seen: a make-run stack's nginx found its port taken), which
    ``FREE_PORTS`` keeps out of the kernel's range. Where the folder cannot be written,
    a free port is returned unmarked. Raises ``OSError`` when none of 256 tries is free."""
    for _ in range(256):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1",
                        random.choice(FREE_PORTS) if len(FREE_PORTS) >= 256 else 0))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        if _claim(_HANDED_OUT / str(port)):
            return port
    raise OSError("no free port found in 256 tries")


def _claim(mark: Path) -> bool:
    """Marks a port as handed out: False when another call marked it less than
    ``_HELD_S`` ago; True when this call marked it, or when no mark can be written."""
    try:
        mark.parent.mkdir(exist_ok=True)
        if mark.exists() and time.time() - mark.stat().st_mtime > _HELD_S:
            mark.unlink(missing_ok=True)
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


@dataclass
class Service:
    """One child process: ``argv`` run in ``cwd`` (default: the caller's), stdout and
    stderr appended to ``<log_dir>/<name>.log`` (default: the system's temp folder).
    ``prepare`` runs before every start (removes what a previous run left that the
    probe would take for readiness)."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 60.0
    cwd: Path | None = None
    log_dir: Path | None = None
    prepare: Callable[[], None] | None = None
    proc: subprocess.Popen[bytes] | None = None
    _deadline: float = field(default=0.0, init=False, repr=False)

    @property
    def log_path(self) -> Path:
        return (self.log_dir or Path(tempfile.gettempdir())) / f"{self.name}.log"

    def start(self) -> Service:
        """Start the process and wait until ``ready()``; raises ``ServiceError``."""
        self.spawn()
        while not self.poll_start():
            time.sleep(0.25)
        return self

    def spawn(self) -> None:
        """Start the process in a session (and process group) of its own and return at
        once; ``poll_start`` tells when it is ready. Raises ``ServiceError`` when the
        probe answers before anything started (another process holds the address)."""
        if self.prepare is not None:
            self.prepare()
        if self.ready():
            raise ServiceError(f"{self.name}: its address is already in use by another process")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self._deadline = time.monotonic() + self.start_timeout_s

    def poll_start(self) -> bool:
        """True once a spawned process is ready; raises ``ServiceError`` (after stopping
        what is left of it) when it exited or ``start_timeout_s`` passed."""
        assert self.proc is not None, "poll_start before spawn"
        if self.proc.poll() is not None:
            self.stop()
            raise ServiceError(f"{self.name} exited with {self.proc.returncode}:\n"
                               + self.log_tail())
        if self.ready():
            return True
        if time.monotonic() >= self._deadline:
            self.stop()
            raise ServiceError(f"{self.name} not ready after {self.start_timeout_s:.0f} s:\n"
                               + self.log_tail())
        return False

    def alive(self) -> bool:
        """The main process runs (it was started and has not exited)."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; returns once no
        process of the group is alive (at most 30 s after the SIGKILL: a killed process
        with a large address space, vLLM's engine core loading torch, can take seconds to
        exit on a loaded machine). Also stops what is left of a group whose main process
        has already exited."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the main process leads its group
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 30.0)):
            if self._group_gone(pgid):
                return
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self._group_gone(pgid):
                    return
                time.sleep(0.05)

    def _group_gone(self, pgid: int) -> bool:
        assert self.proc is not None
        return self.proc.poll() is not None and not group_members(pgid)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _shown(path: Path) -> Path:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path


@dataclass(frozen=True)
class Backoff:
    """Delays before restarting a service that died, s: ``first_s``, doubled after each
    death or failed restart up to ``max_s``, back to ``first_s`` once the service stayed
    up for ``stable_s``."""

    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0


@dataclass
class _Child:
    svc: Service
    state: str = "pending"      # pending -> starting -> up -> waiting -> starting ...
    started_once: bool = False  # was ready once: a failure now is a restart's
    delay_s: float = 0.0        # delay of the restart under way
    next_delay_s: float = 0.0   # delay of the next one
    due: float = 0.0            # monotonic time of the restart under way
    exit_code: int | None = None
    up_since: float = 0.0
    held_until: float = 0.0     # monotonic time before which it is not started again


class Supervisor:
    """Starts ``services`` in order (each once the one before is ready) and keeps them
    up: a service whose main process exits is stopped entirely (what is left of its
    process group), then started again after the ``Backoff`` delay; each event is one
    line through ``say`` (``counter exited (exit -9); restarting in 1 s``, then
    ``restarted counter (exit -9) after 1 s``). The other services stay up meanwhile.

    ``run`` returns after ``request_stop`` (safe from a signal handler: it only sets a
    flag), having stopped every service in reverse order, also one still starting.
    A service that fails its first start raises ``ServiceError`` from ``run`` (after
    the same cleanup): a configuration or address problem that restarts would hide.
    ``hold`` keeps a service that an operator stops down for a while; ``state`` tells
    where a service is (both callable from another thread).
    """

    def __init__(self, services: Sequence[Service], say: Callable[[str], None] = print,
                 backoff: Backoff = Backoff(), tick_s: float = 0.2) -> None:
        self.children = [_Child(s, next_delay_s=backoff.first_s) for s in services]
        self.say = say
        self.backoff = backoff
        self.tick_s = tick_s
        self._stop = False

    def request_stop(self) -> None:
        self._stop = True

    def stopping(self) -> bool:
        return self._stop

    def _child(self, name: str) -> _Child:
        for c in self.children:
            if c.svc.name == name:
                return c
        raise KeyError(name)

    def hold(self, name: str, seconds: float) -> None:
        """Service ``name``, when it exits within the next ``seconds``, is started again
        only once they have passed (or after its backoff delay, when that is later): an
        operator's ``systemctl stop`` and ``start``. KeyError for an unknown name."""
        self._child(name).held_until = time.monotonic() + seconds

    def state(self, name: str) -> str:
        """Where service ``name`` is: "pending" (not started yet), "starting", "up" or
        "waiting" (to be restarted). KeyError for an unknown name."""
        return self._child(name).state

    def run(self, on_up: Callable[[], None] | None = None) -> None:
        """Supervise until ``request_stop``; ``on_up()`` once, when every service was
        ready for the first time. Raises ``ServiceError`` (see the class)."""
        announced = False
        try:
            while not self._stop:
                self._tick(time.monotonic())
                if not announced and all(c.state == "up" for c in self.children):
                    announced = True
                    if on_up is not None:
                        on_up()
                time.sleep(self.tick_s)
        finally:
            for c in reversed(self.children):
                c.svc.stop()

    def _tick(self, now: float) -> None:
        for i, c in enumerate(self.children):
            if self._stop:
                return
            if c.state == "pending":
                if i == 0 or self.children[i - 1].started_once:
                    self.say(f"starting {c.svc.name} (log: {_shown(c.svc.log_path)}) ...")
                    c.svc.spawn()
                    c.state = "starting"
                return  # in order: nothing after a service not yet started
            if c.state == "starting":
                try:
                    ready = c.svc.poll_start()
                except ServiceError as e:
                    if not c.started_once:
                        raise
                    first = str(e).partition("\n")[0]
                    self._schedule(c, now, f"restarting {c.svc.name} failed ({first})")
                    continue
                if ready:
                    c.state, c.up_since = "up", now
                    if c.started_once:
                        self.say(f"restarted {c.svc.name} (exit {c.exit_code}) "
                                 f"after {round(c.delay_s, 1):g} s")
                    c.started_once = True
            elif c.state == "up" and not c.svc.alive():
                assert c.svc.proc is not None
                c.exit_code = c.svc.proc.returncode
                c.svc.stop(timeout_s=3.0)
                if now - c.up_since >= self.backoff.stable_s:
                    c.next_delay_s = self.backoff.first_s
                self._schedule(c, now, f"{c.svc.name} exited (exit {c.exit_code})")
            elif c.state == "waiting" and now >= c.due:
                try:
                    c.svc.spawn()
                    c.state = "starting"
                except ServiceError as e:
                    self._schedule(c, now, f"restarting {c.svc.name} failed ({e})")

    def _schedule(self, c: _Child, now: float, why: str) -> None:
        c.delay_s = max(c.next_delay_s, c.held_until - now)
        c.next_delay_s = min(2 * c.next_delay_s, self.backoff.max_s)
        c.state, c.due = "waiting", now + c.delay_s
        self.say(f"{why}; restarting in {round(c.delay_s, 1):g} s")
