"""An upgrade from the previous release, by the steps of docs/operators/upgrading.md.
(Over 600 lines: one upgrade, run once per module on the previous release's files,
and the checks of what it must keep, which read the same host.)

Release 0.1.0 (the parts of tag ``v0.1.0`` an install reads, kept as
``releases/v0.1.0.tar.gz`` beside this file, so that a clone without tags runs it) is
installed as its README says: its sidecars package in a virtualenv of its own
(``pip install ./sidecars``), then its ``tokengate install --prefix ROOT
--config FILE`` on a copy of Debian's nginx layout (tests/deploy/test_debian_dropin.py),
from 0.1.0's own tokengate.yaml pointed at this test's parts (it has no
``ledger.console.changes_dir``). Its units run from their command lines as the units
say (tests/units.py: the unit's group, its environment, ``PrivateNetwork=yes`` as a
network namespace of its own), Debian's nginx runs as root with its workers as
www-data, behind it a simulated replica (tokenstorm sim-replica: vLLM's prompt counts,
prefix cache and KV events, exactly ``max_tokens`` generated) and in front of a private
append-only Redis. 0.1.0's ``tokengate keys create`` makes keys with budgets; whole,
streamed and cut requests go through, and one key is refused at its budget.

Then the page's Upgrade block runs line by line from this checkout, with a request
through the edge after each step, and the keys, the bill, the budgets' spend and the
usage file are what they were, to the token; every request of the upgrade is billed
once. Last, the doctor fails each broken state an upgrade may leave: a file a unit's
user cannot read, a counter that cannot reach a KV publisher, an engine file the running
ledger does not follow, a Redis without persistence.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tokengate import config as tg_config
from tokengate.doctor import host as doctor_host
from tokengate.ledger import report
from tokengate.ledger.event import parse_event
from tokengate_dev import devstack
from tokenstorm.process import Service, free_port, tcp_ready
from tokenstorm.upstream.sim import SimReplica, SimSettings

from tests import units
from tests.conftest import MODEL, PORT_OFFSET
from tests.console.test_console_passwd import console_answers, log_in
from tests.deploy.test_debian_dropin import HostFiles, debian_layout
from tests.doc_pages import code_block
from tests.fixtures_ledger import PRIVATE_REDIS_PORTS, PrivateRedis, wait_until
from tests.fixtures_ledger import free_port as free_port_of

# one host for the module, its tests in order (the previous release, the upgrade, the
# broken states): on one xdist worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("upgrade")]

ROOT = devstack.ROOT
PREVIOUS = "v0.1.0"
# the parts of PREVIOUS an install reads, kept with the tests so that a clone without
# tags or history can run them; made from the tag by RELEASE_PATHS (see
# test_the_release_archive_is_the_tags_tree)
RELEASE = Path(__file__).parent / "releases" / f"{PREVIOUS}.tar.gz"
RELEASE_PATHS = ("sidecars", "proto", "lua", "nginx", "systemd", "tokengate.yaml")
PAGE = "operators/upgrading.md"   # under docs/
SIDECARS = ("tokengate-counter.service", "tokengate-limits.service",
            "tokengate-ledger.service")
CONSOLE = "tokengate-console.service"   # a service of its own since this release
# the unix sockets of a sidecar's two workers, in /run/tokengate
SOCKETS = {"tokengate-counter.service": "counter.sock", "tokengate-limits.service": "limits.sock"}
# the keys 0.1.0 makes: traffic before the upgrade only; before, during and after it;
# a token budget it reaches before the upgrade (refused from then on)
KEYS = {"before-only": ("--budget", "day=5"), "steady": ("--budget", "day=5"),
        "capped": ("--budget", "day=600t")}


def previous_release(base: Path) -> Path:
    """The tree of ``PREVIOUS`` that an install needs (``RELEASE``), unpacked in ``base``."""
    src = base / PREVIOUS
    src.mkdir()
    subprocess.run(["tar", "-xzf", str(RELEASE), "-C", str(src)], check=True, timeout=120)
    return src


@dataclass
class Venv:
    """The virtualenv the units run from: ``/opt/tokengate`` of docs/operators/deploy.md, here made
    from this interpreter with the test environment's third-party packages reachable
    (a ``.pth`` file naming their site-packages), so ``pip install ./sidecars`` builds
    and installs tokengate alone, offline."""

    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @classmethod
    def make(cls, root: Path) -> Venv:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                       timeout=120)
        # after the new environment's own folder: a tokengate installed there comes first
        deps = [p for p in sys.path if p.endswith("site-packages")]
        where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        purelib = subprocess.run([str(root / "bin/python"), "-c", where], capture_output=True,
                                 text=True, check=True).stdout.strip()
        (Path(purelib) / "tokengate-test-deps.pth").write_text("\n".join(deps) + "\n")
        return cls(root)

    def pip_install(self, checkout: Path) -> None:
        """``pip install ./sidecars`` in ``checkout`` (from a copy of its sidecars/ and
        proto/, the stubs' source, so that no build folder is left in a checkout),
        offline: the dependencies are there, the build backend too."""
        work = Path(tempfile.mkdtemp(prefix="tg-upgrade-build-"))
        try:
            for part in ("sidecars", "proto"):
                shutil.copytree(checkout / part, work / part, ignore=shutil.ignore_patterns(
                    "build", "*.egg-info", "__pycache__", "*_pb2*.py*"))
            r = subprocess.run([str(self.bin / "python"), "-m", "pip", "install", "-q",
                                "--no-deps", "--no-build-isolation", "--no-compile",
                                str(work / "sidecars")],
                               capture_output=True, text=True, timeout=600, check=False)
            assert r.returncode == 0, r.stdout + r.stderr
        finally:
            shutil.rmtree(work, ignore_errors=True)


def old_config(src: Path, out: Path, upstream: str, kv_events: str, redis_url: str,
               edge_port: int) -> Path:
    """0.1.0's own tokengate.yaml as an operator adapts it for a host: this test's
    replica, Redis and ports; global limits on (budgets); the console on a port of its
    own, with no admin yet."""
    raw = yaml.safe_load((src / "tokengate.yaml").read_text())
    m = raw["models"][MODEL]
    m.update(dir=str((ROOT / "var/models/tiny-qwen3").resolve()), upstreams=[upstream],
             embedded=False)
    m["routing"].update(block_size=16, kv_events={upstream: kv_events})
    raw["keys"] = {}
    raw["redis"]["url"] = redis_url
    # 0.1.0's 50 ms Redis deadline (and 250 ms for the global tier) answered 503
    # budget_unavailable on a loaded host with Redis up; what the upgrading page advises and
    # 0.2.0's defaults: a 2-core machine runs the whole suite beside this host
    raw["redis"]["timeout_ms"] = 250
    raw["edge"]["global_limits_timeout_ms"] = 1000
    raw["ledger"]["rotate_wait_s"] = 0.5
    raw["ledger"]["console"] = {"listen": f"127.0.0.1:{free_port()}"}
    raw["global_limits"].update(enabled=True, listen=f"127.0.0.1:{free_port()}")
    raw["metrics"] = {f"{s}_listen": f"127.0.0.1:{free_port()}"
                      for s in ("counter", "ledger", "limits")}
    raw["edge"].update(listen=f"127.0.0.1:{edge_port}", status_listen=f"127.0.0.1:{free_port()}",
                       count_timeout_ms=3000)  # a 2-core machine runs all of it
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


@dataclass
class Host(HostFiles):
    """The installed host: its root folder (the prefix), nginx, the units running, the
    release it runs from, the keys and what was sent."""

    conf: Path                  # nginx.conf
    port: int                   # the site's (and the API's) port
    venv: Venv
    redis: PrivateRedis
    replica: SimReplica
    nginx: Service | None = None
    running: dict[str, units.Running] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)   # request ids, in order

    @property
    def status(self) -> Path:
        return self.run / "ledger.status.json"

    def cfg(self) -> dict[str, Any]:
        return yaml.safe_load(self.config.read_text())

    def tokengate(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``/opt/tokengate/bin/tokengate ARGS`` of the release installed now."""
        r = subprocess.run([str(self.venv.bin / "tokengate"), *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0 or not check, r.stdout + r.stderr
        return r

    # --- the units ----------------------------------------------------------------

    def start(self, unit: str) -> None:
        run = units.start(self.root / "etc/systemd/system" / unit, self.root,
                          self.root / "var/log/tokengate-units")
        self.running[unit] = run
        if unit in SOCKETS:
            paths = [self.run / f"{SOCKETS[unit]}.{i}" for i in range(2)]
            run.wait_for(lambda: all(p.exists() for p in paths), 90, "socket of each worker")
        elif unit == CONSOLE:
            url = f"http://{self.cfg()['ledger']['console']['listen']}"
            run.wait_for(lambda: console_answers(url), 60, "the console's login page")
        else:
            run.wait_for(lambda: self.ledger_status().get("lag_bytes") is not None, 60,
                         "the status file, its checkpoint read")

    def stop(self, unit: str) -> None:
        """Stop it; what it leaves (a socket, the status file) is removed, so that its
        next start is waited for by what that start makes."""
        self.running.pop(unit).stop()
        if unit in SOCKETS:
            for i in range(2):
                (self.run / f"{SOCKETS[unit]}.{i}").unlink(missing_ok=True)
        elif unit != CONSOLE:
            self.status.unlink(missing_ok=True)

    def restart(self, unit: str) -> None:
        self.stop(unit)
        self.start(unit)

    def ledger_status(self) -> dict[str, Any]:
        return json.loads(self.status.read_text()) if self.status.exists() else {}

    def nginx_run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nginx", "-c", str(self.conf), *args], capture_output=True,
                              text=True, timeout=60, check=False)

    # --- traffic ------------------------------------------------------------------

    def request(self, key: str, body: dict[str, Any], path: str = "/v1/chat/completions",
                cut_after: int | None = None) -> httpx.Response:
        """One request with ``key``'s secret; a stream read whole, or (``cut_after``)
        closed after that many lines, as a client that goes away. Its id is kept."""
        url = f"http://127.0.0.1:{self.port}{path}"
        headers = {"Authorization": f"Bearer {self.secrets[key]}"}
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
            if cut_after is None:
                r.read()
            else:
                for i, _line in enumerate(r.iter_lines()):
                    if i + 1 >= cut_after:
                        break
        self.sent.append(r.headers["x-request-id"])
        return r

    def traffic(self, key: str) -> None:
        """Whole, streamed and cut requests, chat and completions, all answered 200."""
        chat = {"model": MODEL, "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Name a river of Europe ({key})."}]}
        for body, path, cut in (
                ({**chat, "max_tokens": 5}, "/v1/chat/completions", None),
                ({**chat, "max_tokens": 8, "stream": True,
                  "stream_options": {"include_usage": True}}, "/v1/chat/completions", None),
                ({**chat, "max_tokens": 120, "stream": True,
                  "stream_options": {"include_usage": True}}, "/v1/chat/completions", 6),
                ({"model": MODEL, "prompt": f"Rivers of Europe ({key}):", "max_tokens": 6},
                 "/v1/completions", None)):
            r = self.request(key, body, path, cut)
            assert r.status_code == 200, (r.status_code, dict(r.headers), None if cut else r.text)

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.usage.read_text().splitlines() if line]

    def settled(self) -> None:
        """Until every request sent has its usage event and the ledger applied them all."""
        wait_until(lambda: {e["request_id"] for e in self.events()} >= set(self.sent), 30,
                   what="a usage event of every request sent")
        # its checkpoint (status "position", <file id>:<offset>) at the file's end: a
        # status written before the last event came says lag_bytes 0 too
        size = self.usage.stat().st_size
        wait_until(lambda: str(self.ledger_status().get("position")).endswith(f":{size}"), 60,
                   what="the ledger's checkpoint at the end of the usage file")


