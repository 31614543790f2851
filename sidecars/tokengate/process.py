"""Child processes with a readiness probe: what TokenStorm's fast upstream and the
development stack start.

A ``Service`` is an argv, an environment, a readiness probe and a log file. ``start``
runs it in its own process group (so ``stop`` reaches its children too) and waits until
the probe answers; a process that exits or stays unready raises ``ServiceError`` with
the tail of its log.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class ServiceError(RuntimeError):
    """A service exited or did not become ready in time; the message quotes its log."""


def tcp_ready(host: str, port: int) -> Callable[[], bool]:
    """Probe: a TCP connect to host:port succeeds."""

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
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


def free_port() -> int:
    """A free TCP port on loopback (ephemeral range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    """One child process: ``argv`` run in ``cwd`` (default: the caller's), stdout and
    stderr appended to ``<log_dir>/<name>.log`` (default: the system's temp folder)."""

    name: str
    argv: list[str]
    ready: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 60.0
    cwd: Path | None = None
    log_dir: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return (self.log_dir or Path(tempfile.gettempdir())) / f"{self.name}.log"

    def start(self) -> Service:
        """Start the process and wait until ``ready()``; raises ``ServiceError``."""
        if self.ready():
            raise ServiceError(f"{self.name}: its address is already in use by another process")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServiceError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise ServiceError(f"{self.name} not ready after {self.start_timeout_s:.0f} s:\n"
                           + self.log_tail())

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL after ``timeout_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
