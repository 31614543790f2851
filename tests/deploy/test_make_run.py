"""``make run`` supervises: a child killed with SIGKILL is restarted and the gateway answers
exactly again; SIGINT at any moment, also mid-start, leaves no process and no socket.

Each stack is ``python -m tokengate_dev.devstack run --config FILE`` as ``make run`` runs it,
with a configuration of its own (free loopback ports, files under the test folder) and
``--var`` / ``--counter-port`` so that it runs beside a ``make run``. Without vLLM: the
model is ``embedded: false`` and its upstream the session's fast upstream. A process left
behind is found by a marker in its environment or, for those that write their title over
it (nginx, Redis), by a descriptor open under the stack's folder (every child's stdout is
its log there). One test starts vLLM (SIGINT while it starts).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml
from tokengate_dev import devstack
from tokenstorm.process import free_port, group_members, unix_ready

from tests.conftest import REPO_CONFIG, TEST_DIR
from tests.fixtures_ledger import wait_until

MARK = "TOKENGATE_TEST_STACK"
KEY = devstack.DEMO_KEY
BODY = {"model": "tiny-qwen3", "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hello there, how are you doing today?"}]}
# argv words of each child of the stack
CHILDREN = {"redis": "redis-server", "counter": "tokengate.counter.server",
            "nginx": "nginx: master process", "ledger": "tokengate.ledger.service",
            "console": "tokengate.console.service", "batch": "tokengate.batch.service",
            "vllm": "vllm.entrypoints.openai.api_server"}


def _holds_file_under(pid: int, folder: Path) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"{folder}/"):
                return True
        except OSError:
            continue
    return False


def leftovers(token: str, folder: Path) -> list[str]:
    """Live processes of a stack: its marker in their environment, or a descriptor open
    under ``folder``; as ``"pid argv"``."""
    needle = f"{MARK}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_bytes().rpartition(b")")[2].split()[0]
        except OSError:
            continue
        if state in (b"Z", b"X"):
            continue
        if needle in env or _holds_file_under(int(entry), folder):
            found.append(f"{entry} {cmdline(int(entry))}")
    return found


def children_of(parent: int) -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and _ppid(int(e)) == parent]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def write_config(var: Path, upstream: str, embedded: bool = False,
                 edit: Callable[[dict[str, Any]], None] | None = None) -> tuple[Path, str]:
    """The repository's configuration on free ports with its files under ``var``, then
    ``edit(raw)``; returns the path and the edge's base URL."""
    raw = yaml.safe_load(REPO_CONFIG.read_text())
    for m in raw["models"].values():
        m["dir"] = str((REPO_CONFIG.parent / m["dir"]).resolve())
        m["upstreams"] = [upstream]
        m["embedded"] = embedded
    # distinct ports: free_port() releases its port, and the kernel may give it again
    ports: set[int] = set()
    while len(ports) < 7:
        ports.add(free_port())
    edge_p, redis_p, status_p, console_p, *metrics_p = sorted(ports)
    edge = f"127.0.0.1:{edge_p}"
    raw["redis"]["url"] = f"redis://127.0.0.1:{redis_p}/0"
    raw["ledger"]["usage_file"] = str(var / "usage" / "usage.jsonl")
    raw["access_log"]["file"] = str(var / "log" / "access.sampled.log")
    raw["global_limits"]["unix_socket"] = str(var / "run" / "limits.sock")
    raw["edge"]["listen"] = edge
    raw["edge"]["status_listen"] = f"127.0.0.1:{status_p}"
    raw["ledger"].setdefault("console", {})["listen"] = f"127.0.0.1:{console_p}"
    raw["metrics"] = {f"{part}_listen": f"127.0.0.1:{port}"
                      for part, port in zip(("counter", "ledger", "limits"), metrics_p)}
    raw["batch"].update(unix_socket=str(var / "run" / "batch.sock"), edge_url=f"http://{edge}",
                        worker_secret_file=str(var / "batch" / "worker.key"),
                        files_dir=str(var / "batch" / "files"))
    if edit is not None:
        edit(raw)
    path = var / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, f"http://{edge}/v1"


