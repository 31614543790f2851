"""`tokengate install` and the units of systemd/: what lands where with which owner, the
configuration kept, every unit accepted by `systemd-analyze verify`, and each service
started from its installed unit's own ExecStart and environment (tests/units.py)
answering: the counter a CountTokens call, the global limits their health and a
Reserve, the ledger an event applied to Redis, vLLM (CPU build) a tools request with
the usage details billing reads.
(Over 600 lines: one installed tree, made once per module, whose files and units
every case here reads.)"""

from __future__ import annotations

import ast
import grp
import importlib.metadata
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokengate import config as tg_config
from tokengate import redis_keys as store
from tokengate.counter import frames
from tokengate.install import config_text
from tokengate.install import host as install_host
from tokengate.install import plan as install_plan
from tokengate.tools import nginx_conf
from tokengate.v1 import counter_pb2, counter_pb2_grpc, limits_pb2, limits_pb2_grpc
from tokengate_dev import devstack
from tokenstorm.process import free_port

from tests import units
from tests.cli_calls import tokengate
from tests.conftest import MODEL, REPO_CONFIG
from tests.fixtures_ledger import make_event

ROOT = devstack.ROOT
TOKENGATE = Path(sys.executable).parent / "tokengate"
SIDECARS = ("tokengate-counter.service", "tokengate-ledger.service", "tokengate-limits.service")
CONSOLE = "tokengate-console.service"   # the operator console: a service of its own
BATCH = "tokengate-batch.service"       # the Batch API: a service of its own
# root's side of the console's key changes (a path unit starts the service)
CONSOLE_APPLY = ("tokengate-console-apply.path", "tokengate-console-apply.service")
LEDGER_DB = 9  # the session Redis, a database of its own (ledger tests flush database 0)
BODY = json.dumps({"model": MODEL, "messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers of Europe."}], "max_tokens": 16}).encode()


def install(prefix: Path, *args: str | Path,
            vllm_python: str | None = sys.executable) -> subprocess.CompletedProcess[str]:
    """`tokengate install --prefix PREFIX ...` from the checkout, as an operator runs it
    (in this process: tests/cli_calls.py; the dry runs below start the console script);
    with ``--vllm-python`` this interpreter unless ``vllm_python`` is None."""
    python = ["--vllm-python", vllm_python] if vllm_python is not None else []
    return tokengate("install", "--prefix", prefix, "--source", ROOT, *python, *args)


def owner_of_tokengate() -> str:
    """Who owns what the tokengate user would own: root stands in under a prefix on a
    machine without that user."""
    try:
        pwd.getpwnam("tokengate")
        return "tokengate"
    except KeyError:
        return "root"


def ledger_url(redis_url: str) -> str:
    return f"{redis_url.rsplit('/', 1)[0]}/{LEDGER_DB}"


@dataclass
class Installed:
    prefix: Path
    config: Path      # the source configuration given to --config
    logs: Path

    def unit(self, name: str) -> Path:
        return self.prefix / "etc/systemd/system" / name

    @property
    def run(self) -> Path:
        return self.prefix / "run/tokengate"


def test_config(config_path: Path, redis_url: str, out: Path) -> Path:
    """The session's test configuration (the embedded model, the test vLLM port) with
    the ledger's Redis database of these tests."""
    raw = yaml.safe_load(config_path.read_text())
    raw["redis"]["url"] = ledger_url(redis_url)
    raw.setdefault("ledger", {})["rotate_wait_s"] = 0.5
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return out