def bill(host: Host) -> dict[tuple[str, str, str], tuple[int, int, int, int, float]]:
    """The ledger's rows in Redis: (day, key, model) -> (requests, prompt, cached,
    completion tokens, cost)."""
    client = host.redis.client()
    try:
        rows = report.query(client, since=datetime.now(UTC).date().replace(day=1))
    finally:
        client.close()
    return {(r.day or "", r.key_id or "", r.model or ""): (
        r.requests, r.prompt_tokens, r.cached_tokens, r.completion_tokens, round(r.cost, 9))
        for r in rows}


def keys_and_spend(host: Host) -> dict[str, Any]:
    """``tokengate keys list --json`` of the release installed now, as both releases
    print it: each key's digest, limits and budgets with their spend and budget counters
    (billed plus reserved: nothing is in flight)."""
    listing = json.loads(host.tokengate("keys", "list", "--json", "--config",
                                        str(host.config)).stdout)
    entries = listing["keys"] if isinstance(listing, dict) else listing
    digests = {k: v["sha256"] for k, v in host.cfg()["keys"].items()}
    return {e["name"]: {"sha256": digests[e["name"]], "rpm": e["rpm"], "tpm": e["tpm"],
                        "budgets": [{f: b[f] for f in (
                            "period", "model", "spend", "tokens", "spent", "tokens_used",
                            "committed_spend", "committed_tokens")} for b in e["budgets"]]}
            for e in entries}