class Stack:
    """One ``devstack run`` in a subprocess; its output lines are collected as they come."""

    def __init__(self, name: str, upstream: str, embedded: bool = False,
                 edit: Callable[[dict[str, Any]], None] | None = None,
                 again: Stack | None = None) -> None:
        """``again``: a stopped stack to start again, with its configuration and files."""
        self.var = TEST_DIR / f"make-run-{name}"
        self.var.mkdir(parents=True, exist_ok=True)
        self.config, self.url = (again.config, again.url) if again is not None \
            else write_config(self.var, upstream, embedded, edit)
        self.token = uuid.uuid4().hex
        self.lines: list[str] = []
        argv = [sys.executable, "-m", "tokengate_dev.devstack", "run", "--config",
                str(self.config), "--var", str(self.var), "--counter-port", str(free_port())]
        self.proc = subprocess.Popen(argv, cwd=devstack.ROOT, env={**os.environ, MARK: self.token},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, text: str, timeout_s: float) -> None:
        """Until a line of the output starts with ``text``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(x.startswith(text) for x in self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line {text!r} after {timeout_s:.0f} s; output:\n"
                             + self.output())

    def children(self, name: str) -> list[int]:
        """Pids of the main process of the stack's child ``name`` (one while it runs)."""
        return [p for p in children_of(self.proc.pid) if CHILDREN[name] in cmdline(p)]

    def child(self, name: str) -> int:
        pids = self.children(name)
        assert len(pids) == 1, (name, pids)
        return pids[0]

    def interrupt(self, timeout_s: float = 60.0) -> int:
        """SIGINT (Ctrl-C) and the exit status."""
        self.proc.send_signal(signal.SIGINT)
        return self.wait(timeout_s)

    def wait(self, timeout_s: float) -> int:
        """The exit status, once ``lines`` holds every line the run wrote (its output
        read to the end, which a child still holding it would delay up to
        ``timeout_s``)."""
        code = self.proc.wait(timeout_s)
        self.reader.join(timeout_s)
        return code

    def leftovers(self) -> list[str]:
        return leftovers(self.token, self.var)

    def console_listen(self) -> str:
        listen: str = yaml.safe_load(self.config.read_text())["ledger"]["console"]["listen"]
        return listen

    def sockets(self) -> list[str]:
        return sorted(str(p.relative_to(self.var)) for p in self.var.rglob("*") if p.is_socket())

    def close(self) -> None:
        """Whatever a failed test left: the stack stopped, then whatever of it is left killed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for line in self.leftovers():
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def post(url: str) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json=BODY, timeout=10,
                      headers={"Authorization": f"Bearer {KEY}"})


def upstream_of(fast_upstream_url: str) -> str:
    return fast_upstream_url.removeprefix("http://").removesuffix("/v1")


def assert_stopped_by_ctrl_c(s: Stack, timeout_s: float = 60.0) -> None:
    """SIGINT (Ctrl-C) stops ``s`` with exit status 0 and leaves no process of it and no
    socket in its folder."""
    assert s.interrupt(timeout_s) == 0, s.output()
    assert "stopping ..." in s.lines
    assert s.leftovers() == [], s.output()
    assert s.sockets() == []


@contextlib.contextmanager
def up(s: Stack) -> Iterator[Stack]:
    """``s`` once its banner says it is up; after, stopped with Ctrl-C, which must leave
    nothing behind (``test_ctrl_c_at_any_moment_leaves_nothing_behind`` once it is up:
    every stack here is stopped so), and whatever a failure left of it killed."""
    try:
        s.wait_line("tokengate is up.", 120)
        yield s
        assert_stopped_by_ctrl_c(s)
    finally:
        s.close()


@pytest.fixture(scope="module")
def stack(fast_upstream_url: str) -> Iterator[Stack]:
    """A stack in front of the fast upstream, up (its banner printed)."""
    with up(Stack("kill", upstream_of(fast_upstream_url))) as s:
        yield s


@pytest.fixture(scope="module")
def exact(stack: Stack) -> int:
    """The counter's count of BODY (X-Token-Count of an answer counted by the counter)."""
    r = post(stack.url)
    assert (r.status_code, r.headers["x-token-count-source"]) == (200, "counter"), r.text
    return int(r.headers["x-token-count"])


def answered_exactly(url: str, count: int) -> bool:
    r = post(url)
    return (r.status_code, r.headers.get("x-token-count-source"),
            r.headers.get("x-token-count")) == (200, "counter", str(count))


