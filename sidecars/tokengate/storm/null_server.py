"""Start and stop the fast upstream from Python (null server, bench, tests).

``FastUpstream`` renders the nginx config under ``var/run/<name>``, starts nginx in
the foreground as a child process, waits until ``/health`` answers and stops it
(SIGQUIT, graceful) on exit. With ``ttft_ms = itl_ms = 0`` it is the *null server*
TokenStorm measures its own ceiling against: it does almost no work per request.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from tokengate.storm import upstream

ROOT = Path(__file__).resolve().parents[3]
RUN_DIR = ROOT / "var" / "run"


def free_port() -> int:
    """A free TCP port on loopback (ephemeral range)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until GET ``url`` answers 200; raises ``RuntimeError`` on timeout or exit."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready after {timeout_s:g} s")


class FastUpstream:
    """The fast upstream as a context manager: ``with FastUpstream(opts) as up: up.url``."""

    def __init__(self, opts: upstream.UpstreamOptions | None = None, port: int | None = None,
                 name: str = "fast-upstream") -> None:
        self.opts = opts or upstream.UpstreamOptions()
        self.port = port or free_port()
        self.prefix = RUN_DIR / f"{name}-{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL (…/v1)."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> FastUpstream:
        conf = upstream.render(self.opts, self.prefix, self.port)
        log = open(self.prefix / "stdout.log", "ab")
        self.proc = subprocess.Popen(upstream.argv(conf), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        try:
            wait_http(f"http://127.0.0.1:{self.port}/health", 20, self.proc)
        except RuntimeError as e:
            self.stop()
            err = (self.prefix / "error.log")
            tail = err.read_text()[-2000:] if err.exists() else ""
            raise RuntimeError(f"fast upstream on port {self.port}: {e}\n{tail}") from e
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> FastUpstream:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
