"""tokenstorm.process: ``Service.stop`` ends a whole process group, ``Supervisor`` restarts
with backoff and stops everything, also what is still starting.

Real processes (``sh``, ``sleep``), no sockets; each test takes about a second.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from tokenstorm.process import Backoff, Service, ServiceError, Supervisor, group_members

from tests.fixtures_ledger import wait_until

# pure: starts no process of the stack (make test-unit)
pytestmark = pytest.mark.unit


def flag_service(tmp_path: Path, name: str, script: str) -> Service:
    """``sh -c script`` with ``$F`` a flag file the script touches when it is "ready"."""
    flag = tmp_path / f"{name}.ready"
    return Service(name, ["sh", "-c", script], flag.exists, env={"F": str(flag)},
                   start_timeout_s=10.0, log_dir=tmp_path,
                   prepare=lambda: flag.unlink(missing_ok=True))


class Said:
    """A supervisor's ``say``: keeps its lines; ``done`` is set once ``restarts`` of them
    said that a service was restarted."""

    def __init__(self, restarts: int) -> None:
        self.lines: list[str] = []
        self.done = threading.Event()
        self.restarts = restarts

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if sum(x.startswith("restarted") for x in self.lines) >= self.restarts:
            self.done.set()


def supervise(sup: Supervisor, until: threading.Event, timeout_s: float = 20.0) -> None:
    """Run ``sup`` in a thread until ``until`` is set, then stop it; re-raises its error."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            sup.run()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    until.wait(timeout_s)
    sup.request_stop()
    t.join(30)
    assert not t.is_alive(), "the supervisor did not return after request_stop"
    if errors:
        raise errors[0]


def restarted(tmp_path: Path, name: str, script: str, restarts: int,
              stable_s: float) -> list[str]:
    """The lines of a supervisor of ``flag_service(name, script)`` (backoff from 0.1 s,
    doubling up to 0.4 s, back to the first after ``stable_s`` up) until it said
    ``restarts`` times that it restarted it."""
    said = Said(restarts)
    svc = flag_service(tmp_path, name, script)
    sup = Supervisor([svc], say=said,
                     backoff=Backoff(first_s=0.1, max_s=0.4, stable_s=stable_s), tick_s=0.02)
    supervise(sup, said.done)
    return said.lines


def test_stop_ends_the_group_of_a_main_process_killed_with_sigkill(tmp_path: Path) -> None:
    svc = flag_service(tmp_path, "pair", "sleep 300 & touch $F; wait").start()
    assert svc.proc is not None
    pgid = svc.proc.pid
    wait_until(lambda: len(group_members(pgid)) == 2, 5, what="sh and its sleep")
    os.kill(pgid, signal.SIGKILL)
    wait_until(lambda: svc.proc is not None and svc.proc.poll() is not None, 5,
               what="the main process to exit")
    assert len(group_members(pgid)) == 1  # the sleep outlived it
    svc.stop(timeout_s=2.0)
    assert group_members(pgid) == []


def test_a_service_that_keeps_dying_is_restarted_after_doubling_delays(tmp_path: Path) -> None:
    lines = restarted(tmp_path, "flaky", "touch $F; sleep 0.3", 4, stable_s=60)
    events = [x for x in lines if not x.startswith("starting ")][:8]
    assert events == [
        "flaky exited (exit 0); restarting in 0.1 s", "restarted flaky (exit 0) after 0.1 s",
        "flaky exited (exit 0); restarting in 0.2 s", "restarted flaky (exit 0) after 0.2 s",
        "flaky exited (exit 0); restarting in 0.4 s", "restarted flaky (exit 0) after 0.4 s",
        "flaky exited (exit 0); restarting in 0.4 s", "restarted flaky (exit 0) after 0.4 s"]


def test_the_delay_is_back_to_the_first_once_a_service_stayed_up(tmp_path: Path) -> None:
    lines = restarted(tmp_path, "steady", "touch $F; sleep 0.5; exit 3", 2, stable_s=0.3)
    assert [x for x in lines if "restart" in x][:4] == [
        "steady exited (exit 3); restarting in 0.1 s", "restarted steady (exit 3) after 0.1 s",
        "steady exited (exit 3); restarting in 0.1 s", "restarted steady (exit 3) after 0.1 s"]


def test_a_held_service_that_exits_is_started_again_only_after_the_hold(
        tmp_path: Path) -> None:
    said = Said(restarts=1)
    svc = flag_service(tmp_path, "redis", "touch $F; exec sleep 300")
    sup = Supervisor([svc], say=said, backoff=Backoff(first_s=0.1, max_s=0.4, stable_s=60),
                     tick_s=0.02)
    holding = threading.Thread(target=supervise, args=(sup, said.done))
    holding.start()
    wait_until(lambda: sup.state("redis") == "up", 10, what="the first start")
    assert svc.proc is not None
    sup.hold("redis", 1.0)
    held_at = time.monotonic()
    os.kill(svc.proc.pid, signal.SIGTERM)
    wait_until(lambda: sup.state("redis") == "waiting", 5, what="the exit")
    wait_until(lambda: sup.state("redis") == "up", 10, what="the restart")
    assert time.monotonic() - held_at >= 1.0
    holding.join(30)
    restarts = [x for x in said.lines if "restart" in x]
    assert len(restarts) == 2
    # the hold less the moment the exit took to be seen
    assert re.fullmatch(r"redis exited \(exit -15\); restarting in (0\.9|1) s", restarts[0])
    assert re.fullmatch(r"restarted redis \(exit -15\) after (0\.9|1) s", restarts[1])


def test_a_failed_first_start_stops_the_services_started_before(tmp_path: Path) -> None:
    first = flag_service(tmp_path, "first", "touch $F; exec sleep 300")
    broken = Service("broken", ["sh", "-c", "echo no such model >&2; exit 2"], lambda: False,
                     log_dir=tmp_path)
    sup = Supervisor([first, broken], say=lambda _: None, tick_s=0.02)
    with pytest.raises(ServiceError, match="broken exited with 2:\nno such model"):
        sup.run()
    assert first.proc is not None and first.proc.poll() is not None
    assert group_members(first.proc.pid) == []


def test_a_stop_requested_while_a_service_starts_stops_it(tmp_path: Path) -> None:
    # never ready: like vLLM during its 90 s start
    slow = flag_service(tmp_path, "slow", "sleep 300 & exec sleep 300")
    started = threading.Event()

    def say(line: str) -> None:
        if line.startswith("starting slow"):
            started.set()

    sup = Supervisor([slow], say=say, tick_s=0.02)
    t0 = time.monotonic()
    supervise(sup, started)
    assert time.monotonic() - t0 < 5
    assert slow.proc is not None and slow.proc.returncode == -signal.SIGTERM
    assert group_members(slow.proc.pid) == []


def test_a_port_handed_out_is_not_handed_out_again_until_its_mark_is_stale(
        tmp_path: Path) -> None:
    # free_port() marks each port it returns; another call (another test worker) passes
    # a marked port over, as the kernel may offer it again before its service binds it
    from tokenstorm import process

    mark = tmp_path / "marks" / "40000"
    assert process._claim(mark) and not process._claim(mark)
    old = time.time() - process._HELD_S - 1
    os.utime(mark, (old, old))
    assert process._claim(mark) and not process._claim(mark)
    assert process.free_port() != process.free_port()