def test_the_banner_names_the_console_and_where_traces_go(stack: Stack) -> None:
    """make run prints the operator console's address and the demo admin's login (the
    repository's tokengate.yaml holds it, like the demo key), and the console answers
    there, from a process of its own (tokengate-console, not the ledger): a page without
    a session goes to the login."""
    listen = stack.console_listen()
    assert f"  console        : http://{listen}/" in stack.lines, stack.output()
    assert "  user           : admin" in stack.lines
    assert "  password       : tg-demo-admin" in stack.lines
    assert any("traces are off (tracing.enabled: docs/operators/observability.md)" in x for x in stack.lines)
    r = httpx.get(f"http://{listen}/keys", timeout=10)
    assert r.status_code == 303 and r.headers["location"].startswith("/login")
    stack.child("console")   # exactly one child of its own: tokengate-console


def test_the_official_client_creates_polls_cancels_and_downloads_batches(stack: Stack) -> None:
    """The Batch API of make run's stack (batch.enabled in the repository's
    tokengate.yaml, the demo secret written by make run), through the openai client."""
    client = openai.OpenAI(base_url=stack.url, api_key=KEY, max_retries=0)
    rows = "".join(json.dumps({"custom_id": f"r-{i}", "method": "POST",
                               "url": "/v1/chat/completions", "body": BODY}) + "\n"
                   for i in range(3))
    f = client.files.create(file=("in.jsonl", rows.encode()), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    wait_until(lambda: client.batches.retrieve(b.id).status == "completed", 60,
               what="the batch completed")
    done = client.batches.retrieve(b.id)
    assert done.request_counts is not None and done.request_counts.completed == 3
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [(o["custom_id"], o["response"]["status_code"]) for o in out] == [
        ("r-0", 200), ("r-1", 200), ("r-2", 200)]
    other = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    client.batches.cancel(other.id)
    wait_until(lambda: client.batches.retrieve(other.id).status in ("cancelled", "completed"),
               60, what="the second batch ended")
    stack.child("batch")   # exactly one child of its own: tokengate-batch


@pytest.mark.parametrize("name", ["counter", "nginx", "ledger", "redis", "console", "batch"])
def test_a_child_killed_with_sigkill_is_restarted(stack: Stack, exact: int, name: str) -> None:
    pid = stack.child(name)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    if name in ("ledger", "redis", "console", "batch"):
        # not on the request path: the gateway does not notice
        assert answered_exactly(stack.url, exact)
    elif name == "counter":
        # the edge forwards on its estimate meanwhile (on_counter_failure: open)
        r = post(stack.url)
        assert r.status_code == 200, r.text
    stack.wait_line(f"restarted {name} (exit -9) after 1 s", 60)
    assert f"{name} exited (exit -9); restarting in 1 s" in stack.lines
    # nothing of the dead one's process group is left (nginx's or the counter's workers)
    assert group_members(pid) == []
    wait_until(lambda: answered_exactly(stack.url, exact), 10, step_s=0.2,
               what=f"exact answers after the restart of {name}")
    assert time.monotonic() - t0 < 60
    if name == "counter":
        # no member of the dead one's group is left (above): no late exit of an old
        # worker can remove the new sockets
        assert [p for p in stack.sockets() if "counter" in p] == \
            ["run/counter.sock.0", "run/counter.sock.1"]
        assert all(answered_exactly(stack.url, exact) for _ in range(4))
    if name == "ledger":
        wait_until(lambda: '"redis_up": true' in (stack.var / "run" / "ledger.status.json")
                   .read_text(), 20, what="the new ledger's status")
    if name == "batch":
        sock = yaml.safe_load(stack.config.read_text())["batch"]["unix_socket"]
        wait_until(unix_ready(sock), 20, what="the new batch service")
    if name == "console":
        login = f"http://{stack.console_listen()}/login"
        wait_until(lambda: httpx.get(login, timeout=5).status_code == 200, 20,
                   what="the new console's login page")


# once it is up: every stack that up() started, stopped at its end
@pytest.mark.parametrize("moment", ["starting redis", "starting counter", "starting nginx",
                                    "starting ledger"])
def test_ctrl_c_at_any_moment_leaves_nothing_behind(fast_upstream_url: str, moment: str) -> None:
    s = Stack("stop-" + re.sub(r"\W+", "-", moment).strip("-"), upstream_of(fast_upstream_url))
    try:
        s.wait_line(moment, 120)
        if moment == "starting counter":
            # its workers are loading the model: the parent and its workers all run
            wait_until(lambda: any(len(group_members(p)) >= 3 for p in s.children("counter")),
                       20, what="the counter's workers")
        assert_stopped_by_ctrl_c(s)
    finally:
        s.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_while_vllm_starts_stops_it() -> None:
    s = Stack("stop-vllm", f"127.0.0.1:{free_port()}", embedded=True)
    try:
        s.wait_line("starting vllm", 120)
        wait_until(lambda: len(s.children("vllm")) == 1, 10, what="vLLM's API server")
        vllm = s.child("vllm")
        env = Path(f"/proc/{vllm}/environ").read_bytes().split(b"\0")
        assert f"TOKENGATE_ENGINE_USAGE_FILE={s.var}/usage/engine.jsonl".encode() in env
        # the engine core is a process of its own (titled VLLM::EngineCore): stop once it
        # runs too, loading the model
        wait_until(lambda: any("EngineCore" in cmdline(p) for p in group_members(vllm)), 150,
                   step_s=0.5, what="vLLM's engine core process")
        assert_stopped_by_ctrl_c(s, 90)
        assert "tokengate is up." not in s.lines
    finally:
        s.close()


def test_an_invalid_configuration_is_one_line_per_problem_and_starts_nothing(
        tmp_path: Path) -> None:
    """make run on a tokengate.yaml with bad values: each problem on a line of its own
    naming the field (it was a Python traceback), exit 1, no process started."""
    raw = yaml.safe_load(REPO_CONFIG.read_text())
    raw["edge"]["queue"] = {"max_wait_ms": -1, "max_wait": 5}
    path = tmp_path / "tokengate.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "tokengate_dev.devstack", "run", "--config",
                        str(path), "--var", str(tmp_path / "var")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        f"{path}: edge.queue.max_wait_ms: input should be greater than or equal to 1, got -1",
        f"{path}: edge.queue.max_wait: unknown key",
        f"not started: fix the configuration (tokengate config check {path})"]
    assert not (tmp_path / "var").exists()


