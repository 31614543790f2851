"""The Debian drop-in on Debian's own nginx, the way an operator runs it.

A copy of Debian's /etc/nginx layout (the packaged nginx.conf, checked against the
package's checksum, with its modules-enabled, conf.d, sites-enabled and the default
site) is built under a temporary root; `tokengate install --prefix ROOT` puts the
drop-in, the snippet, the Lua modules, the configuration and the units there; the
operator's one edit (`include snippets/tokengate-location.conf;` in the default site)
is made; Debian's nginx binary starts on it as root, its workers as www-data (the
packaged `user www-data;`). The counter and the ledger run from their installed units'
command lines, vLLM is the session's CPU server. The official openai client then goes
through it: exact counts, a 429, a stream, usage events, rotation by `nginx -s reopen`
(with the ledger reading both files), and nginx starting again after a SIGKILL thanks
to the nginx.service drop-in.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import yaml
from tokengate import redis_keys as store
from tokengate_dev import devstack
from tokenstorm.process import Service, free_port, tcp_ready

from tests import units
from tests.conftest import MODEL, key_digest

ROOT = devstack.ROOT
TOKENGATE = Path(sys.executable).parent / "tokengate"
LEDGER_DB = 10  # the session Redis, a database of its own
MAIN_KEY, RPM_KEY = "tg-test-debian-main", "tg-test-debian-rpm"
KEYS = {"debian-main": (MAIN_KEY, 100_000, 100_000_000), "debian-rpm": (RPM_KEY, 2, 1_000_000)}
CONNECT = ("import errno, socket, sys\n"
           "s = socket.socket(socket.AF_UNIX)\n"
           "try:\n    s.connect(sys.argv[1]); print('ok')\n"
           "except OSError as e:\n    print(errno.errorcode[e.errno])\n")


def packaged_nginx_conf() -> str:
    """/etc/nginx/nginx.conf as the nginx-common package ships it (a local edit fails the
    test: it would no longer be Debian's file that is tested)."""
    conffiles = subprocess.run(["dpkg-query", "-W", "-f=${Conffiles}", "nginx-common"],
                               capture_output=True, text=True, check=True).stdout
    md5 = dict(line.split()[:2] for line in conffiles.splitlines() if line.strip())
    text = Path("/etc/nginx/nginx.conf").read_text()
    assert hashlib.md5(text.encode()).hexdigest() == md5["/etc/nginx/nginx.conf"], \
        "/etc/nginx/nginx.conf differs from the packaged file"
    return text


def relocate(text: str, root: Path, *paths: str) -> str:
    """``text`` with each absolute path prefix of ``paths`` moved below ``root``; each
    must occur (so a change of Debian's file shows here)."""
    for p in paths:
        assert p in text, f"{p} not in Debian's file any more"
        text = text.replace(p, f"{root}{p}")
    return text


def debian_layout(root: Path, port: int) -> Path:
    """Debian's /etc/nginx under ``root``; the default site listens on 127.0.0.1:port
    and includes the tokengate snippet (the operator's edit). Returns nginx.conf."""
    etc = root / "etc/nginx"
    for d in ("conf.d", "modules-enabled", "sites-available", "sites-enabled", "snippets"):
        (etc / d).mkdir(parents=True)
    (root / "run").mkdir()
    (root / "var/log/nginx").mkdir(parents=True)
    (etc / "nginx.conf").write_text(relocate(
        packaged_nginx_conf(), root, "/etc/nginx/", "/run/nginx.pid", "/var/log/nginx/"))
    shutil.copy(Path("/etc/nginx/mime.types"), etc / "mime.types")
    for name in ("10-mod-http-ndk.conf", "50-mod-http-lua.conf"):
        # the packages' own links, to /usr/share/nginx/modules-available/
        link = Path("/etc/nginx/modules-enabled") / name
        os.symlink(os.readlink(link), etc / "modules-enabled" / name)
    site = Path("/etc/nginx/sites-available/default").read_text()
    site = site.replace("\tlisten 80 default_server;\n",
                        f"\tlisten 127.0.0.1:{port} default_server;\n")
    site = site.replace("\tlisten [::]:80 default_server;\n", "")
    site = site.replace("\tserver_name _;\n",
                        "\tserver_name _;\n\n\tinclude snippets/tokengate-location.conf;\n")
    assert f"listen 127.0.0.1:{port}" in site and "tokengate-location.conf" in site
    (etc / "sites-available/default").write_text(site)
    os.symlink(etc / "sites-available/default", etc / "sites-enabled/default")
    return etc / "nginx.conf"


@dataclass
class HostFiles:
    """The files of tokengate installed on a host below ``root`` (``/`` on a real host;
    ``tokengate install --prefix ROOT``) that the tests read, where the install puts
    them (tokengate.install)."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "etc/tokengate/tokengate.yaml"

    @property
    def edge_json(self) -> Path:
        return self.root / "etc/tokengate/edge.json"

    @property
    def usage(self) -> Path:
        return self.root / "var/lib/tokengate/usage/usage.jsonl"

    @property
    def run(self) -> Path:
        """/run/tokengate: the sidecars' and the hop server's sockets, the ledger's
        status file."""
        return self.root / "run/tokengate"


@dataclass
class Host(HostFiles):
    conf: Path
    port: int
    nginx: Service
    counter: units.Running
    ledger: units.Running
    redis: redis.Redis

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, key: str = MAIN_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=120)

    def events(self, path: Path | None = None) -> list[dict[str, Any]]:
        p = path or self.usage
        return [json.loads(x) for x in p.read_text().splitlines() if x] if p.exists() else []

    def event(self, request_id: str, path: Path | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            found = [e for e in self.events(path) if e["request_id"] == request_id]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no usage event for {request_id} in {path or self.usage}")

    def nginx_service(self) -> Service:
        # daemon off instead of Debian's `daemon on` (systemd's Type=forking), so that
        # the test holds the master; everything else is the packaged configuration.
        return Service("debian-nginx", ["nginx", "-c", str(self.conf), "-g", "daemon off;"],
                       tcp_ready("127.0.0.1", self.port), start_timeout_s=30,
                       log_dir=self.root / "var/log")

    def nginx_signal(self, name: str) -> None:
        subprocess.run(["nginx", "-c", str(self.conf), "-s", name], check=True, timeout=30)


def _config(config_path: Path, redis_url: str, out: Path) -> Path:
    raw = yaml.safe_load(config_path.read_text())
    for key_id, (key, rpm, tpm) in KEYS.items():
        raw["keys"][key_id] = {"sha256": key_digest(key), "rpm": rpm, "tpm": tpm}
    raw["redis"]["url"] = f"{redis_url.rsplit('/', 1)[0]}/{LEDGER_DB}"
    raw.setdefault("ledger", {})["rotate_wait_s"] = 0.5
    edge = raw.setdefault("edge", {})
    edge["status_listen"] = f"127.0.0.1:{free_port()}"  # not make run's 8081
    edge["count_timeout_ms"] = 3000  # this 2-core machine also runs vLLM CPU
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def host(config_path: Path, redis_url: str, vllm_url: str) -> Iterator[Host]:
    # Not pytest's tmp_path: its folders are 0700, and nginx's www-data workers must
    # reach the Lua modules, the sockets and the usage file below this root.
    root = Path(tempfile.mkdtemp(prefix="tg-debian-", dir="/tmp"))
    started: list[units.Running | Service] = []
    h: Host | None = None
    client = redis.Redis.from_url(f"{redis_url.rsplit('/', 1)[0]}/{LEDGER_DB}",
                                  decode_responses=True)
    try:
        os.chmod(root, 0o755)
        port = free_port()
        conf = debian_layout(root, port)
        cfg = _config(config_path, redis_url, root / "source-tokengate.yaml")
        r = subprocess.run([str(TOKENGATE), "install", "--prefix", str(root), "--source",
                            str(ROOT), "--config", str(cfg), "--vllm-python", sys.executable],
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        client.flushdb()
        units_dir = root / "etc/systemd/system"
        counter = units.start(units_dir / "tokengate-counter.service", root, root / "var/log")
        started.append(counter)
        ledger = units.start(units_dir / "tokengate-ledger.service", root, root / "var/log")
        started.append(ledger)
        h = Host(root, conf, port, None, counter, ledger, client)  # type: ignore[arg-type]
        counter.wait_for(lambda: all((h.run / f"counter.sock.{i}").exists() for i in range(2)),
                         90, "socket of each worker")
        ledger.wait_for((h.run / "ledger.status.json").exists, 60, "status file")
        # what Debian's nginx.service runs before starting nginx: with the drop-in alone
        # (right after install, before the operator's include line; and after removal
        # takes that line out) the host's nginx still loads, and then with the include
        site = root / "etc/nginx/sites-available/default"
        with_include = site.read_text()
        site.write_text(with_include.replace("\tinclude snippets/tokengate-location.conf;\n", ""))
        for text in (site.read_text(), with_include):
            site.write_text(text)
            t = subprocess.run(["nginx", "-t", "-q", "-c", str(conf)], capture_output=True,
                               text=True, timeout=30, check=False)
            assert t.returncode == 0, t.stderr
        h.nginx = h.nginx_service().start()
        yield h
    finally:
        # the nginx of the last test may be another than the first (a restart)
        for svc in ([h.nginx] if h is not None and h.nginx is not None else []) + started:
            svc.stop()
        client.close()
        shutil.rmtree(root, ignore_errors=True)


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4: ppid
            out.append(int(stat.parent.name))
    return out


def _in_group(pgid: int) -> bool:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                return True
        except OSError:
            continue
    return False


def test_workers_run_as_www_data_from_the_packaged_nginx_conf(host: Host) -> None:
    assert host.nginx.proc is not None
    workers = _children(host.nginx.proc.pid)
    assert workers
    assert {pwd.getpwuid(Path(f"/proc/{w}").stat().st_uid).pw_name for w in workers} == \
        {"www-data"}


def connect_as(user: str, group: str, path: Path) -> str:
    """Connect to a unix socket as ``user``: 'ok' or the errno's name."""
    r = subprocess.run(["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups",
                        "/usr/bin/python3", "-c", CONNECT, str(path)],
                       capture_output=True, text=True, timeout=30, check=True)
    return r.stdout.strip()


def test_only_nginxs_group_reaches_the_hop_and_the_sidecars(host: Host) -> None:
    st = host.run.stat()
    assert (oct(st.st_mode & 0o777), st.st_gid) == ("0o750", pwd.getpwnam("www-data").pw_gid)
    hop = host.run / "hop.sock"
    # nginx makes its listening socket 0666 whatever the umask: the folder decides
    assert oct(hop.stat().st_mode & 0o777) == "0o666"
    counter = host.run / "counter.sock.0"
    assert [connect_as("nobody", "nogroup", s) for s in (hop, counter)] == ["EACCES", "EACCES"]
    assert [connect_as("www-data", "www-data", s) for s in (hop, counter)] == ["ok", "ok"]


def test_the_count_is_exact_through_debians_nginx(host: Host) -> None:
    raw = host.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer in one word."},
                               {"role": "user", "content": "Largest planet?"}],
        max_tokens=5)
    resp = raw.parse()
    assert resp.usage is not None
    assert raw.headers.get("x-token-count-source") != "estimate"
    assert int(raw.headers["x-token-count"]) == resp.usage.prompt_tokens
    assert raw.headers["x-ratelimit-limit-requests"] == "100000"
    ev = host.event(raw.headers["x-request-id"])
    assert (ev["key_id"], ev["status"], ev["prompt_tokens"], ev["completion_tokens"]) == \
        ("debian-main", 200, resp.usage.prompt_tokens, resp.usage.completion_tokens)


