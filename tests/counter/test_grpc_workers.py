"""Worker processes of a sidecar (tokengate.grpc_server's, here the counter's, whose unix
sockets speak counter frames): they die with their parent, one that exits removes its
unix socket only while it is still the one it created, and SIGHUP reloads the
configuration without failing a call.

Real ``tokengate-counter`` processes with two workers each, sockets in the test folder;
about 10 s per test (the workers load the model).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from tokengate.counter import frames
from tokengate.counter.counter_service import CountFailure
from tokengate.v1 import counter_pb2
from tokengate_dev import devstack
from tokenstorm.process import Service, free_port, group_members

from tests.conftest import MODEL, PORT_OFFSET, TEST_DIR
from tests.fixtures_ledger import wait_until


def identity(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


BODY = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
REQUEST = counter_pb2.CountRequest(model=MODEL, endpoint=counter_pb2.ENDPOINT_CHAT, body=BODY)


def serving(path: Path) -> bool:
    """The counter worker on unix socket ``path`` counts."""
    with frames.Client(str(path), timeout_s=5) as c:
        return c.count(REQUEST).prompt_tokens > 0


def workers_of(parent: int) -> list[int]:
    """The worker processes of a sidecar whose main process is ``parent``: its children
    (forked: they carry its command line)."""
    try:
        return [int(p) for p in
                Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
    except OSError:
        return []


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = TEST_DIR / "grpc-workers"
    d.mkdir(parents=True, exist_ok=True)
    for p in d.iterdir():
        p.unlink()
    yield d


def counter(config_path: Path, sock: Path, label: str) -> Service:
    return devstack.counter_service(config_path, port=free_port(), unix_socket=sock, workers=2,
                                    name=f"test-grpc-workers-{label}{PORT_OFFSET or ''}")


def test_a_worker_leaves_the_socket_of_the_worker_started_in_its_place(
        config_path: Path, sock_dir: Path) -> None:
    sock = sock_dir / "counter.sock"
    paths = [Path(f"{sock}.{i}") for i in range(2)]
    old = counter(config_path, sock, "old").start()
    new = counter(config_path, sock, "new")
    try:
        wait_until(lambda: all(p.is_socket() for p in paths), 20, what="the old sockets")
        before = [identity(p) for p in paths]
        # the new workers take the paths over while the old ones still run, as when a
        # parent was killed and its workers outlive it
        new.start()
        wait_until(lambda: all(identity(p) not in before for p in paths), 20,
                   what="the new workers' sockets")
        taken = [identity(p) for p in paths]
        old.stop()
        assert [identity(p) for p in paths] == taken
        assert all(serving(p) for p in paths)
    finally:
        old.stop()
        new.stop()
    # each worker removed its own socket, and nothing else is left (the names gRPC bound)
    assert sorted(p.name for p in sock_dir.iterdir()) == []


def test_workers_exit_when_their_parent_is_killed(config_path: Path, sock_dir: Path) -> None:
    sock = sock_dir / "counter.sock"
    svc = counter(config_path, sock, "orphans").start()
    try:
        assert svc.proc is not None
        parent = svc.proc.pid
        wait_until(lambda: len(workers_of(parent)) == 2 and Path(f"{sock}.1").is_socket(), 20,
                   what="two workers")
        os.kill(parent, signal.SIGKILL)
        # SIGTERM from the kernel, then their graceful stop (grace 2 s)
        wait_until(lambda: group_members(parent) == [], 10, step_s=0.1,
                   what="the workers to exit")
        assert sorted(p.name for p in sock_dir.iterdir()) == []
    finally:
        svc.stop()


def test_sighup_reloads_the_models_without_failing_a_call(config_path: Path,
                                                          sock_dir: Path) -> None:
    raw = yaml.safe_load(config_path.read_text())
    before = raw["models"][MODEL]["max_model_len"]
    after = before - 2048  # still above the model's max_tokens_cap
    path = sock_dir / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw))
    sock = sock_dir / "counter.sock"
    svc = counter(path, sock, "reload").start()
    paths = [Path(f"{sock}.{i}") for i in range(2)]
    try:
        assert svc.proc is not None
        wait_until(lambda: all(p.is_socket() for p in paths), 20, what="both workers")
        stop = threading.Event()
        seen: list[list[int]] = [[] for _ in range(4)]
        failed: list[Exception] = []

        def calls(i: int) -> None:
            with frames.Client(str(paths[i % 2]), timeout_s=10) as c:
                while not stop.is_set():
                    try:
                        seen[i].append(c.count(REQUEST).max_model_len)
                    except (OSError, CountFailure) as e:
                        failed.append(e)
                        return

        threads = [threading.Thread(target=calls, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: all(seen), 20, what="calls on both workers")
        raw["models"][MODEL]["max_model_len"] = after
        path.write_text(yaml.safe_dump(raw))
        os.kill(svc.proc.pid, signal.SIGHUP)
        try:
            # a bound, not a wait: a reload loads the tokenizer and traces the chat
            # template again (seconds; 11-12 s just to start on a loaded 2-core CI box)
            wait_until(lambda: all(s and s[-1] == after for s in seen), 120, step_s=0.1,
                       what="the new max_model_len from both workers")
        finally:
            stop.set()
            for t in threads:
                t.join(15)
        assert failed == []
        for s in seen:
            # the old value until the swap, the new one after it, nothing in between
            assert set(s) == {before, after}
            assert s == sorted(s, reverse=True)
        # a model that a reload adds is counted from then on (its metric series are made
        # at its first call)
        raw["models"]["added"] = {**raw["models"][MODEL], "upstreams": ["127.0.0.1:9"],
                                  "embedded": False}
        path.write_text(yaml.safe_dump(raw))
        os.kill(svc.proc.pid, signal.SIGHUP)
        added = counter_pb2.CountRequest(model="added", endpoint=counter_pb2.ENDPOINT_CHAT,
                                         body=BODY)

        def counts_added(p: Path) -> bool:
            with frames.Client(str(p), timeout_s=30) as c:
                try:
                    return c.count(added).prompt_tokens == c.count(REQUEST).prompt_tokens
                except CountFailure as e:
                    assert e.code.name == "NOT_FOUND", e  # not reloaded yet
                    return False
        wait_until(lambda: all(counts_added(p) for p in paths), 60, step_s=0.2,
                   what="both workers to count the added model")
    finally:
        svc.stop()


def test_a_socket_path_too_long_for_the_kernel_stops_the_counter_with_what_to_do(
        config_path: Path) -> None:
    # sun_path holds 107 bytes: the check comes before any worker starts, as one line
    sock = Path("/run") / ("d" * 90) / "counter.sock"
    r = subprocess.run([sys.executable, "-m", "tokengate.counter.server", "--config",
                        str(config_path), "--unix-socket", str(sock)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1
    want = (f"tokengate-counter: unix socket {sock}: a worker's path such as {sock}.99 is "
            "111 bytes; a unix socket path holds at most 107: choose a shorter folder")
    assert r.stderr.strip().splitlines() == [want]


def _publish_then_die(marker_dir: str, listen: object, index: int) -> None:
    """A worker for run_workers: says whether its socket path was there when it started,
    puts a file there (standing for its published socket), and the first one of index 0
    is killed as by kill -9 (nothing withdrawn)."""
    from tokengate import grpc_server

    assert isinstance(listen, grpc_server.Listen)
    path = Path(str(listen.socket_of(index)))
    runs = sorted(Path(marker_dir).glob(f"found.{index}.*"))
    # written under another name, then renamed: the test waits for the marker to exist,
    # and an open file not yet written read "" there
    marker = Path(marker_dir, f".found.{index}.{len(runs)}")
    marker.write_text(str(path.exists()))
    marker.rename(Path(marker_dir, f"found.{index}.{len(runs)}"))
    path.write_text("")
    if index == 0 and not runs:
        os.kill(os.getpid(), signal.SIGKILL)
    signal.sigwait({signal.SIGTERM})


def test_the_socket_of_a_killed_worker_is_gone_before_the_next_one_starts(
        tmp_path: Path) -> None:
    """A killed counter worker left its socket file: nginx logged each connect the edge
    made to it, refused, until the next worker published its own (seconds: it loads the
    models). A missing file the edge looks for first, and logs once per outage."""
    script = (
        "import sys; sys.path[:0] = [sys.argv[1]]\n"
        "from tokengate import grpc_server\n"
        "from tests.counter.test_grpc_workers import _publish_then_die\n"
        "listen = grpc_server.Listen((), sys.argv[2] + '/w.sock')\n"
        "grpc_server.run_workers('test', _publish_then_die, (sys.argv[2], listen), 2, listen)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parents[2]),
                             str(tmp_path)])
    try:
        wait_until(lambda: (tmp_path / "found.0.1").exists(), 30,
                   what="worker 0 started again")
        assert [(tmp_path / f).read_text() for f in ("found.0.0", "found.0.1")] == \
            ["False", "False"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