def test_a_second_stack_on_busy_ports_names_them_and_starts_nothing(
        fast_upstream_url: str) -> None:
    """Another process (here a plain listener; usually another `make run`) holds the
    edge's and the ledger's metrics addresses: the stack lists each busy address with
    its setting, starts nothing and exits 1."""
    holders = []
    for _ in range(2):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        holders.append(sock)
    edge, ledger = (f"127.0.0.1:{h.getsockname()[1]}" for h in holders)

    def edit(raw: dict[str, Any]) -> None:
        raw["edge"]["listen"] = edge
        raw["metrics"]["ledger_listen"] = ledger

    s = Stack("busy", upstream_of(fast_upstream_url), edit=edit)
    try:
        assert s.wait(60) == 1
        width = max(len(edge), len(ledger))
        assert s.lines == [
            ("not started: these addresses are in use by other processes (another `make "
             "run`, of this checkout or another?):"),
            f"  {edge:<{width}}  edge.listen", f"  {ledger:<{width}}  metrics.ledger_listen",
            ("Stop them, or give this stack other ports: a copy of the configuration with "
             "those settings changed, then `make run CONFIG=<that file>`.")]
        assert s.leftovers() == []
    finally:
        s.close()
        for h in holders:
            h.close()


def test_the_stacks_redis_keeps_its_data_across_a_restart(fast_upstream_url: str) -> None:
    """make run's Redis keeps an append-only file (var/redis): the budgets' counters,
    which only Redis holds, survive a restart of the stack."""
    shutil.rmtree(TEST_DIR / "make-run-aof" / "redis", ignore_errors=True)
    with up(Stack("aof", upstream_of(fast_upstream_url))) as first:
        url = yaml.safe_load(first.config.read_text())["redis"]["url"]
        with redis.Redis.from_url(url) as client:
            assert client.get("tg:test:kept") is None
            client.set("tg:test:kept", "1")
    with up(Stack("aof", upstream_of(fast_upstream_url), again=first)), \
            redis.Redis.from_url(url) as client:
        assert client.get("tg:test:kept") == b"1"