def test_a_stream_is_billed_its_final_usage(host: Host) -> None:
    raw = host.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(raw.parse())
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == \
        (int(raw.headers["x-token-count"]), 6)
    ev = host.event(raw.headers["x-request-id"])
    assert (ev["stream"], ev["usage_source"], ev["prompt_tokens"], ev["completion_tokens"]) \
        == (True, "final", final.usage.prompt_tokens, 6)


def test_the_third_request_of_a_two_rpm_key_is_429(host: Host) -> None:
    c = host.client(RPM_KEY)
    for _ in range(2):
        c.chat.completions.create(model=MODEL, max_tokens=1,
                                  messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model=MODEL, max_tokens=1,
                                  messages=[{"role": "user", "content": "Hi"}])
    r = e.value.response
    assert r.status_code == 429
    assert re.fullmatch(r"[1-9][0-9]*", r.headers["retry-after"])
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    ev = host.event(r.headers["x-request-id"])
    assert (ev["key_id"], ev["status"]) == ("debian-rpm", 429)


def test_the_hosts_default_site_still_answers(host: Host) -> None:
    index = Path("/var/www/html/index.nginx-debian.html")
    if not index.exists():
        pytest.skip("no Debian default page on this machine")
    with urllib.request.urlopen(f"http://127.0.0.1:{host.port}/", timeout=10) as r:
        assert (r.status, r.read()) == (200, index.read_bytes())