test_config.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def installed(config_path: Path, redis_url: str,
              tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("install")
    cfg = test_config(config_path, redis_url, base / "tokengate.yaml")
    prefix = base / "root"
    r = install(prefix, "--config", cfg)
    assert r.returncode == 0, r.stderr
    return Installed(prefix, cfg, base / "logs")


def stat_of(path: Path) -> tuple[str, str, str]:
    st = path.stat()
    return (oct(st.st_mode & 0o7777), pwd.getpwuid(st.st_uid).pw_name,
            grp.getgrgid(st.st_gid).gr_name)


def test_install_puts_every_file_in_its_place_with_its_owner(installed: Installed) -> None:
    p, tg = installed.prefix, owner_of_tokengate()
    want = {
        "etc/tokengate": ("0o750", "root", "www-data"),
        "etc/tokengate/tokengate.yaml": ("0o640", "root", "www-data"),
        "etc/tokengate/edge.json": ("0o640", "root", "www-data"),
        "etc/tokengate/vllm": ("0o750", "root", "www-data"),
        "etc/tokengate/vllm/example.env": ("0o644", "root", "root"),
        "var/lib/tokengate": ("0o750", tg, "www-data"),
        "var/lib/tokengate/usage": ("0o750", "root", "www-data"),
        "var/lib/tokengate/engine": ("0o750", tg, "www-data"),
        "var/log/tokengate": ("0o750", "root", "www-data"),
        "run/tokengate": ("0o750", tg, "www-data"),
        "usr/share/tokengate/lua/tokengate/phases.lua": ("0o644", "root", "root"),
        "usr/share/tokengate/nginx/tokengate-http.conf.in": ("0o644", "root", "root"),
        "etc/nginx/conf.d/tokengate.conf": ("0o644", "root", "root"),
        "etc/nginx/snippets/tokengate-location.conf": ("0o644", "root", "root"),
        "etc/systemd/system/nginx.service.d/tokengate.conf": ("0o644", "root", "root"),
        "etc/tmpfiles.d/tokengate.conf": ("0o644", "root", "root"),
        **{f"etc/systemd/system/{u}": ("0o644", "root", "root")
           for u in (*SIDECARS, CONSOLE, *CONSOLE_APPLY, BATCH, "tokengate-vllm@.service")},
    }
    assert {k: stat_of(p / k) for k in want} == want
    lua_dir = p / "usr/share/tokengate/lua/tokengate"
    lua = sorted(f.relative_to(lua_dir) for f in lua_dir.rglob("*") if f.is_file())
    assert lua == sorted(f.relative_to(ROOT / "lua/tokengate")
                         for f in (ROOT / "lua/tokengate").rglob("*.lua"))
    # the units run this virtualenv's programs and the given vLLM interpreter
    counter = units.read_unit(installed.unit("tokengate-counter.service"))
    assert counter.value("Service", "ExecStart").split()[0] == \
        f"{Path(sys.executable).parent.resolve()}/tokengate-counter"
    vllm = units.read_unit(installed.unit("tokengate-vllm@.service"))
    assert vllm.value("Service", "ExecStart").split()[0] == str(Path(sys.executable).absolute())


def test_the_installed_dropin_is_the_committed_one_under_the_prefix(
        installed: Installed) -> None:
    # the test configuration's edge section is the schema's defaults, as for the
    # committed files: only the prefix in front of every path differs
    for installed_file, committed in (
            ("etc/nginx/conf.d/tokengate.conf", nginx_conf.debian_conf(devstack.NGINX_DIR)),
            ("etc/nginx/snippets/tokengate-location.conf",
             nginx_conf.debian_location_conf(devstack.NGINX_DIR))):
        text = (installed.prefix / installed_file).read_text()
        assert text.replace(str(installed.prefix), "") == committed.read_text()
    assert f"listen unix:{installed.run}/hop.sock;" in \
        (installed.prefix / "etc/nginx/conf.d/tokengate.conf").read_text()


def test_the_installed_config_names_the_dropins_paths(installed: Installed) -> None:
    p = installed.prefix
    cfg = tg_config.load(p / "etc/tokengate/tokengate.yaml")
    assert cfg.ledger.usage_file == cfg.edge.usage_file == \
        p / "var/lib/tokengate/usage/usage.jsonl"
    assert cfg.access_log.file == p / "var/log/tokengate/access.sampled.log"
    assert cfg.global_limits.unix_socket == p / "run/tokengate/limits.sock"
    assert cfg.models[MODEL].dir == (ROOT / "var/models/tiny-qwen3").resolve()
    edge = json.loads((p / "etc/tokengate/edge.json").read_text())
    assert edge["source"] == str(p / "etc/tokengate/tokengate.yaml")
    assert edge["edge"]["usage_file"] == str(p / "var/lib/tokengate/usage/usage.jsonl")


@pytest.mark.unit
def test_deploy_config_keeps_every_comment_and_sets_only_the_paths() -> None:
    text = REPO_CONFIG.read_text()
    paths = nginx_conf.debian_paths()
    out = config_text.deploy_config_text(text, REPO_CONFIG.parent, paths)
    changed = [(a, b) for a, b in zip(text.splitlines(), out.splitlines(), strict=True)
               if a != b]
    assert [b.split("#")[0].strip() for _a, b in changed] == [
        f"dir: {(REPO_CONFIG.parent / 'var/models/tiny-qwen3').resolve()}",
        "usage_file: /var/lib/tokengate/usage/usage.jsonl",
        "unix_socket: /run/tokengate/limits.sock",
        "file: /var/log/tokengate/access.sampled.log",
    ]
    # comments after the changed values stay, naming the new value where they named the old
    assert all("#" in b for a, b in changed if "#" in a)
    assert "  unix_socket: /run/tokengate/limits.sock   # worker i listens on " \
           "/run/tokengate/limits.sock.<i>" in out.splitlines()
    # a section without the key gets it as its first key; a missing one is added
    out = config_text.deploy_config_text("models: {}\naccess_log:\n  rate: 0.5   # x\n"
                             "global_limits:\n  unix_socket: false\n", Path("/"), paths)
    assert yaml.safe_load(out) == {
        "models": {}, "access_log": {"file": "/var/log/tokengate/access.sampled.log",
                                     "rate": 0.5},
        "global_limits": {"unix_socket": False},
        "ledger": {"usage_file": "/var/lib/tokengate/usage/usage.jsonl"}}


def install_test_config(config_path: Path, redis_url: str, tmp_path: Path
                        ) -> tuple[Path, Path]:
    """``test_config`` installed under ``tmp_path/root``: (the prefix, the installed
    configuration)."""
    prefix = tmp_path / "root"
    assert install(prefix, "--config",
                   test_config(config_path, redis_url, tmp_path / "c.yaml")).returncode == 0
    return prefix, prefix / "etc/tokengate/tokengate.yaml"


def test_a_second_install_keeps_the_config_and_recompiles_edge_json(
        config_path: Path, redis_url: str, tmp_path: Path) -> None:
    prefix, target = install_test_config(config_path, redis_url, tmp_path)
    edited = target.read_text().replace("rpm: 600", "rpm: 7")
    target.write_text(edited)
    r = install(prefix, "--config", tmp_path / "c.yaml")
    assert r.returncode == 0, r.stderr
    assert f"keep {target} (it exists)" in r.stdout
    assert target.read_text() == edited
    keys = json.loads((prefix / "etc/tokengate/edge.json").read_text())["keys"]
    assert [k["rpm"] for k in keys.values() if k["id"] == "demo"] == [7]


def test_an_install_again_gives_the_units_back_a_config_they_can_read(
        config_path: Path, redis_url: str, tmp_path: Path) -> None:
    # what 0.1.0's `keys create` left behind: root:root 0600, every unit then failed at
    # start with Permission denied
    prefix, target = install_test_config(config_path, redis_url, tmp_path)
    os.chown(target, 0, 0)
    target.chmod(0o600)
    r = install(prefix)
    assert r.returncode == 0, r.stderr
    assert (f"keep {target} (it exists); set 640 root:www-data again (it was 600 root:root: "
            "the units could not read it)") in r.stdout
    assert stat_of(target) == ("0o640", "root", "www-data")
    r = install(prefix)  # nothing left to repair: said plainly
    assert f"keep {target} (it exists)\n" in r.stdout


def needed_value(prefix: Path, row: config_text.Needed) -> Path:
    return prefix / row.value.lstrip("/")


def test_an_install_over_an_earlier_releases_config_adds_what_this_release_needs(
        config_path: Path, redis_url: str, tmp_path: Path) -> None:
    # an operator's file without ledger.console.changes_dir: every key change made in
    # the console under the units failed with Permission denied after the upgrade
    prefix, target = install_test_config(config_path, redis_url, tmp_path)
    cfg = tg_config.load(target)
    for row in config_text.NEEDED:   # a fresh install has every setting of the table
        assert row.configured(cfg) == needed_value(prefix, row)
    earlier = "\n".join(line for line in target.read_text().splitlines()
                        if line.strip().partition(":")[0] not in
                        {row.keys[-1] for row in config_text.NEEDED}) + "\n"
    earlier = earlier.replace("\n  console:\n", "\n")  # its only key was added
    target.write_text(earlier)
    for row in config_text.NEEDED:
        if row.folder is not None:
            needed_value(prefix, row).rmdir()
    assert tg_config.load(target).ledger.console.changes_dir is None
    r = install(prefix)
    assert r.returncode == 0, r.stderr
    names = ", ".join(f"{row.name} ({row.since} needs it)" for row in config_text.NEEDED)
    assert f"add {names} to {target}, 640 root:www-data" in r.stdout.splitlines()
    cfg = tg_config.load(target)
    for row in config_text.NEEDED:
        assert row.configured(cfg) == needed_value(prefix, row)
        if row.folder is not None:
            mode, (user, group) = row.folder
            assert stat_of(needed_value(prefix, row)) == (
                oct(mode), owner_of_tokengate() if user == "tokengate" else user, group)
    # the lines added, nothing else: every comment and setting as the operator left it
    added = [line for line in target.read_text().splitlines()
             if line not in earlier.splitlines()]
    assert added == ["  console:", f"    changes_dir: {prefix}/var/lib/tokengate/console"]
    assert stat_of(target) == ("0o640", "root", "www-data")
    again = install(prefix)
    assert not any(line.startswith("add ") for line in again.stdout.splitlines())


@pytest.mark.parametrize("console, why", [
    ("  console: {listen: 127.0.0.1:9466}\n",
     ("ledger.console: write it as a block mapping (`console:` then indented keys) so that "
     "install can set ledger.console.changes_dir")),
    ("  console:\n    changes_dir: null\n",
     "ledger.console.changes_dir is null: set it to {prefix}/var/lib/tokengate/console"),
], ids=["flow-style", "null"])
def test_a_config_install_cannot_give_what_this_release_needs_is_refused_by_file_and_key(
        config_path: Path, redis_url: str, tmp_path: Path, console: str, why: str) -> None:
    prefix, target = install_test_config(config_path, redis_url, tmp_path)
    text = re.sub(r"\n  console:\n    changes_dir: \S+\n", "\n" + console,
                  target.read_text())
    target.write_text(text)
    before = {p: p.stat().st_mtime_ns for p in prefix.rglob("*")}
    r = install(prefix)
    row = next(r for r in config_text.NEEDED if r.name == "ledger.console.changes_dir")
    assert (r.returncode, r.stderr.splitlines()) == (1, [
        f"{target}: {why.format(prefix=prefix)} (tokengate {row.since} needs it: {row.why})",
        "tokengate install: 1 problem(s); nothing changed"])
    assert {p: p.stat().st_mtime_ns for p in prefix.rglob("*")} == before


def test_a_config_whose_usage_file_is_not_the_dropins_is_refused_and_nothing_changes(
        config_path: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    target = prefix / "etc/tokengate/tokengate.yaml"
    target.parent.mkdir(parents=True)
    raw = yaml.safe_load(config_path.read_text())
    raw["ledger"] = {"usage_file": "/srv/usage.jsonl"}
    raw["access_log"] = {"file": False}  # off: fine (the snippet then writes none)
    target.write_text(yaml.safe_dump(raw))
    before = sorted(prefix.rglob("*"))
    r = install(prefix)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [
        (f"{target}: ledger.usage_file (and edge.usage_file) must be "
         f"{prefix}/var/lib/tokengate/usage/usage.jsonl, the file the drop-in's snippet "
         "writes; it is /srv/usage.jsonl"),
        "tokengate install: 1 problem(s); nothing changed"]
    assert sorted(prefix.rglob("*")) == before


def test_dry_run_prints_the_plan_and_changes_nothing(config_path: Path, redis_url: str,
                                                     tmp_path: Path) -> None:
    cfg = test_config(config_path, redis_url, tmp_path / "c.yaml")
    r = install(tmp_path / "root", "--config", cfg, "--dry-run")
    assert r.returncode == 0, r.stderr
    steps = [line for line in r.stdout.splitlines() if not line.startswith("note:")]
    assert steps and all(line.startswith("would ") for line in steps)
    assert f"would write {tmp_path}/root/etc/nginx/conf.d/tokengate.conf" in steps
    assert not (tmp_path / "root").exists()


def test_on_the_host_a_virtualenv_the_units_cannot_see_is_refused(tmp_path: Path) -> None:
    # --prefix / with --dry-run: checks only. This checkout's virtualenv (or the Python
    # it is made from) lives under /root or /home, which ProtectHome=yes hides from
    # every unit.
    hidden = [(opt, path) for opt, path in (("--bin-dir", TOKENGATE.parent),
                                            ("--vllm-python", Path(sys.executable)))
              if str(path.resolve()).startswith(("/root/", "/home/"))]
    if not hidden:
        pytest.skip("this virtualenv and its Python are outside /home and /root")
    r = subprocess.run([str(TOKENGATE), "install", "--dry-run", "--source", str(ROOT),
                        "--config", str(REPO_CONFIG), "--vllm-python", sys.executable],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1
    for opt, path in hidden:
        named = path if path.resolve() == path else f"{path} (resolves to {path.resolve()})"
        assert f"{opt} {named} is below /home, /root, /run/user, which the units " \
               "hide (ProtectHome=yes): use a virtualenv or folder such as /opt/tokengate" \
               in r.stderr.splitlines(), r.stderr
    # a virtualenv outside them whose interpreter is not (a pyenv Python under /root)
    seen = [p for p in install_host.interpreter_files(Path(sys.executable)) if install_host.hidden(p)]
    unseen = 1 if seen and ("--bin-dir", TOKENGATE.parent) not in hidden else 0
    assert r.stderr.splitlines()[-1] == \
        f"tokengate install: {len(hidden) + unseen} problem(s); nothing changed"


@pytest.mark.unit
def test_a_path_whose_links_pass_through_a_hidden_folder_is_hidden(tmp_path: Path) -> None:
    # /srv/models/via-root -> /root/x -> /srv/models/real: the target is outside /root,
    # but a unit with ProtectHome=yes cannot follow the link in /root
    home = Path.home()
    if home not in install_host.HIDDEN or not os.access(home, os.W_OK):
        pytest.skip("no writable hidden home folder here")
    real = tmp_path / "real"
    real.mkdir()
    middle = Path(tempfile.mkdtemp(dir=home, prefix=".tokengate-test-")) / "link"
    try:
        middle.symlink_to(real)
        (tmp_path / "via-home").symlink_to(middle)
        assert install_host.hidden(tmp_path / "via-home")
        assert install_host.hidden(tmp_path / "via-home" / "tokenizer.json")
        assert not install_host.hidden(real)
        (tmp_path / "direct").symlink_to(real)
        assert not install_host.hidden(tmp_path / "direct")
    finally:
        shutil.rmtree(middle.parent)


def test_a_hidden_path_is_named_as_given_then_where_it_resolves(tmp_path: Path) -> None:
    # an operator's --vllm-python /root/.cache/x/venv/bin/python was refused as
    # "/root/.pyenv/versions/3.11.7/bin/python3.11 is below ...": a path not given
    # (--bin-dir and models.<name>.dir are named by the same line)
    away = Path("/root/.cache/tokengate-absent/venv")
    python = tmp_path / "python"
    python.symlink_to(away / "bin/python3.11")
    r = subprocess.run([str(TOKENGATE), "install", "--dry-run", "--source", str(ROOT),
                        "--config", str(REPO_CONFIG), "--vllm-python", str(python)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1
    why = ("is below /home, /root, /run/user, which the units hide (ProtectHome=yes): use a "
           "virtualenv or folder such as /opt/tokengate")
    assert f"--vllm-python {python} (resolves to {away}/bin/python3.11) {why}" in \
        r.stderr.splitlines(), r.stderr
    # a path that is where it is named is named once
    r = subprocess.run([str(TOKENGATE), "install", "--dry-run", "--source", str(ROOT),
                        "--config", str(REPO_CONFIG), "--vllm-python", str(away / "python")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert f"--vllm-python {away}/python {why}" in r.stderr.splitlines(), r.stderr


def fake_venv(root: Path, python_target: Path | None, home: Path) -> Path:
    """A virtualenv's shape under ``root`` (outside /home and /root): bin/python, a link
    to ``python_target`` (None: a copy of this machine's python3, as ``venv --copies``
    makes), pyvenv.cfg naming ``home``, and the three sidecar scripts whose ``#!`` line
    is bin/python. Returns bin/."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    if python_target is None:
        python.write_bytes(Path("/usr/bin/python3").resolve().read_bytes())
        python.chmod(0o755)
    else:
        python.symlink_to(python_target)
    (root / "pyvenv.cfg").write_text(f"home = {home}\ninclude-system-site-packages = false\n")
    for exe in ("tokengate-counter", "tokengate-ledger", "tokengate-limits",
                "tokengate-console"):
        (bin_dir / exe).write_text(f"#!{python}\nimport sys\n")
        (bin_dir / exe).chmod(0o755)
    return bin_dir


def test_on_the_host_a_virtualenv_whose_interpreter_the_units_cannot_see_is_refused(
        tmp_path: Path) -> None:
    # the venv is in /tmp (visible), its python a link to a pyenv Python under /root, or
    # a copy whose pyvenv.cfg home (its standard library) is there: ProtectHome=yes hides
    # both from every unit, which then fails at start with 203/EXEC or no encodings
    pyenv = Path("/root/.pyenv/versions/3.11.7/bin")
    for name, target in (("link", pyenv / "python3.11"), ("copy", None)):
        bin_dir = fake_venv(tmp_path / name, target, pyenv)
        r = subprocess.run([str(TOKENGATE), "install", "--dry-run", "--source", str(ROOT),
                            "--config", str(REPO_CONFIG), "--bin-dir", str(bin_dir),
                            "--vllm-python", "/usr/bin/python3"],
                           capture_output=True, text=True, timeout=120, check=False)
        needs = pyenv / "python3.11" if target is not None else pyenv
        assert (r.returncode, r.stderr.splitlines()) == (1, [
            (f"--bin-dir: its interpreter {bin_dir}/python needs {needs}, which is below "
            "/home, /root, /run/user, hidden from the units (ProtectHome=yes): make the "
            "virtualenv from a Python outside them, e.g. /usr/bin/python3 -m venv "
            "/opt/tokengate"),
            "tokengate install: 1 problem(s); nothing changed"]), name


def test_without_config_install_writes_one_made_for_the_host(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    model_dir = (ROOT / "var/models/tiny-qwen3").resolve()
    r = install(prefix, "--model", "qwen3-8b", "--model-dir", model_dir,
                "--max-model-len", "8192", "--upstream", "127.0.0.1:8100",
                "--upstream", "10.0.0.7:8000")
    assert r.returncode == 0, r.stderr
    target = prefix / "etc/tokengate/tokengate.yaml"
    cfg = tg_config.load(target)
    assert list(cfg.models) == ["qwen3-8b"]
    m = cfg.models["qwen3-8b"]
    assert (m.dir, m.max_model_len, m.upstreams, m.embedded) == \
        (model_dir, 8192, ["127.0.0.1:8100", "10.0.0.7:8000"], False)
    assert cfg.keys == {}
    # Debian's redis-server, the local replica's engine records, the drop-in's paths
    assert cfg.redis.url == "redis://127.0.0.1:6379/0"
    assert cfg.ledger.engine_usage_files == [prefix / "var/lib/tokengate/engine/8100.jsonl"]
    assert cfg.ledger.usage_file == prefix / "var/lib/tokengate/usage/usage.jsonl"
    assert cfg.global_limits.unix_socket == prefix / "run/tokengate/limits.sock"
    # no port of the demo's (make run) nor vLLM's default one
    demo = tg_config.load(REPO_CONFIG)

    def ports(c: tg_config.Config) -> set[str]:
        return {a.rpartition(":")[2] for a in (
            c.edge.status_listen, c.metrics.counter_listen, c.metrics.ledger_listen,
            c.metrics.limits_listen, c.global_limits.listen) if a is not None}

    assert ports(cfg) & (ports(demo) | {"8000", "8080", "6379", "6380"}) == set()
    assert "var/run" not in target.read_text()
    # the replica's example and what to do next serve what the configuration expects
    env = (prefix / "etc/tokengate/vllm/example.env").read_text().splitlines()
    assert {f"TOKENGATE_VLLM_MODEL={model_dir}", "TOKENGATE_VLLM_SERVED_MODEL_NAME=qwen3-8b",
            "TOKENGATE_VLLM_MAX_MODEL_LEN=8192"} <= set(env)
    steps = install_plan.next_steps(cfg).splitlines()
    assert "  systemctl enable --now tokengate-counter tokengate-ledger" in steps
    assert "  qwen3-8b at 127.0.0.1:8100: cp /etc/tokengate/vllm/example.env " \
           "/etc/tokengate/vllm/8100.env, check it, then" in steps
    assert any(line.startswith("      systemctl enable --now tokengate-vllm@8100 ")
               for line in steps)
    assert "  qwen3-8b at 10.0.0.7:8000: a replica on another host; start it there " \
           "(tokengate-vllm@8000)" in steps
    assert not any("tokengate-vllm@8000 " in line or "8000.env" in line for line in steps)
    check = subprocess.run([str(TOKENGATE), "config", "check", str(target)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert (check.returncode, check.stderr) == (0, "")
    assert cfg.edge.listen == "0.0.0.0:80"
    assert (prefix / "etc/systemd/system/tokengate-vllm@.service").is_file()


HOST_MODEL = ("--model", "qwen3-8b", "--model-dir", str(ROOT / "var/models/tiny-qwen3"),
              "--max-model-len", "8192", "--upstream", "127.0.0.1:8100")


def test_a_host_that_runs_its_own_vllm_gets_no_vllm_unit_and_its_redis_and_listen(
        tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    r = install(prefix, *HOST_MODEL, "--no-vllm-unit", "--redis-url",
                "redis://:pw@10.0.0.9:6390/2", "--edge-listen", "127.0.0.1:8089",
                vllm_python=None)
    assert r.returncode == 0, r.stderr
    assert not any("vllm" in line.lower() for line in r.stdout.splitlines()), r.stdout
    assert sorted(f.name for f in (prefix / "etc/systemd/system").glob("*.service")) == \
        sorted([*SIDECARS, CONSOLE, CONSOLE_APPLY[1], BATCH])
    assert not (prefix / "etc/tokengate/vllm").exists()
    cfg = tg_config.load(prefix / "etc/tokengate/tokengate.yaml")
    assert (cfg.redis.url, cfg.edge.listen) == ("redis://:pw@10.0.0.9:6390/2", "127.0.0.1:8089")
    steps = install_plan.next_steps(cfg, vllm_unit=False).splitlines()
    assert "  systemctl enable --now tokengate-counter tokengate-ledger" in steps
    assert not any("tokengate-vllm" in line or "example.env" in line for line in steps)
    # doctor checks the host's own vLLM, then nginx is reloaded, then the optional console
    assert steps[-3].startswith("  tokengate doctor ")
    assert steps[-2] == "  nginx -t && systemctl reload nginx"
    assert steps[-1].startswith("  operator console (optional): systemctl enable --now "
                                "tokengate-console tokengate-console-apply.path, then "
                                "tokengate console passwd ")


def test_a_run_again_keeps_the_first_runs_vllm_unit_choice(tmp_path: Path) -> None:
    # the README says to run install again after each edit, without its options: the
    # host that runs its own vLLM must not get the unit then
    prefix = tmp_path / "root"
    unit = prefix / "etc/systemd/system/tokengate-vllm@.service"
    assert install(prefix, *HOST_MODEL, "--no-vllm-unit", vllm_python=None).returncode == 0
    again = install(prefix, vllm_python=None)
    assert again.returncode == 0, again.stderr
    # the folders are there: their mode and owner are set again, not "created"
    assert f"set {prefix}/etc/tokengate (750 root:www-data)" in again.stdout.splitlines()
    assert not any(line.startswith("create ") for line in again.stdout.splitlines())
    assert not unit.exists() and not (prefix / "etc/tokengate/vllm").exists()
    assert not any("vllm" in line.lower() for line in again.stdout.splitlines()), again.stdout
    # --vllm-python adds it; a run again keeps it; --no-vllm-unit then leaves it, said
    assert install(prefix).returncode == 0
    assert unit.is_file()
    assert install(prefix, vllm_python=None).returncode == 0 and unit.is_file()
    off = install(prefix, "--no-vllm-unit", vllm_python=None)
    assert off.returncode == 0 and unit.is_file()
    assert f"note: {unit}: written by an earlier install and left in place (install " \
           "removes no unit a replica may run from): delete it once no tokengate-vllm@PORT " \
           "runs" in off.stdout.splitlines(), off.stdout


def test_without_the_vllm_interpreter_the_note_names_no_vllm_unit(tmp_path: Path) -> None:
    absent = tmp_path / "vllm/bin/python"
    r = install(tmp_path / "root", *HOST_MODEL, "--dry-run", vllm_python=str(absent))
    assert r.returncode == 0, r.stderr
    assert f"note: {absent}: not found; tokengate-vllm@.service will not start until " \
           "--vllm-python names the interpreter of your vLLM (a host that runs its vLLM " \
           "itself: --no-vllm-unit, and no tokengate-vllm@.service is written)" \
           in r.stdout.splitlines(), r.stdout
    both = install(tmp_path / "root", *HOST_MODEL, "--no-vllm-unit", "--dry-run",
                   vllm_python=str(absent))
    assert both.returncode == 2 and "--no-vllm-unit" in both.stderr


@pytest.mark.parametrize("args,line", [
    (("--redis-url", "http://10.0.0.9:6379"),
     "redis.url: expected a redis://, rediss:// or unix:// URL, got 'http://10.0.0.9:6379'"),
    (("--edge-listen", "port80"), "edge.listen: expected host:port (port 1..65535), got 'port80'"),
], ids=["redis-url", "edge-listen"])
def test_a_bad_redis_url_or_edge_listen_is_refused_by_the_schema(
        tmp_path: Path, args: tuple[str, str], line: str) -> None:
    prefix = tmp_path / "root"
    r = install(prefix, *HOST_MODEL, "--no-vllm-unit", *args, vllm_python=None)
    assert (r.returncode, r.stderr.splitlines()) == \
        (1, [line, "tokengate install: 1 problem(s); nothing changed"])
    assert not prefix.exists()


def test_without_config_install_asks_for_the_model_and_its_upstreams(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    r = install(prefix, "--model", "qwen3-8b", "--dry-run")
    assert (r.returncode, r.stderr.splitlines()) == (1, [
        (f"{prefix}/etc/tokengate/tokengate.yaml does not exist: give --model-dir, "
        "--max-model-len, --upstream (the served model name, its directory, vLLM's "
        "--max-model-len, each vLLM's host:port, --upstream once per replica), or "
        "--config FILE"),
        "tokengate install: 1 problem(s); nothing changed"])
    assert not prefix.exists()


def test_a_model_dir_without_tokenizer_files_fails_config_check_and_install(
        config_path: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    for model_dir, why in ((tmp_path / "no-such-model", ("does not exist (the served "
                            "model's own directory: the files vLLM loads)")),
                           (empty, ("has no tokenizer.json (the counter's tokenizer, from "
                            "the model's own files)"))):
        raw = yaml.safe_load(config_path.read_text())
        raw["models"][MODEL]["dir"] = str(model_dir)
        cfg = tmp_path / f"{model_dir.name}.yaml"
        cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
        line = f"models.{MODEL}.dir: {model_dir} {why}"
        check = subprocess.run([str(TOKENGATE), "config", "check", str(cfg)],
                               capture_output=True, text=True, timeout=120, check=False)
        assert (check.returncode, check.stderr.splitlines()) == \
            (1, [line, f"{cfg}: 1 problem"])
        prefix = tmp_path / f"root-{model_dir.name}"
        for args in (("--config", cfg, "--dry-run"), ("--config", cfg),
                     ("--model", MODEL, "--model-dir", model_dir, "--max-model-len", "8192",
                      "--upstream", "127.0.0.1:8100")):
            r = install(prefix, *args)
            assert (r.returncode, r.stderr.splitlines()) == \
                (1, [line, "tokengate install: 1 problem(s); nothing changed"]), args
            assert not prefix.exists()


def verify(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "verify", *map(str, paths)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_every_unit_passes_systemd_analyze_verify(installed: Installed,
                                                  tmp_path: Path) -> None:
    d = installed.prefix / "etc/systemd/system"
    # a template is verified as an instance; a warning (unknown key, bad value) fails too
    r = verify(*(d / u for u in (*SIDECARS, CONSOLE, *CONSOLE_APPLY, BATCH)),
               d / "tokengate-vllm@8000.service")
    assert (r.returncode, r.stdout + r.stderr) == (0, "")
    # the drop-in for Debian's own nginx.service, loaded next to a copy of that unit
    (tmp_path / "nginx.service.d").mkdir()
    (tmp_path / "nginx.service").write_text(Path("/lib/systemd/system/nginx.service")
                                            .read_text())
    (tmp_path / "nginx.service.d/tokengate.conf").write_text(
        (d / "nginx.service.d/tokengate.conf").read_text())
    r = verify(tmp_path / "nginx.service")
    assert (r.returncode, r.stdout + r.stderr) == (0, "")


def test_the_units_settings_fit_together(installed: Installed) -> None:
    dropin = (installed.prefix / "etc/nginx/conf.d/tokengate.conf").read_text()
    for name in (*SIDECARS, CONSOLE, BATCH):
        u = units.read_unit(installed.unit(name))
        got = {k: u.value("Service", k) for k in (
            "User", "Group", "Restart", "NoNewPrivileges", "ProtectSystem", "ProtectHome",
            "PrivateTmp", "RuntimeDirectory", "RuntimeDirectoryMode",
            "RuntimeDirectoryPreserve")}
        assert got == {"User": "tokengate", "Group": "www-data", "Restart": "on-failure",
                       "NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "ProtectHome": "yes", "PrivateTmp": "yes",
                       "RuntimeDirectory": "tokengate", "RuntimeDirectoryMode": "0750",
                       "RuntimeDirectoryPreserve": "yes"}, name
        # the console reads the file again whenever it changed: nothing to reload; the
        # Batch API reads it at start (a restart resumes every batch where it was)
        assert u.values("Service", "ExecReload") == \
            ([] if name in (CONSOLE, BATCH) else ["/bin/kill -HUP $MAINPID"]), name
    # --workers N of a socket sidecar = the N sockets the drop-in calls: the counter's
    # in init_by_lua's argument (the edge speaks counter frames to them), the limits'
    # as the servers of its upstream
    for name, sock, pattern in (
            ("tokengate-counter.service", "counter.sock", r"unix:\S+/{}\.(\d+)[ \"]"),
            ("tokengate-limits.service", "limits.sock", r"server unix:\S+/{}\.(\d+) ")):
        argv = units.read_unit(installed.unit(name)).value("Service", "ExecStart").split()
        workers = int(argv[argv.index("--workers") + 1])
        servers = re.findall(pattern.format(re.escape(sock)), dropin)
        assert servers == [str(i) for i in range(workers)], name
    tmpfiles = (installed.prefix / "etc/tmpfiles.d/tokengate.conf").read_text()
    assert "d /run/tokengate 0750 tokengate www-data -" in tmpfiles.splitlines()
    vllm = units.read_unit(installed.unit("tokengate-vllm@.service"))
    start = vllm.value("Service", "ExecStart")
    for flag in ("--served-model-name", "--enable-prompt-tokens-details",
                 "--enable-auto-tool-choice", "--tool-call-parser", "--max-model-len",
                 "--port %i"):
        assert flag in start, flag
    assert {k: vllm.value("Service", k) for k in (
        "Restart", "NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp")} == {
        "Restart": "on-failure", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
        "ProtectHome": "yes", "PrivateTmp": "yes"}


def exposure(unit: Path) -> float:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                        str(unit)], capture_output=True, text=True, timeout=60, check=False)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout + r.stderr)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


def test_systemd_rates_the_sidecars_exposure_low(installed: Installed) -> None:
    # 0 (locked down) .. 10 (nothing restricted); 2 and below reads "OK" or "SAFE".
    # vLLM keeps the devices, JIT and system calls CUDA needs.
    d = installed.prefix / "etc/systemd/system"
    got = {u: exposure(d / u) for u in (*SIDECARS, CONSOLE, BATCH,
                                        "tokengate-vllm@8000.service")}
    assert all(got[u] <= 2.0 for u in (*SIDECARS, CONSOLE, BATCH)), got
    assert got["tokengate-vllm@8000.service"] < 5.0, got


# --- the services, from their units' command lines ---------------------------------------

@pytest.fixture
def started(installed: Installed) -> Iterator[list[units.Running]]:
    """Start units with ``started.append(units.start(...))``; stopped after the test."""
    running: list[units.Running] = []
    yield running
    for r in running:
        r.stop()


def listening_tcp_pids() -> set[int]:
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return {int(p) for p in re.findall(r"pid=(\d+)", out)}


def test_the_counter_unit_counts_on_its_unix_sockets_only(
        installed: Installed, started: list[units.Running], counter_addr: str) -> None:
    c = units.start(installed.unit("tokengate-counter.service"), installed.prefix,
                    installed.logs)
    started.append(c)
    socks = [installed.run / f"counter.sock.{i}" for i in range(2)]
    c.wait_for(lambda: all(s.exists() for s in socks), 90, "socket of each worker")
    # what the session's counter (TCP) says for the same body
    with grpc.insecure_channel(counter_addr) as ch:
        want = counter_pb2_grpc.TokenCounterStub(ch).CountTokens(counter_pb2.CountRequest(
            endpoint=counter_pb2.ENDPOINT_CHAT, body=BODY), timeout=30).prompt_tokens
    assert want > 20
    for s in socks:
        assert stat_of(s)[0::2] == ("0o660", "www-data")
        with frames.Client(str(s), timeout_s=30) as fc:
            got = fc.count(counter_pb2.CountRequest(endpoint=counter_pb2.ENDPOINT_CHAT,
                                                    body=BODY))
        assert (got.prompt_tokens, got.max_model_len) == (want, 8192)
    assert not c.group_pids() & listening_tcp_pids(), "the counter unit listens on TCP"


def test_the_limits_unit_serves_health_and_reserve_on_its_unix_sockets(
        installed: Installed, started: list[units.Running]) -> None:
    lim = units.start(installed.unit("tokengate-limits.service"), installed.prefix,
                      installed.logs)
    started.append(lim)
    socks = [installed.run / f"limits.sock.{i}" for i in range(2)]
    lim.wait_for(lambda: all(s.exists() for s in socks), 60, "socket of each worker")
    for i, s in enumerate(socks):
        with grpc.insecure_channel(f"unix:{s}") as ch:
            h = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="tokengate.v1.GlobalLimits"), timeout=10)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            r = limits_pb2_grpc.GlobalLimitsStub(ch).Reserve(limits_pb2.ReserveRequest(
                key_id=f"install-{uuid.uuid4().hex}", model=MODEL, rpm_limit=5,
                tpm_limit=1000, tokens=100, request_id=uuid.uuid4().hex), timeout=10)
        assert (r.admitted, r.remaining_requests, r.remaining_tokens) == (True, 4, 900), i
    assert not lim.group_pids() & listening_tcp_pids(), "the limits unit listens on TCP"


def test_the_ledger_unit_applies_an_event_to_redis(
        installed: Installed, started: list[units.Running], redis_url: str) -> None:
    client = redis.Redis.from_url(ledger_url(redis_url), decode_responses=True)
    client.flushdb()
    usage = installed.prefix / "var/lib/tokengate/usage/usage.jsonl"
    ev = make_event(prompt_tokens=41, completion_tokens=9)
    with open(usage, "a") as f:
        f.write(ev.to_json() + "\n")
    led = units.start(installed.unit("tokengate-ledger.service"), installed.prefix,
                      installed.logs)
    started.append(led)
    status = installed.run / "ledger.status.json"
    led.wait_for(lambda: json.loads(status.read_text())["applied"] == 1, 60,
                 "the event applied (status file)")
    row = client.hgetall(store.usage_key(ev.day, ev.key_id, ev.model))
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == \
        ("1", "41", "9")
    assert json.loads(status.read_text())["redis_up"] is True
    client.close()


def test_the_console_unit_serves_and_an_admin_set_later_logs_in_at_once(
        config_path: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """tokengate-console.service from its command line: the login page says how to set an
    admin, `tokengate console passwd` sets one that logs in with no restart, and the
    request log shows the installed usage file's event."""
    from tests.console.test_console_unit import _login

    base = tmp_path_factory.mktemp("console-unit")
    listen = f"127.0.0.1:{free_port()}"
    raw = yaml.safe_load(test_config(config_path, redis_url, base / "c.yaml").read_text())
    raw["ledger"]["console"] = {"listen": listen, "changes_dir": "/var/lib/tokengate/console"}
    (base / "c.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    prefix = base / "root"
    assert install(prefix, "--config", base / "c.yaml").returncode == 0
    ev = make_event(status=429, error="rate_limit_exceeded")
    (prefix / "var/lib/tokengate/usage/usage.jsonl").write_text(ev.to_json() + "\n")
    con = units.start(prefix / f"etc/systemd/system/{CONSOLE}", prefix, base / "logs")
    try:
        http = httpx.Client(base_url=f"http://{listen}", timeout=30)
        def answers() -> bool:
            try:
                return http.get("/login").status_code == 200
            except httpx.TransportError:
                return False

        con.wait_for(answers, 60, "the login page")
        assert "No admin yet" in http.get("/login").text
        config = prefix / "etc/tokengate/tokengate.yaml"
        r = subprocess.run([str(TOKENGATE), "console", "passwd", "ops", "--password-stdin",
                            "--config", str(config)], input="an installed password\n",
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, r.stderr
        assert stat_of(config) == ("0o640", "root", "www-data")
        login = _login(http, name="ops", pw="an installed password", origin=f"http://{listen}")
        assert login.status_code == 303, login.text
        cookie = login.headers.get_list("set-cookie")[0].split(";")[0]
        log = http.get("/requests?status=refused", headers={"Cookie": cookie})
        assert f'data-request="{ev.request_id}" data-status="429"' in log.text
    finally:
        con.stop()


def cpu_host_env(example: str, **values: str) -> str:
    """``example.env`` as an operator of a CPU host edits it: each of ``values`` set,
    the CPU build's commented ``VLLM_CPU_KVCACHE_SPACE`` line uncommented."""
    out = []
    for line in example.splitlines():
        name = line.partition("=")[0]
        if name in values:
            line = f"{name}={values.pop(name)}"
        elif line.startswith("#VLLM_CPU_KVCACHE_SPACE="):
            line = line[1:]
        out.append(line)
    assert not values, f"example.env has no {sorted(values)}"
    return "\n".join(out) + "\n"


def test_the_vllm_env_example_says_what_a_cpu_host_needs(installed: Installed) -> None:
    # the CPU build stops at start without VLLM_CPU_KVCACHE_SPACE ("Available memory ...
    # less than desired CPU memory utilization"): the example carries the line to enable
    example = (installed.prefix / "etc/tokengate/vllm/example.env").read_text()
    env = cpu_host_env(example, TOKENGATE_VLLM_MODEL="/srv/m",
                       TOKENGATE_VLLM_SERVED_MODEL_NAME="m", TOKENGATE_VLLM_MAX_MODEL_LEN="8")
    assert "VLLM_CPU_KVCACHE_SPACE=1" in env.splitlines()
    assert "# CPU build (vllm-cpu) only: the KV cache's size, GiB. Without it vLLM stops " \
           "at start" in example


@pytest.mark.vllm
@pytest.mark.slow
def test_the_vllm_unit_serves_with_the_flags_billing_needs(
        installed: Installed, started: list[units.Running]) -> None:
    port = free_port()
    env = installed.prefix / f"etc/tokengate/vllm/{port}.env"
    # what the example tells an operator: its three settings, and on a CPU host (the
    # CPU build of the tests) its VLLM_CPU_KVCACHE_SPACE line uncommented
    env.write_text(cpu_host_env(
        (installed.prefix / "etc/tokengate/vllm/example.env").read_text(),
        TOKENGATE_VLLM_MODEL=str((ROOT / "var/models/tiny-qwen3").resolve()),
        TOKENGATE_VLLM_SERVED_MODEL_NAME=MODEL, TOKENGATE_VLLM_MAX_MODEL_LEN="8192")
        # vLLM's own flags, as the example's commented lines show: no torch.compile of
        # the tiny model, the model in the engine core's process (devstack.vllm_service
        # says why: both shorten the start, neither changes a count)
        + "TOKENGATE_VLLM_ARGS=-O0 --distributed-executor-backend uni\n"
        + "VLLM_ENABLE_V1_MULTIPROCESSING=0\n")
    (installed.prefix / "var/cache/tokengate-vllm").mkdir(parents=True, exist_ok=True)
    v = units.start(installed.unit("tokengate-vllm@.service"), installed.prefix,
                    installed.logs, instance=str(port))
    started.append(v)
    base = f"http://127.0.0.1:{port}"
    v.wait_for(lambda: urllib.request.urlopen(f"{base}/health", timeout=2).status == 200,
               400, "/health")
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        models = json.load(r)["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 8192)]
    body = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]}
    req = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        usage = json.load(r)["usage"]
    # tools accepted (the tool parser is on: else 400) and cached tokens reported
    # (--enable-prompt-tokens-details: else prompt_tokens_details is null)
    assert usage["completion_tokens"] <= 4 and usage["prompt_tokens"] > 100
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # the tokengate vLLM plugin (installed in the test venv) records the request in the
    # one folder the unit lets vLLM write
    engine = installed.prefix / f"var/lib/tokengate/engine/{port}.jsonl"
    v.wait_for(lambda: engine.exists() and engine.read_text().endswith("\n"), 30,
               "an engine usage record")
    record = json.loads(engine.read_text().splitlines()[-1])
    assert (record["num_prompt_tokens"], record["num_generation_tokens"]) == \
        (usage["prompt_tokens"], usage["completion_tokens"])


def _dist(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(tree: ast.Module) -> Iterator[tuple[str, bool]]:
    """(top-level module, imported at module level) of every absolute import in
    ``tree`` that no ``except ImportError`` guards."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError",
                                                               "ModuleNotFoundError")
                for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            yield name.split(".")[0], id(node) in top


@pytest.mark.unit
@pytest.mark.parametrize("dist, package", [("sidecars", "tokengate"),
                                           ("client", "tokengate_client"),
                                           ("storm", "tokenstorm")])
def test_each_distribution_declares_every_package_it_imports(dist: str, package: str) -> None:
    # `pip install ./sidecars` then `import tokengate.cli` (or any module): whatever a
    # module imports at its top is a base dependency; what a function imports on demand
    # (matplotlib for tokenstorm's plots, the counter's library for the client's offline
    # counting) is at least in an extra
    project = tomllib.loads((ROOT / dist / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {_dist(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in reqs}

    base = names(project["dependencies"])
    extras = set().union(*map(names, project.get("optional-dependencies", {}).values()))
    providers = importlib.metadata.packages_distributions()
    undeclared = set()
    for f in sorted((ROOT / dist / package).rglob("*.py")):
        if "_pb2" in f.name:
            continue
        for module, at_top in _imports(ast.parse(f.read_text())):
            if module in sys.stdlib_module_names or module == package:
                continue
            dists = {_dist(d) for d in providers.get(module, [module])}
            if not dists & (base if at_top else base | extras):
                undeclared.add((str(f.relative_to(ROOT)), module))
    assert sorted(undeclared) == []


def fresh_venv(venv: Path, project: Path, timeout_s: float) -> Path:
    """A virtualenv made at ``venv`` by the machine's own Python (as an operator's or an
    application's would be, not the dev venv's) with only ``pip install PROJECT`` (its
    dependencies resolved by pip); returns its python. --no-compile: no .pyc of every
    installed module (transformers has thousands); the ones a test imports compile on
    first use, the same install otherwise."""
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-compile", str(project)],
                       capture_output=True, text=True, timeout=timeout_s, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return py


@dataclass
class BaseVenv:
    python: Path
    size_mb: int


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> BaseVenv:
    """A fresh virtualenv with only the runtime (``pip install ./sidecars``, as the README
    tells a GPU host's operator): no vLLM, no torch."""
    venv = tmp_path_factory.mktemp("base") / "venv"
    py = fresh_venv(venv, ROOT / "sidecars", timeout_s=900)
    du = subprocess.run(["du", "-sm", str(venv)], capture_output=True, text=True, check=True)
    return BaseVenv(py, int(du.stdout.split()[0]))


@pytest.mark.slow
def test_the_base_install_needs_no_vllm_or_torch_and_is_consistent(
        base_venv: BaseVenv) -> None:
    def imports(module: str) -> bool:
        return subprocess.run([str(base_venv.python), "-c", f"import {module}"],
                              capture_output=True, timeout=120, check=False).returncode == 0

    assert not imports("torch") and not imports("vllm")
    assert imports("tokengate.counter.server") and imports("tokengate.v1.counter_pb2_grpc")
    assert imports("tokengate.cli") and not imports("tokengate_client")
    check = subprocess.run([str(base_venv.python), "-m", "pip", "check"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert check.returncode == 0, check.stdout
    # the Redis scripts are package data (pyproject's package-data), read at import by the
    # ledger and the limits: the installed package carries each one, byte for byte
    listing = ("import json; from importlib import resources; from tokengate import redis_scripts\n"
               "print(json.dumps({p.name: redis_scripts.read(p.name[:-4]) for p in "
               "resources.files(redis_scripts).iterdir() if p.name.endswith('.lua')}))")
    scripts = subprocess.run([str(base_venv.python), "-c", listing],
                             capture_output=True, text=True, timeout=120, check=False)
    assert scripts.returncode == 0, scripts.stderr
    assert json.loads(scripts.stdout) == {
        p.name: p.read_bytes().decode("utf-8")
        for p in (ROOT / "sidecars/tokengate/redis_scripts").glob("*.lua")}
    print(f"base install: {base_venv.size_mb} MB")


@pytest.mark.slow
def test_the_counter_unit_of_a_base_install_counts_like_the_full_one(
        base_venv: BaseVenv, config_path: Path, redis_url: str, counter_addr: str,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """`tokengate install` run with the base install's own `tokengate`: its counter unit
    starts from that virtualenv and gives the same count as the development one."""
    tmp_path = tmp_path_factory.mktemp("base-install")  # short: the unit's socket paths
    cfg = test_config(config_path, redis_url, tmp_path / "tokengate.yaml")
    prefix = tmp_path / "root"
    r = subprocess.run([str(base_venv.python.parent / "tokengate"), "install", "--prefix",
                        str(prefix), "--source", str(ROOT), "--config", str(cfg),
                        "--vllm-python", sys.executable],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    unit = prefix / "etc/systemd/system/tokengate-counter.service"
    assert units.read_unit(unit).value("Service", "ExecStart").split()[0] == \
        str(base_venv.python.parent / "tokengate-counter")
    with grpc.insecure_channel(counter_addr) as ch:
        want = counter_pb2_grpc.TokenCounterStub(ch).CountTokens(counter_pb2.CountRequest(
            endpoint=counter_pb2.ENDPOINT_CHAT, body=BODY), timeout=30).prompt_tokens
    c = units.start(unit, prefix, tmp_path / "logs")
    try:
        sock = prefix / "run/tokengate/counter.sock.0"
        c.wait_for(sock.exists, 90, "socket of the first worker")
        with frames.Client(str(sock), timeout_s=30) as fc:
            got = fc.count(counter_pb2.CountRequest(endpoint=counter_pb2.ENDPOINT_CHAT,
                                                    body=BODY))
    finally:
        c.stop()
    assert got.prompt_tokens == want