def event_sums(events: list[dict[str, Any]], key: str) -> tuple[int, int, int]:
    return (sum(e["prompt_tokens"] for e in events if e["key_id"] == key),
            sum(e["cached_tokens"] for e in events if e["key_id"] == key),
            sum(e["completion_tokens"] for e in events if e["key_id"] == key))


def row_sums(rows: dict[tuple[str, str, str], tuple[int, int, int, int, float]],
             key: str) -> tuple[int, int, int]:
    mine = [v for (_day, k, _model), v in rows.items() if k == key]
    return (sum(v[1] for v in mine), sum(v[2] for v in mine), sum(v[3] for v in mine))


# --- the page's steps ----------------------------------------------------------------

def upgrade_steps() -> list[str]:
    """The commands of the page's Upgrade block (its first sh block), one per line,
    comments removed."""
    return [line.split("  #")[0].strip() for line in code_block(PAGE, "sh").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def run_step(host: Host, line: str, new_release: Path) -> subprocess.CompletedProcess[str] | None:
    """One line of the page on the test's host: ``sudo`` dropped (the test is root),
    ``/opt/tokengate`` the host's virtualenv, ``tokengate`` commands given the
    installed prefix's configuration, systemctl's units run from their unit files,
    nginx the host's. Returns what a ``tokengate`` command printed. A line of another
    form fails the test: the page and the test go together."""
    words = [w for w in shlex.split(line) if w != "sudo"]
    if words[:2] == ["git", "fetch"]:
        # the release's checkout: the one this test runs in
        assert words == ["git", "fetch", "--tags", "&&", "git", "checkout", words[-1]], line
        return None
    tokengate = "/opt/tokengate/bin/tokengate"
    if words[:3] == ["/opt/tokengate/bin/pip", "install", "./sidecars"] and len(words) == 3:
        host.venv.pip_install(new_release)
        return None
    if words[0] == tokengate:
        args = words[1:]
        if args[:1] == ["install"]:
            args += ["--prefix", str(host.root)]
        elif args[:1] == ["doctor"]:
            args += ["--config", str(host.config), "--engine-wait-s", "0.2",
                     "--timeout-s", "10"]
        return host.tokengate(*args, check=args[:1] != ["doctor"])
    if words[:2] == ["systemctl", "try-restart"]:
        for unit in words[2:]:
            name = f"{unit}.service"
            assert name in (*SIDECARS, CONSOLE), line
            if name in host.running:
                host.restart(name)
        return None
    if words[:3] == ["systemctl", "enable", "--now"]:
        for unit in words[3:]:
            if unit == "tokengate-console-apply.path":
                continue   # root's path unit applies console key changes: none are made here
            name = f"{unit}.service"
            assert name == CONSOLE, line
            if name not in host.running:
                host.start(name)
        return None
    if words == ["nginx", "-t"]:
        t = host.nginx_run("-t")
        assert t.returncode == 0, t.stderr
        return None
    if words == ["systemctl", "reload", "nginx"]:
        assert host.nginx_run("-s", "reload").returncode == 0
        return None
    raise AssertionError(f"docs/{PAGE}: a step the upgrade test does not know how to run: "
                         f"{line}")


# --- the host ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    # Not pytest's tmp_path: its folders are 0700, and nginx's www-data workers must
    # reach the Lua modules, the sockets and the usage file below this root.
    base = Path(tempfile.mkdtemp(prefix="tg-upgrade-", dir="/tmp"))
    os.chmod(base, 0o755)
    root = base / "root"
    root.mkdir(mode=0o755)
    started: list[Any] = []
    h: Host | None = None
    try:
        src = previous_release(base)
        venv = Venv.make(base / "opt-tokengate")
        venv.pip_install(src)   # 0.1.0's README: pip install ./sidecars
        r = PrivateRedis(free_port_of(PRIVATE_REDIS_PORTS), base / "redis", persist=True)
        (base / "redis").mkdir()
        started.append(r.start())
        replica = SimReplica(SimSettings(
            model=MODEL, model_dir=(ROOT / "var/models/tiny-qwen3").resolve(), block_size=16,
            prefill_tokens_per_s=1e6, ttft_overhead_ms=0, itl_ms=5,
            kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}"),
            name=f"test-upgrade-replica{PORT_OFFSET or ''}", state_dir=base / "replica")
        started.append(replica.start())
        port = free_port()
        conf = debian_layout(root, port)
        assert replica.settings.kv_events_endpoint is not None
        cfg = old_config(src, base / "tokengate.yaml", replica.address,
                         replica.settings.kv_events_endpoint, r.url, port)
        h = Host(root, conf, port, venv, r, replica)
        inst = subprocess.run([str(venv.bin / "tokengate"), "install", "--prefix", str(root),
                               "--config", str(cfg), "--vllm-python", sys.executable],
                              cwd=src, capture_output=True, text=True, timeout=300, check=False)
        assert inst.returncode == 0, inst.stdout + inst.stderr
        for unit in SIDECARS:
            h.start(unit)
        t = h.nginx_run("-t")
        assert t.returncode == 0, t.stderr
        h.nginx = Service("upgrade-nginx", ["nginx", "-c", str(conf), "-g", "daemon off;"],
                          tcp_ready("127.0.0.1", port), start_timeout_s=30,
                          log_dir=root / "var/log").start()
        yield h
    finally:
        if h is not None:
            if h.nginx is not None:
                h.nginx.stop()
            for run in h.running.values():
                run.stop()
        for svc in reversed(started):
            svc.stop()
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class Before:
    usage: bytes
    bill: dict[tuple[str, str, str], tuple[int, int, int, int, float]]
    keys: dict[str, Any]
    config_keys: dict[str, Any]


@pytest.fixture(scope="module")
def before(host: Host) -> Before:
    """0.1.0 at work: keys made with its CLI, traffic of each kind, a key refused at its
    budget; then what it billed."""
    for name, budget in KEYS.items():
        made = host.tokengate("keys", "create", name, "--rpm", "1000", "--tpm", "1000000",
                              *budget, "--config", str(host.config))
        host.secrets[name] = made.stdout.strip().splitlines()[-1]
    for name in KEYS:
        host.traffic(name)
    # the capped key until its token budget refuses it (429 insufficient_quota)
    for _ in range(20):
        answer = host.request("capped", {"model": MODEL, "max_tokens": 60, "messages": [
            {"role": "user", "content": "One more?"}]})
        if answer.status_code != 200:
            break
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["code"] == "insufficient_quota"
    host.settled()
    return Before(host.usage.read_bytes(), bill(host), keys_and_spend(host),
                  host.cfg()["keys"])


@dataclass
class Upgrade:
    printed: dict[str, subprocess.CompletedProcess[str]]   # a tokengate step's, by line
    before_restart: dict[tuple[str, str], str]             # the doctor's host lines


@pytest.fixture(scope="module")
def upgraded(host: Host, before: Before) -> Upgrade:
    """The page's steps, run in order, a request of the steady key after each; and the
    new release's doctor just before the sidecars restart (0.1.0's still run)."""
    printed = {}
    before_restart: dict[tuple[str, str], str] = {}
    for line in upgrade_steps():
        if "try-restart" in line:
            before_restart = doctor(host)[1]
        out = run_step(host, line, ROOT)
        if out is not None:
            printed[line] = out
        r = host.request("steady", {"model": MODEL, "max_tokens": 3, "messages": [
            {"role": "user", "content": f"After: {line[:40]}"}]})
        assert r.status_code == 200, (line, r.text)
    host.settled()
    return Upgrade(printed, before_restart)


def test_the_previous_release_is_the_tag_and_runs_without_a_version_flag(
        host: Host, before: Before) -> None:
    which = "from importlib import metadata; print(metadata.version('tokengate'))"
    r = subprocess.run([str(host.venv.bin / "python"), "-c", which], capture_output=True,
                       text=True, check=True)
    assert r.stdout.strip() == PREVIOUS.removeprefix("v")
    assert before.keys["capped"]["budgets"][0]["tokens_used"] > 500


def test_the_upgrade_keeps_keys_bill_spend_and_usage_file_to_the_token(
        host: Host, before: Before,
        upgraded: Upgrade) -> None:
    from tokengate import version

    [v] = [out for line, out in upgraded.printed.items() if line.endswith("--version")]
    assert v.stdout.split()[:2] == ["tokengate", version.version()]
    usage = host.usage.read_bytes()
    assert usage.startswith(before.usage)   # nothing rewritten, nothing lost
    events = [json.loads(line) for line in usage.splitlines()]
    for line in usage.splitlines():
        parse_event(line)   # this release reads every event 0.1.0's edge wrote
    after = bill(host)
    # keys without traffic since: their rows, spend and budget counters are as they were
    for name in ("before-only", "capped"):
        assert {k: v for k, v in after.items() if k[1] == name} == \
            {k: v for k, v in before.bill.items() if k[1] == name}
        assert keys_and_spend(host)[name] == before.keys[name]
    assert host.cfg()["keys"] == before.config_keys
    # every request, before, during and after the upgrade, billed once with its event's
    # numbers
    for name in KEYS:
        assert row_sums(after, name) == event_sums(events, name), name
    ids = [e["request_id"] for e in events]
    assert len(ids) == len(set(ids)) and set(host.sent) <= set(ids)
    # the capped key is refused still: its spend was kept
    again = host.request("capped", {"model": MODEL, "max_tokens": 60, "messages": [
        {"role": "user", "content": "And now?"}]})
    assert (again.status_code, again.json()["error"]["code"]) == (429, "insufficient_quota")


def test_the_upgrade_adds_the_console_queue_and_an_admin_set_then_logs_in_at_once(
        host: Host, upgraded: Upgrade) -> None:
    [install] = [out for line, out in upgraded.printed.items()
                 if line.endswith("install")]
    assert f"add ledger.console.changes_dir (0.1.0 needs it) to {host.config}, 640 " \
           "root:www-data" in install.stdout.splitlines()
    queue = host.root / "var/lib/tokengate/console"
    assert host.cfg()["ledger"]["console"]["changes_dir"] == str(queue)
    assert queue.is_dir()
    # the console runs as its own unit (the steps enabled it), with no admin yet
    url = f"http://{host.cfg()['ledger']['console']['listen']}"
    assert CONSOLE in host.running and "No admin yet" in httpx.get(f"{url}/login").text
    r = subprocess.run([str(host.venv.bin / "tokengate"), "console", "passwd", "ops",
                        "--password-stdin", "--config", str(host.config)],
                       input="an upgrade test password\n", capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert log_in(url, "ops", "an upgrade test password").status_code == 303


HOST_CHECKS = ("unit", "counter", "ledger", "redis")  # the doctor's lines of the host


def host_lines(host: Host) -> dict[tuple[str, str], str]:
    """The doctor's host lines, (check, where) -> ``STATUS check: detail``, from its
    host checks called in this process: what a wait polls (the whole doctor checks the
    replica again each time, seconds)."""
    cfg = tg_config.load(host.config)
    return {(c.name, c.upstream): f"{c.status} {c.name}: {c.detail}"
            for c in doctor_host.run(cfg)}


def doctor_lines(stdout: str) -> dict[tuple[str, str], str]:
    """``host_lines`` read from what ``tokengate doctor`` printed."""
    lines = {}
    for line in stdout.splitlines():
        status, (what, where, rest) = line[:4].strip(), line[5:].split(" ", 2)
        if what in HOST_CHECKS:
            lines[(rest.partition(":")[0], where)] = f"{status} {rest}"
    return lines


def doctor(host: Host) -> tuple[int, dict[tuple[str, str], str]]:
    """(exit status, host lines) of the installed release's ``tokengate doctor``."""
    r = host.tokengate("doctor", "--config", str(host.config), "--engine-wait-s", "0.2",
                       "--timeout-s", "10", check=False)
    return r.returncode, doctor_lines(r.stdout)


def test_the_previous_counter_unit_reaches_no_kv_publisher_and_the_doctor_says_so(
        host: Host, upgraded: Upgrade) -> None:
    # 0.1.0's counter unit has PrivateNetwork=yes: neither its metrics nor the replica's
    # KV events can be reached, and prefix routing fell back to the edge's guess
    lines = upgraded.before_restart
    replica = host.replica.address
    listen = yaml.safe_load(host.config.read_text())["metrics"]["counter_listen"]
    assert lines[("kv_events_connected", replica)].startswith(
        f"FAIL kv_events_connected: the counter's metrics on {listen} do not answer (")


def test_after_the_upgrade_the_doctor_finds_the_running_services_healthy(
        host: Host, upgraded: Upgrade) -> None:
    [run] = [out for line, out in upgraded.printed.items() if line.endswith("doctor")]
    lines = doctor_lines(run.stdout)
    replica, endpoint = host.replica.address, host.replica.settings.kv_events_endpoint
    assert lines[("kv_events_connected", replica)].startswith(
        f"OK kv_events_connected: the running counter is connected to {endpoint}; ")
    assert lines[("redis_persistence", f"127.0.0.1:{host.redis.port}")].startswith("OK ")
    # the units' user (tokengate) is not on this machine: readable is not checked here
    assert {k: v.split(" ", 1)[0] for k, v in lines.items()} == {
        **{("readable", u): "SKIP" for u in (*SIDECARS, CONSOLE)},
        ("kv_events_connected", replica): "OK",
        ("redis_persistence", f"127.0.0.1:{host.redis.port}"): "OK"}


def test_the_doctor_fails_a_counter_that_cannot_reach_a_kv_publisher(
        host: Host, upgraded: Upgrade) -> None:
    replica = host.replica.address
    good = host.config.read_text()
    dead = f"tcp://127.0.0.1:{free_port()}"
    try:
        host.config.write_text(good.replace(str(host.replica.settings.kv_events_endpoint),
                                            dead))
        counter = host.running["tokengate-counter.service"]
        os.kill(counter.proc.pid, 1)   # ExecReload=/bin/kill -HUP $MAINPID
        wait_until(lambda: host_lines(host)[("kv_events_connected", replica)].startswith(
            "FAIL"), 60, what="the counter's reload")
        status, lines = doctor(host)
        assert status == 1
        assert lines[("kv_events_connected", replica)] == (
            f"FAIL kv_events_connected: the running counter is not connected to {dead}, the "
            f"KV-event publisher of {MODEL}'s replica {replica}: its prefix hits are the "
            "edge's approximate guess (is the replica up with --kv-events-config, and can "
            "the counter's unit reach that address?)")
    finally:
        host.config.write_text(good)
        os.kill(host.running["tokengate-counter.service"].proc.pid, 1)
    wait_until(lambda: host_lines(host)[("kv_events_connected", replica)].startswith("OK"),
               60, what="the counter connected again")


def test_the_doctor_fails_a_config_a_units_user_cannot_read(
        host: Host, upgraded: Upgrade) -> None:
    # the units' user does not exist here: a user this machine has, in their group
    units_dir = host.root / "etc/systemd/system"
    kept = {u: (units_dir / u).read_text() for u in SIDECARS}

    def as_nobody() -> None:
        for u in SIDECARS:
            text = (units_dir / u).read_text()
            (units_dir / u).write_text(text.replace("User=tokengate", "User=nobody"))

    try:
        as_nobody()
        os.chown(host.config, 0, 0)   # what 0.1.0's `keys create` left
        host.config.chmod(0o600)
        status, lines = doctor(host)
        assert status == 1
        for u in SIDECARS:
            assert lines[("readable", u)].startswith(
                f"FAIL readable: user nobody (group www-data) cannot read {host.config} "
                "(600 root:root)"), lines
        assert host.tokengate("install", "--prefix", str(host.root)).returncode == 0
        as_nobody()   # install wrote the units again
        lines = host_lines(host)
        for u in SIDECARS:
            assert lines[("readable", u)].startswith("OK readable: user nobody"), lines
    finally:
        for u, text in kept.items():
            (units_dir / u).write_text(text)


def test_the_doctor_fails_a_redis_without_persistence(
        host: Host, upgraded: Upgrade) -> None:
    client = host.redis.client()
    where = ("redis_persistence", f"127.0.0.1:{host.redis.port}")
    try:
        client.config_set("appendonly", "no")
        client.config_set("save", "")
        status, lines = doctor(host)
        assert status == 1
        assert lines[where].startswith("FAIL redis_persistence: no persistence")
    finally:
        client.config_set("appendonly", "yes")
        client.close()
    assert host_lines(host)[where].startswith("OK ")


def test_the_doctor_fails_an_engine_file_the_running_ledger_does_not_follow(
        host: Host, upgraded: Upgrade) -> None:
    # a replica's engine records added to the configuration of a ledger that started
    # without any: it keeps billing with the edge's numbers until it restarts
    engine = host.root / "var/lib/tokengate/engine/8100.jsonl"
    good = host.config.read_text()
    raw = yaml.safe_load(good)
    try:
        raw["ledger"]["engine_usage_files"] = [str(engine)]
        host.config.write_text(yaml.safe_dump(raw, sort_keys=False))
        wait_until(lambda: host.ledger_status().get("config_reloads", 0) >= 1, 30,
                   what="the ledger's reload")
        status, lines = doctor(host)
        assert status == 1
        assert lines[("engine_file_followed", str(engine))] == (
            "FAIL engine_file_followed: the running ledger does not follow it: its "
            "replica's requests are billed with the edge's numbers (systemctl restart "
            "tokengate-ledger; it follows no engine file)")
        host.restart("tokengate-ledger.service")
        lines = host_lines(host)
        assert lines[("engine_file_followed", str(engine))] == \
            "OK engine_file_followed: the running ledger follows it"
    finally:
        host.config.write_text(good)
        host.restart("tokengate-ledger.service")


def test_the_release_archive_is_the_tags_tree() -> None:
    """``releases/v0.1.0.tar.gz`` holds what ``git archive v0.1.0 RELEASE_PATHS`` gives,
    file for file; where the tag is not in this clone there is nothing to compare."""
    tag = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "-q",
                          f"{PREVIOUS}^{{commit}}"], capture_output=True, check=False)
    if tag.returncode != 0:
        pytest.skip(f"{PREVIOUS} is not in this clone (made without tags or history)")
    fresh = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", PREVIOUS,
                            *RELEASE_PATHS], capture_output=True, check=True, timeout=120)
    kept = subprocess.run(["gzip", "-dc", str(RELEASE)], capture_output=True, check=True)
    assert tar_members(kept.stdout) == tar_members(fresh.stdout)


def tar_members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}  # type: ignore[union-attr]