def test_the_hosts_own_404_stays_the_hosts(host: Host) -> None:
    # the snippet's server-level error_page covers only what nginx refuses while reading
    # a request's head; a missing page of the host's site is its own (HTML) 404
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{host.port}/no-such-page", timeout=10)
    assert refused.value.code == 404
    assert refused.value.headers["Content-Type"].startswith("text/html")
    assert b"unknown_url" not in refused.value.read()


def test_rotation_by_nginx_s_reopen_and_the_ledger_applies_both_files(host: Host) -> None:
    before = host.events()
    assert before, "the tests above wrote events"
    rotated = host.usage.with_name("usage.jsonl.1")
    host.usage.rename(rotated)
    host.nginx_signal("reopen")
    deadline = time.monotonic() + 10
    while not host.usage.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    # the root master made the new file and gave it to the workers' user
    assert pwd.getpwuid(host.usage.stat().st_uid).pw_name == "www-data"
    raw = host.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "After the rotation."}],
        max_tokens=3)
    rid = raw.headers["x-request-id"]
    assert host.event(rid)["request_id"] == rid
    assert [e["request_id"] for e in host.events(rotated)] == \
        [e["request_id"] for e in before]
    every = host.events(rotated) + host.events()
    status = host.run / "ledger.status.json"
    host.ledger.wait_for(lambda: json.loads(status.read_text())["applied"] == len(every), 60,
                         f"{len(every)} events applied")
    want: dict[tuple[str, str, str], int] = {}
    for e in every:
        k = (e["ts"][:10], e["key_id"], e["model"])
        want[k] = want.get(k, 0) + e["prompt_tokens"]
    got = {k: int(host.redis.hget(store.usage_key(*k), "prompt_tokens") or 0) for k in want}
    assert got == want


def test_a_killed_nginx_starts_again_after_the_nginx_service_dropin(host: Host) -> None:
    assert host.nginx.proc is not None
    pgid = host.nginx.proc.pid
    os.killpg(pgid, signal.SIGKILL)
    host.nginx.proc.wait(10)
    deadline = time.monotonic() + 10
    while _in_group(pgid) and time.monotonic() < deadline:  # the workers too
        time.sleep(0.05)
    hop = host.run / "hop.sock"
    assert hop.exists(), "nginx killed: its socket stays behind"
    again = subprocess.run(["nginx", "-c", str(host.conf), "-g", "daemon off;"],
                           capture_output=True, text=True, timeout=30, check=False)
    assert again.returncode == 1
    assert f"bind() to unix:{hop} failed (98: Address already in use)" in again.stderr
    dropin = units.read_unit(host.root / "etc/systemd/system/nginx.service.d/tokengate.conf")
    pre = units.command(dropin, "ExecStartPre", units.specifiers(host.root), {})
    subprocess.run(pre, check=True, timeout=30)
    host.nginx = host.nginx_service().start()
    r = host.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Back?"}], max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens >= 1
