"""``tokengate install``: put tokengate in a Debian host's places, or under a prefix.

What goes where (every path below ``--prefix``; ``/`` on a host)::

    /usr/share/tokengate/lua/tokengate/**.lua   the edge's Lua modules (mirrored)
    /usr/share/tokengate/nginx/*.in             the nginx templates (tokengate.tools.nginx_conf)
    /etc/nginx/conf.d/tokengate.conf            the drop-in, http level  } rendered for the
    /etc/nginx/snippets/tokengate-location.conf the server-level snippet } prefix and config
    /etc/tokengate/tokengate.yaml               the configuration: written once
                                                (``--config``, else made for the host from
                                                systemd/tokengate.host.yaml.in); a run
                                                again only adds the settings this release
                                                needs that it lacks (``NEEDED``)
    /etc/tokengate/edge.json                    compiled from it on every run
    /etc/tokengate/vllm/example.env             a vLLM replica's settings (tokengate-vllm@PORT)
    /etc/systemd/system/tokengate-counter.service, tokengate-ledger.service,
        tokengate-limits.service, tokengate-console.service, tokengate-vllm@.service,
        tokengate-console-apply.path and .service (root: the key changes the
        operator console queued)
                                                (not the vLLM unit nor example.env with
                                                --no-vllm-unit: the host runs its vLLM)
    /etc/systemd/system/nginx.service.d/tokengate.conf   removes a stale hop socket
    /etc/tmpfiles.d/tokengate.conf              /run/tokengate at every boot
    /var/lib/tokengate/usage/                   usage events: nginx writes, the ledger reads
    /var/lib/tokengate/engine/                  the vLLM plugin's records, one file per replica
    /var/lib/tokengate/console/                 the console's queued key changes
                                                (ledger.console.changes_dir)
    /var/log/tokengate/                         the sampled access log
    /run/tokengate/                             the sidecars' and the hop server's sockets

Owners: the services run as the system user ``tokengate`` (created at ``--prefix /``)
with nginx's workers' group ``www-data``. /run/tokengate is ``tokengate:www-data`` 0750
(only nginx's workers and the units enter it); /var/lib/tokengate/usage and
/var/log/tokengate are ``root:www-data`` 0750 (nginx's root master creates the files, its
workers reopen them, the ledger reads: no tokengate process can alter a usage record);
tokengate.yaml and edge.json are ``root:www-data`` 0640 (the config may hold a Redis
password). Under a prefix where the user ``tokengate`` does not exist, root stands in
for it.

The units name their paths with systemd specifiers (%E = /etc, %t = /run), so they are
the same for every prefix; install only replaces the executables' folders in them
(``/opt/tokengate/bin``: where this ``tokengate`` runs from; ``/opt/vllm/bin/python``:
``--vllm-python``). Everything else is written for the prefix as the root folder, so a
prefix is a working tree that nginx and the sidecars run from as they are (the tests do).

Without ``--config`` the configuration is made for the host, not for ``make run``:
Debian's redis-server (6379; ``--redis-url``), the edge's API on 0.0.0.0:80
(``--edge-listen``: the host's server { } that includes the snippet), the operator's
model and vLLM upstreams (``--model``, ``--model-dir``, ``--max-model-len``,
``--upstream``; asked for when missing), their engine records, and loopback ports of
their own for the status and metrics servers (946x), clear of vLLM's 8000 and the
demo's 8080-8084.

Install never starts, stops, reloads, enables or disables a service (nginx, Redis,
tokengate's own): it prints what to run next.
"""

from __future__ import annotations

import argparse
import grp
import importlib.util
import json
import os
import pwd
import re
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

import tokengate
from tokengate import config as tg_config
from tokengate.tools import compile_config, nginx_conf

USER = "tokengate"
GROUP = "www-data"   # nginx's workers' group on Debian (`user www-data;` in nginx.conf)
UNITS = ("tokengate-counter.service", "tokengate-ledger.service",
         "tokengate-limits.service", "tokengate-console.service", "tokengate-vllm@.service",
         "tokengate-console-apply.path", "tokengate-console-apply.service")
HOST_CONFIG = "tokengate.host.yaml.in"  # in systemd/: the configuration made for a host
TEMPLATES = ("nginx.conf.in", "tokengate-http.conf.in", "tokengate-location.conf.in")
# Where the committed units expect the executables; replaced at install.
UNIT_BIN_DIR = "/opt/tokengate/bin"
UNIT_VLLM_PYTHON = "/opt/vllm/bin/python"
VLLM_UNIT = "tokengate-vllm@.service"
# The configuration made for a host: Debian's redis-server, the edge's API on port 80.
HOST_REDIS_URL = "redis://127.0.0.1:6379/0"
HOST_EDGE_LISTEN = "0.0.0.0:80"
# ProtectHome=yes in every unit: a service sees nothing below these.
HIDDEN = (Path("/home"), Path("/root"), Path("/run/user"))

HELP = """\
Install tokengate on this host (Debian's places) or under --prefix: the systemd units,
the edge's Lua modules and nginx templates, the nginx drop-in and snippet, the
configuration (kept when it exists) and its compiled edge.json, the state folders.

Run it from a checkout (or give --source) with the `tokengate` of the virtualenv the
services will run from, made from a Python outside /home and /root (the units have
ProtectHome=yes; a pyenv Python under /root is hidden from them):

  /usr/bin/python3 -m venv /opt/tokengate && /opt/tokengate/bin/pip install ./sidecars
  sudo /opt/tokengate/bin/tokengate install --vllm-python /opt/vllm/bin/python \\
      --model qwen3-8b --model-dir /srv/models/Qwen3-8B --max-model-len 32768 \\
      --upstream 127.0.0.1:8100

The configuration it writes is made for the host (Debian's Redis on 6379 or
--redis-url, the edge on 0.0.0.0:80 or --edge-listen, the given model and upstreams,
ports clear of vLLM's and the demo's); --config FILE installs another instead. A host
that runs its vLLM itself gives --no-vllm-unit: no tokengate-vllm@.service; a run
again without --vllm-python or --no-vllm-unit keeps the first run's choice.

It never starts, stops, reloads, enables or disables a service (nginx, Redis, the
units); it prints the commands that do. Running it again updates everything but
/etc/tokengate/tokengate.yaml, and recompiles edge.json from it; to a configuration of
an earlier release it adds the settings this release needs (ledger.console.changes_dir),
comments and all else kept, or refuses, naming the file and the key.

EXIT STATUS
  0 installed (or, with --dry-run, nothing wrong found); 1 a problem, one line each
  on stderr, and nothing changed.
"""


class InstallError(Exception):
    """Something that stops the install before any change; ``problems``: one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Options:
    """What ``tokengate install`` was asked to do."""

    prefix: Path                # the root folder of the install (/ on a host)
    source: Path                # a checkout: lua/, nginx/, systemd/, tokengate.yaml
    config: Path | None         # the configuration to install when none is there
    bin_dir: Path               # the folder of tokengate-counter, -ledger, -limits, -console
    vllm_python: Path           # the interpreter of the host's vLLM
    dry_run: bool = False
    # the model of a configuration made for the host (no --config)
    model: str | None = None
    model_dir: Path | None = None
    max_model_len: int | None = None
    upstreams: tuple[str, ...] = ()
    redis_url: str = HOST_REDIS_URL
    edge_listen: str = HOST_EDGE_LISTEN
    # False: the host runs its vLLM itself (no tokengate-vllm@.service, no example.env);
    # True: write them; None (neither --vllm-python nor --no-vllm-unit): as the last
    # install chose, i.e. written when the unit is there already or on a first install
    vllm_unit: bool | None = True

    @property
    def on_host(self) -> bool:
        return self.prefix.resolve() == Path("/")

    def at(self, path: str) -> Path:
        """``path`` (absolute, as on a host) under the prefix."""
        return self.prefix / path.lstrip("/")


@dataclass
class Plan:
    """The changes, in order, each a printed line and what does it."""

    dry_run: bool
    steps: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    next_steps: str = ""   # what the operator does next (printed after an install on a host)

    def add(self, what: str, do: Callable[[], None]) -> None:
        self.steps.append((what, do))

    def run(self) -> None:
        for what, do in self.steps:
            print(("would " if self.dry_run else "") + what, flush=True)
            if not self.dry_run:
                do()


def _ids(user: str, group: str, stand_in: bool) -> tuple[int, int]:
    """uid and gid; with ``stand_in`` root replaces a user that does not exist."""
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        if not stand_in:
            raise
        uid = 0
    return uid, grp.getgrnam(group).gr_gid


def _chown(path: Path, user: str, group: str, stand_in: bool) -> None:
    # Only root may give files away; a non-root prefix install keeps its own ids.
    if os.geteuid() == 0:
        os.chown(path, *_ids(user, group, stand_in))


def _write(path: Path, data: bytes, mode: int, owner: tuple[str, str] | None,
           stand_in: bool) -> None:
    """Write atomically (a rename in the same folder): nginx reloading meanwhile reads
    the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        if owner is not None:
            _chown(Path(tmp), *owner, stand_in)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fix_mode(path: Path, mode: int, owner: tuple[str, str], stand_in: bool) -> None:
    """Set ``path``'s mode and owner (a file kept from an earlier install)."""
    os.chmod(path, mode)
    _chown(path, *owner, stand_in)


def _owner_name(uid: int, gid: int) -> str:
    """``user:group`` of the ids (the numbers where no name exists)."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    try:
        group = grp.getgrgid(gid).gr_name
    except KeyError:
        group = str(gid)
    return f"{user}:{group}"


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True)


def _bind(fn: Callable[..., None], *args: object) -> Callable[[], None]:
    return lambda: fn(*args)


def _dir(path: Path, mode: int, owner: tuple[str, str] | None, stand_in: bool) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chmod(path, mode)
        _chown(path, *owner, stand_in)


# --- the configuration -------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z0-9_./@+-]+")


def _scalar(value: str) -> str:
    return value if _PLAIN.fullmatch(value) else json.dumps(value)


def _get(node: yaml.Node, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value == key:
                return v
    return None


def _is_off(node: yaml.Node) -> bool:
    """A plain false / null / empty scalar: the setting is off (access_log.file: false)."""
    return isinstance(node, yaml.ScalarNode) and node.style is None and \
        node.value.lower() in ("", "~", "null", "false", "no", "off")


def _block(node: yaml.Node) -> bool:
    """A mapping install can edit: block style, with at least one key (its first key's
    column is where a new key goes)."""
    return isinstance(node, yaml.MappingNode) and not node.flow_style and bool(node.value)


def _set(text: str, keys: tuple[str, ...], value: str, mode: str = "set",
         keep_off: bool = False) -> tuple[str, str | None]:
    """``text`` with the setting at ``keys`` (block mappings from the top level down,
    e.g. ``("ledger", "console", "changes_dir")``) given ``value`` (a scalar), every
    comment and all other text kept, and a problem line or None. ``mode``: ``set`` adds
    a missing setting and replaces one that is there, ``replace`` only replaces, ``add``
    only adds. A missing setting goes first in its mapping, with the mappings it needs;
    a missing top-level section at the end of the file. A setting replaced keeps the rest
    of its line, a comment naming the old path naming the new one; ``keep_off`` leaves a
    setting that is off (``false``, null). The problem: a mapping on the way written in
    a form install cannot edit (flow style, empty), or a value that is not a scalar."""
    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        return text, "(top level): expected a mapping of sections"
    dotted = ".".join(keys)
    node: yaml.Node = root
    for depth, key in enumerate(keys):
        child = _get(node, key)
        if child is None:
            if mode == "replace":
                return text, None
            lines = [f"{key}:" for key in keys[depth:]]
            lines[-1] += f" {_scalar(value)}"
            if node is root:
                out = text if text.endswith("\n") or not text else text + "\n"
                return out + "\n" + "".join(f"{'  ' * i}{line}\n"
                                             for i, line in enumerate(lines)), None
            first = node.value[0][0].start_mark
            at = first.index - first.column
            new = "".join(f"{' ' * (first.column + 2 * i)}{line}\n"
                          for i, line in enumerate(lines))
            return text[:at] + new + text[at:], None
        if depth == len(keys) - 1:
            if mode == "add" or (keep_off and _is_off(child)):
                return text, None
            if not isinstance(child, yaml.ScalarNode):
                return text, f"{dotted}: expected a path"
            end = text.find("\n", child.end_mark.index)
            end = len(text) if end < 0 else end
            rest = text[child.end_mark.index:end]
            if "/" in child.value:  # a path, not a word a comment may also use
                rest = rest.replace(child.value, value)
            return text[:child.start_mark.index] + _scalar(value) + rest + text[end:], None
        if not _block(child):
            where = ".".join(keys[:depth + 1])
            return text, (f"{where}: write it as a block mapping (`{key}:` then indented "
                          f"keys) so that install can set {dotted}")
        node = child
    raise AssertionError("unreachable: keys is not empty")


@dataclass(frozen=True)
class Needed:
    """A setting that a release needs in an installed configuration, which a file made
    by an earlier release (or from a ``--config`` file of the operator's) may lack.
    ``tokengate install`` adds it with ``value`` (a path as on a host, moved below
    ``--prefix``) where it is missing, and refuses, naming the file and the key, a file
    where it is off (null, false) or cannot be edited. ``folder``: the value is a
    folder install makes with this mode and owner. The next release that needs a
    setting adds a row to ``NEEDED``."""

    since: str                         # the release from which the units need it
    keys: tuple[str, ...]              # where: ("ledger", "console", "changes_dir")
    value: str                         # on a host (below --prefix under one)
    why: str                           # what fails without it
    folder: tuple[int, tuple[str, str]] | None = None

    @property
    def name(self) -> str:
        return ".".join(self.keys)

    def configured(self, cfg: tg_config.Config) -> Path | None:
        """Its value in ``cfg`` (a path: every row's value is one), None when off."""
        value: Any = cfg
        for key in self.keys:
            value = getattr(value, key)
        return None if value is None else Path(value)


NEEDED = (
    Needed("0.1.0", ("ledger", "console", "changes_dir"), "/var/lib/tokengate/console",
           "the console (tokengate-console) runs as the tokengate user, which can neither "
           "write /etc/tokengate nor signal nginx: it queues each key change there for "
           "root's tokengate-console-apply.path, and without it every change made in the "
           "console fails with Permission denied",
           folder=(0o750, (USER, GROUP))),
)


def add_needed(text: str, root: Path, where: Path) -> tuple[str, list[Needed], list[str]]:
    """``text`` (the configuration ``where``, installed below ``root``) with every
    ``NEEDED`` setting it lacks added, comments and all other text kept; the rows
    added; and one problem line per row it cannot apply (the setting is off, or a
    mapping on its way is written in a form install cannot edit), naming the file and
    the key."""
    added: list[Needed] = []
    problems: list[str] = []
    try:
        yaml.compose(text)
    except yaml.YAMLError:
        return text, added, problems  # not YAML: the loader names the line
    for row in NEEDED:
        value = str(root / row.value.lstrip("/"))
        node: yaml.Node | None = yaml.compose(text)
        for key in row.keys:
            node = _get(node, key) if node is not None else None
        if node is not None and _is_off(node):
            problems.append(f"{where}: {row.name} is {node.value or 'empty'}: set it to "
                            f"{value} (tokengate {row.since} needs it: {row.why})")
            continue
        if node is not None:
            continue
        text, problem = _set(text, row.keys, value, "add")
        if problem is not None:
            problems.append(f"{where}: {problem} (tokengate {row.since} needs it: {row.why})")
        else:
            added.append(row)
    return text, added, problems


def deploy_config_text(text: str, base: Path, paths: dict[str, Path]) -> str:
    """The configuration ``text`` (from a file in ``base``) as installed: the paths the
    drop-in fixes set (ledger.usage_file, edge.usage_file where given, access_log.file
    and global_limits.unix_socket unless off) and relative model dirs made absolute,
    every comment and all other text kept. Raises ``InstallError`` for a section written
    in a form it cannot edit (flow style, empty)."""
    if not isinstance(yaml.compose(text), yaml.MappingNode):
        raise InstallError(["(top level): expected a mapping of sections"])
    problems: list[str] = []
    for keys, value, mode, keep_off in (
            (("ledger", "usage_file"), paths["usage_file"], "set", False),
            (("edge", "usage_file"), paths["usage_file"], "replace", False),
            (("access_log", "file"), paths["access_log"], "set", True),
            (("global_limits", "unix_socket"), paths["limits_socket"], "set", True)):
        text, problem = _set(text, keys, str(value), mode, keep_off)
        if problem is not None:
            problems.append(problem)
    models = _get(yaml.compose(text), "models")
    edits = []
    if isinstance(models, yaml.MappingNode):
        for _name, model in models.value:
            d = _get(model, "dir")
            if isinstance(d, yaml.ScalarNode) and d.value and not Path(d.value).is_absolute():
                edits.append((d.start_mark.index, d.end_mark.index,
                              _scalar(str((base / d.value).resolve()))))
    if problems:
        raise InstallError(problems)
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _header(source: Path) -> str:
    return (f"# Installed by `tokengate install` from {source}: ledger.usage_file,\n"
            "# access_log.file and global_limits.unix_socket set to the Debian drop-in's\n"
            "# paths, relative paths made absolute. Install never overwrites this file;\n"
            "# run it again after editing (it recompiles edge.json), then `nginx -s reload`.\n")


def _check_paths(cfg: tg_config.Config, paths: dict[str, Path], where: Path) -> list[str]:
    """Lines for every path of ``cfg`` that disagrees with the drop-in's."""
    bad = []
    if cfg.edge.usage_file != paths["usage_file"]:
        bad.append(f"{where}: ledger.usage_file (and edge.usage_file) must be "
                   f"{paths['usage_file']}, the file the drop-in's snippet writes; it is "
                   f"{cfg.edge.usage_file}")
    if cfg.access_log.file is not None and cfg.access_log.file != paths["access_log"]:
        bad.append(f"{where}: access_log.file must be {paths['access_log']} (or false), "
                   f"the file the drop-in's snippet writes; it is {cfg.access_log.file}")
    return bad


def _visits(path: Path, depth: int = 0) -> list[Path]:
    """``path`` and every path its resolution passes through: each symbolic link's
    target, in order (a unit under ProtectHome cannot follow a chain through /root even
    when it ends outside it)."""
    out = [Path(os.path.normpath(path.absolute()))]
    parts = out[0].parts
    for i in range(1, len(parts)):
        here = Path(*parts[:i + 1])
        if depth < 40 and here.is_symlink():
            target = Path(os.readlink(here))
            if not target.is_absolute():
                target = here.parent / target
            return out + _visits(target.joinpath(*parts[i + 1:]), depth + 1)
    return out


def _hidden(path: Path) -> bool:
    """True when ``path``, its target or a link on the way lies below ``HIDDEN``."""
    return any(p == h or h in p.parents for p in (*_visits(path), path.resolve())
               for h in HIDDEN)


def _named(path: Path) -> str:
    """``path`` as the operator gave it, then where it resolves to when that differs
    (a link, ``..``): a refusal that named only the target read like another path."""
    target = path.resolve()
    return str(path) if target == path else f"{path} (resolves to {target})"


def script_interpreter(script: Path) -> Path | None:
    """The interpreter a console script runs: its ``#!`` line, or the ``exec`` line of
    pip's ``#!/bin/sh`` wrapper for a long path; None when it names none."""
    try:
        with open(script, "rb") as f:
            head = f.read(4096).decode(errors="replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    first = head[0][2:].strip().split()
    if first and first[0] == "/bin/sh" and len(head) > 1:
        m = re.match(r"""'''exec' "?([^" ]+)"?""", head[1])
        return Path(m.group(1)) if m else None
    return Path(first[0]) if first else None


def interpreter_files(python: Path) -> list[Path]:
    """What a unit must see to start ``python``: the path, where its symbolic links end,
    and for a virtualenv's interpreter the base Python's folder that its pyvenv.cfg
    names (``home``: its standard library, and the binary a link or copy stands for),
    resolved too. A venv's own path says nothing about these: one made from a pyenv
    Python under /root is a link to it."""
    out = [python.absolute(), python.resolve()]
    for cfg in (python.absolute().parent.parent / "pyvenv.cfg",
                python.resolve().parent.parent / "pyvenv.cfg"):
        try:
            lines = cfg.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, sep, value = line.partition("=")
            if sep and key.strip() == "home" and value.strip():
                home = Path(value.strip())
                out += [home, home.resolve()]
    return list(dict.fromkeys(out))


def _unseen_interpreter(what: str, python: Path) -> str | None:
    """A problem line when the units cannot see a file that starting ``python`` needs."""
    for f in interpreter_files(python):
        if _hidden(f):
            # the interpreter itself is named first: then only where its link ends
            needs = f.resolve() if f == python.absolute() else _named(f)
            return (f"{what}: its interpreter {python} needs {needs}, which is below "
                    f"{', '.join(map(str, HIDDEN))}, hidden from the units (ProtectHome=yes): "
                    "make the virtualenv from a Python outside them, e.g. /usr/bin/python3 "
                    "-m venv /opt/tokengate")
    return None


def host_config_text(template: str, model: str, model_dir: Path, max_model_len: int,
                     upstreams: tuple[str, ...], engine_dir: Path,
                     redis_url: str = HOST_REDIS_URL,
                     edge_listen: str = HOST_EDGE_LISTEN) -> str:
    """The configuration made for a host (systemd/tokengate.host.yaml.in filled in): one
    model with its directory, context length and upstreams, the engine record file of
    each loopback upstream (``tokengate-vllm@PORT`` writes ``engine_dir``/PORT.jsonl,
    /var/lib/tokengate/engine on a host), ``redis.url`` and ``edge.listen``; the schema
    checks the values."""
    engine = [_scalar(str(engine_dir / f"{u.rpartition(':')[2]}.jsonl")) for u in upstreams
              if tg_config._is_loopback(u)]
    return (template.replace("@MODEL@", _scalar(model))
            .replace("@MODEL_DIR@", _scalar(str(model_dir.absolute())))
            .replace("@MAX_MODEL_LEN@", str(max_model_len))
            .replace("@REDIS_URL@", _scalar(redis_url))
            .replace("@EDGE_LISTEN@", _scalar(edge_listen))
            .replace("@UPSTREAMS@", "\n".join(f"      - {_scalar(u)}" for u in upstreams))
            .replace("@ENGINE_FILES@", "".join(f"\n    - {e}" for e in engine) or " []"))


# --- the plan ----------------------------------------------------------------------------

def default_vllm_python() -> Path:
    """This interpreter when it can import vllm, else ``/opt/vllm/bin/python``."""
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    return Path(UNIT_VLLM_PYTHON)


def plan(opts: Options) -> Plan:
    """Check everything and list the changes; raises ``InstallError`` (nothing changed)."""
    problems: list[str] = []
    warnings: list[str] = []
    src = opts.source.resolve()
    lua_src = src / "lua" / "tokengate"
    tpl_src = src / "nginx"
    unit_src = src / "systemd"
    for need in (lua_src, *(tpl_src / t for t in TEMPLATES), *(unit_src / u for u in UNITS),
                 unit_src / HOST_CONFIG):
        if not need.exists():
            problems.append(f"{need}: missing (run install from a tokengate checkout, "
                            f"or give --source)")
    for exe in ("tokengate-counter", "tokengate-ledger", "tokengate-limits",
                "tokengate-console"):
        if not os.access(opts.bin_dir / exe, os.X_OK):
            problems.append(f"{opts.bin_dir / exe}: not found (--bin-dir: the bin folder of "
                            "the virtualenv the services run from)")
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        problems.append(f"group {GROUP} does not exist (nginx's workers' group on Debian)")
    if problems:
        raise InstallError(problems)

    paths = nginx_conf.debian_paths(opts.prefix.resolve())
    target = opts.at("/etc/tokengate/tokengate.yaml")
    unit_path = opts.at(f"/etc/systemd/system/{VLLM_UNIT}")
    if opts.vllm_unit is None:
        # a run again keeps the first one's choice (the deploy docs say to run install
        # again after each edit, without repeating its options)
        opts = replace(opts, vllm_unit=not target.exists() or unit_path.exists())
    elif not opts.vllm_unit and unit_path.exists():
        warnings.append(f"{unit_path}: written by an earlier install and left in place "
                        "(install removes no unit a replica may run from): delete it once "
                        "no tokengate-vllm@PORT runs")
    kept: str | None = None   # the existing configuration with what this release needs
    added: list[Needed] = []
    try:
        if target.exists():
            kept, added, needs = add_needed(tg_config.read_text(target), opts.prefix, target)
            problems += needs
            cfg = tg_config.loads(kept, target.resolve())
            config_text = None
        elif opts.config is not None:
            source_config = opts.config.resolve()
            tg_config.load(source_config)  # the source itself is valid (duplicate keys too)
            config_text, _, needs = add_needed(_header(source_config) + deploy_config_text(
                tg_config.read_text(source_config), source_config.parent, paths),
                opts.prefix, target)
            problems += needs
            cfg = tg_config.loads(config_text, target)
        else:
            asked = [flag for flag, given in (
                ("--model", opts.model), ("--model-dir", opts.model_dir),
                ("--max-model-len", opts.max_model_len), ("--upstream", opts.upstreams))
                if not given]
            if asked:
                why = (f"{target} does not exist: give {', '.join(asked)} (the served model "
                       "name, its directory, vLLM's --max-model-len, each vLLM's host:port, "
                       "--upstream once per replica), or --config FILE")
                raise InstallError([why])
            assert opts.model and opts.model_dir and opts.max_model_len
            template = unit_src / HOST_CONFIG
            config_text = _header(template) + deploy_config_text(host_config_text(
                template.read_text(), opts.model, opts.model_dir, opts.max_model_len,
                opts.upstreams, opts.at("/var/lib/tokengate/engine"), opts.redis_url,
                opts.edge_listen), template.parent, paths)
            cfg = tg_config.loads(config_text, target)
        compile_config.compile_config(cfg)  # resolves upstreams, reads tokenizer files
    except tg_config.ConfigError as e:
        raise InstallError(e.errors) from None
    except OSError as e:
        raise InstallError([str(e)]) from None
    problems += _check_paths(cfg, paths, target)

    vllm_python = [("--vllm-python", opts.vllm_python)] if opts.vllm_unit else []
    hidden = [("--bin-dir", opts.bin_dir), ("the tokengate package",
                                            Path(tokengate.__file__).parent),
              *vllm_python,
              *((f"models.{n}.dir", m.dir) for n, m in cfg.models.items())]
    for what, path in hidden:
        if _hidden(path):
            line = (f"{what} {_named(path)} is below {', '.join(map(str, HIDDEN))}, which "
                    "the units hide (ProtectHome=yes): use a virtualenv or folder such as "
                    "/opt/tokengate")
            (problems if opts.on_host else warnings).append(line)
    for what, python in (("--bin-dir", script_interpreter(opts.bin_dir / "tokengate-counter")),
                         *vllm_python):
        if python is None or any(what == w and _hidden(p) for w, p in hidden):
            continue  # no interpreter named, or its path itself was refused above
        unseen = _unseen_interpreter(what, python)
        if unseen is not None:
            (problems if opts.on_host else warnings).append(unseen)
    if opts.vllm_unit and not opts.vllm_python.exists():
        warnings.append(f"{opts.vllm_python}: not found; {VLLM_UNIT} will not start until "
                        "--vllm-python names the interpreter of your vLLM (a host that runs "
                        f"its vLLM itself: --no-vllm-unit, and no {VLLM_UNIT} is written)")
    if problems:
        raise InstallError(problems)

    try:
        pwd.getpwnam(USER)
        user_exists = True
    except KeyError:
        user_exists = False
    stand_in = not opts.on_host
    todo = Plan(opts.dry_run, next_steps=next_steps(cfg, vllm_unit=bool(opts.vllm_unit)))
    todo.notes += warnings
    if not user_exists:
        if opts.on_host:
            argv = ["useradd", "--system", "--gid", GROUP, "--home-dir", "/var/lib/tokengate",
                    "--no-create-home", "--shell", "/usr/sbin/nologin",
                    "--comment", "tokengate sidecars", USER]
            todo.add(f"create the system user {USER} (group {GROUP}): {' '.join(argv)}",
                     lambda: _run(argv))
        else:
            todo.notes.append(f"user {USER} does not exist here: root owns what it would own "
                              "under this prefix")

    share = opts.at("/usr/share/tokengate")
    root_owned = ("root", "root")
    for path, mode, owner in (
            (opts.at("/etc/tokengate"), 0o750, ("root", GROUP)),
            *(((opts.at("/etc/tokengate/vllm"), 0o750, ("root", GROUP)),)
              if opts.vllm_unit else ()),
            (opts.at("/var/lib/tokengate"), 0o750, (USER, GROUP)),
            # the folders of NEEDED settings, where the configuration puts them
            *((folder, *row.folder) for row in NEEDED
              if row.folder is not None and (folder := row.configured(cfg)) is not None),
            (opts.at("/var/lib/tokengate/usage"), 0o750, ("root", GROUP)),
            # the vLLM plugin's engine records (tokengate-vllm@.service writes, the ledger reads)
            (opts.at("/var/lib/tokengate/engine"), 0o750, (USER, GROUP)),
            (opts.at("/var/log/tokengate"), 0o750, ("root", GROUP)),
            # what tmpfiles.d makes at boot; made now so that nginx can reload at once
            (opts.at("/run/tokengate"), 0o750, (USER, GROUP)),
            (share, 0o755, root_owned), (share / "lua" / "tokengate", 0o755, root_owned),
            (share / "nginx", 0o755, root_owned)):
        # a run again finds them: their mode and owner are set again
        todo.add(f"{'set' if path.is_dir() else 'create'} {path} ({mode:o} "
                 f"{owner[0]}:{owner[1]})", _bind(_dir, path, mode, owner, stand_in))

    lua_dst = share / "lua" / "tokengate"
    # the modules by their path below tokengate/ (stages/read.lua, apis/chat.lua, ...)
    sources = sorted(q.relative_to(lua_src) for q in lua_src.rglob("*.lua"))
    stale = sorted({q.relative_to(lua_dst) for q in lua_dst.rglob("*.lua")} - set(sources))

    def copy_lua() -> None:
        for name in sources:
            _write(lua_dst / name, (lua_src / name).read_bytes(), 0o644, None, stand_in)
        for name in stale:
            (lua_dst / name).unlink()
    todo.add(f"copy {len(sources)} Lua modules to {lua_dst}"
          + (f", remove {', '.join(map(str, stale))}" if stale else ""), copy_lua)

    def file(dst: Path, data: bytes, mode: int = 0o644,
             owner: tuple[str, str] | None = None) -> None:
        todo.add(f"write {dst}", lambda: _write(dst, data, mode, owner, stand_in))

    for t in TEMPLATES:
        file(share / "nginx" / t, (tpl_src / t).read_bytes())
    for u in UNITS:
        if u == VLLM_UNIT and not opts.vllm_unit:
            continue
        text = (unit_src / u).read_text()
        text = text.replace(UNIT_BIN_DIR + "/", f"{opts.bin_dir.absolute()}/")
        text = text.replace(UNIT_VLLM_PYTHON, str(opts.vllm_python.absolute()))
        file(opts.at(f"/etc/systemd/system/{u}"), text.encode())
    file(opts.at("/etc/systemd/system/nginx.service.d/tokengate.conf"),
         (unit_src / "nginx.service.d" / "tokengate.conf").read_bytes())
    file(opts.at("/etc/tmpfiles.d/tokengate.conf"), (unit_src / "tokengate.tmpfiles").read_bytes())
    example = opts.at("/etc/tokengate/vllm/example.env")
    if opts.vllm_unit and not example.exists():
        file(example, vllm_env_text((unit_src / "vllm.env.example").read_text(),
                                    cfg).encode())

    if added:
        assert kept is not None
        # an earlier release's file: what this one needs added, the rest as it was
        todo.add("add " + ", ".join(f"{row.name} ({row.since} needs it)" for row in added)
                 + f" to {target}, 640 root:{GROUP}",
                 _bind(_write, target, kept.encode(), 0o640, ("root", GROUP), stand_in))
    elif config_text is None:
        # What an earlier release or an edit left (a `keys create` of 0.1.0 re-owned it
        # root:root 0600, and every unit then failed at start with Permission denied):
        # the services read it as tokengate:www-data, so its owner and mode are set again.
        have = target.stat()
        repair = oct(have.st_mode & 0o777) != "0o640" or (
            os.geteuid() == 0 and (have.st_uid, have.st_gid) != _ids("root", GROUP, stand_in))
        todo.add(f"keep {target} (it exists)" + (
            f"; set 640 root:{GROUP} again (it was {have.st_mode & 0o777:o} "
            f"{_owner_name(have.st_uid, have.st_gid)}: the units could not read it)"
            if repair else ""), _bind(_fix_mode, target, 0o640, ("root", GROUP), stand_in))
    else:
        file(target, config_text.encode(), 0o640, ("root", GROUP))
        made = opts.config or f"{unit_src / HOST_CONFIG}, for this host"
        todo.notes.append(f"{target}: from {made}; check redis.url and the ports, create "
                          "keys with `tokengate keys create`")
    edge_json = paths["edge_json"]

    def compile_edge() -> None:
        compile_config.write(target, edge_json)
        os.chmod(edge_json, 0o640)
        _chown(edge_json, "root", GROUP, stand_in)
    todo.add(f"compile {edge_json} from {target}", compile_edge)

    templates = tpl_src
    file(opts.at("/etc/nginx/conf.d/tokengate.conf"),
         nginx_conf.render_debian(templates, paths, cfg.edge).encode())
    file(opts.at("/etc/nginx/snippets/tokengate-location.conf"),
         nginx_conf.render_debian_location(templates, paths, cfg.edge,
                                           cfg.access_log.file is not None).encode())
    if not opts.at("/etc/nginx/nginx.conf").exists():
        todo.notes.append(f"{opts.at('/etc/nginx/nginx.conf')}: not found; install nginx "
                       "(apt install nginx libnginx-mod-http-lua libnginx-mod-http-ndk "
                       "lua-resty-core lua-resty-lrucache lua-cjson lua-nginx-dns)")
    if opts.on_host and Path("/run/systemd/system").is_dir():
        todo.add("reload systemd's unit files (systemctl daemon-reload; no service is "
                 "started or stopped)",
                 lambda: _run(["systemctl", "daemon-reload"]))
    return todo


def vllm_env_text(example: str, cfg: tg_config.Config) -> str:
    """``systemd/vllm.env.example`` with the first configured model's settings: its
    directory, served name and ``max_model_len`` (tokens) in the three
    ``TOKENGATE_VLLM_*`` lines, so a copy serves what ``tokengate.yaml`` expects."""
    if not cfg.models:
        return example
    name, model = next(iter(cfg.models.items()))
    values = {"TOKENGATE_VLLM_MODEL": str(model.dir),
              "TOKENGATE_VLLM_SERVED_MODEL_NAME": name,
              "TOKENGATE_VLLM_MAX_MODEL_LEN": str(model.max_model_len)}
    lines = []
    for line in example.splitlines():
        key = line.partition("=")[0]
        lines.append(f"{key}={values[key]}" if key in values else line)
    return "\n".join(lines) + "\n"


def next_steps(cfg: tg_config.Config, vllm_unit: bool = True) -> str:
    """What is left after an install, for this configuration: one ``tokengate-vllm@PORT``
    per loopback upstream (a replica on another host is started there; none without
    ``vllm_unit``: the host runs its vLLM itself, and ``tokengate doctor`` checks it),
    ``tokengate-limits`` only with ``global_limits.enabled``."""
    sidecars = "tokengate-counter tokengate-ledger"
    if cfg.global_limits.enabled:
        sidecars += " tokengate-limits"
    lines = ["Next (install changed no running service):",
             "  edit /etc/tokengate/tokengate.yaml, then run tokengate install again (edge.json)",
             "  add `include snippets/tokengate-location.conf;` to a server { } block of nginx",
             f"  systemctl enable --now {sidecars}"]
    if not vllm_unit:
        lines.append("  tokengate doctor   (once the host's own vLLM serves: it checks the "
                     "flags and the tokengate plugin that billing needs)")
    for name, model in cfg.models.items():
        for upstream in model.upstreams if vllm_unit else []:
            port = upstream.rpartition(":")[2]
            if not tg_config._is_loopback(upstream):
                lines.append(f"  {name} at {upstream}: a replica on another host; start it "
                             f"there (tokengate-vllm@{port})")
                continue
            lines.append(f"  {name} at {upstream}: cp /etc/tokengate/vllm/example.env "
                         f"/etc/tokengate/vllm/{port}.env, check it, then")
            lines.append(f"      systemctl enable --now tokengate-vllm@{port}   (skip this "
                         "if the host's own vLLM serves that port: give it the unit's "
                         "flags and the plugin)")
    lines.append("  nginx -t && systemctl reload nginx")
    lines.append("  operator console (optional): systemctl enable --now tokengate-console "
                 "tokengate-console-apply.path, then tokengate console passwd NAME; it "
                 f"serves http://{cfg.ledger.console.listen}/")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``install`` on a ``tokengate`` subcommand parser."""
    p = sub.add_parser("install", help="install units, Lua, the nginx drop-in and the config",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=Path, default=Path("/"),
                   help="root folder of the install (default: /); every file is written "
                        "for it as the root")
    p.add_argument("--dry-run", action="store_true",
                   help="check and print what would be done; change nothing")
    p.add_argument("--source", type=Path, default=Path("."),
                   help="the checkout holding lua/, nginx/ and systemd/ (default: .)")
    p.add_argument("--config", type=Path, default=None,
                   help="configuration to install when <prefix>/etc/tokengate/tokengate.yaml "
                        "does not exist (default: one made for this host from --model, "
                        "--model-dir, --max-model-len and --upstream)")
    p.add_argument("--model", default=None,
                   help="without --config: the served model name (vLLM's "
                        "--served-model-name, what clients send as model)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="without --config: the model's directory, the files vLLM loads "
                        "(outside /home and /root)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="without --config: the model's context, vLLM's --max-model-len, "
                        "tokens")
    p.add_argument("--upstream", action="append", default=[], metavar="HOST:PORT",
                   help="without --config: a vLLM OpenAI server of the model (repeat for "
                        "each replica)")
    p.add_argument("--bin-dir", type=Path, default=Path(sysconfig.get_path("scripts")),
                   help="folder of tokengate-counter, -ledger, -limits, -console that the "
                        "units run (default: this tokengate's, %(default)s)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="without --config: redis.url of the configuration made for the "
                        f"host (default: Debian's redis-server, {HOST_REDIS_URL})")
    p.add_argument("--edge-listen", default=None, metavar="HOST:PORT",
                   help="without --config: edge.listen of the configuration made for the "
                        "host, the listen of the server { } that includes the snippet "
                        f"(default: {HOST_EDGE_LISTEN})")
    vllm = p.add_mutually_exclusive_group()
    vllm.add_argument("--vllm-python", type=Path, default=None,
                      help=f"the Python of the host's vLLM, for {VLLM_UNIT} (default: this "
                           f"one when it imports vllm, else {UNIT_VLLM_PYTHON})")
    vllm.add_argument("--no-vllm-unit", action="store_true",
                      help=f"the host runs its vLLM itself: {VLLM_UNIT} and "
                           "/etc/tokengate/vllm/example.env are not written")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """``tokengate install``: 0 done, 1 a problem (nothing changed)."""
    opts = Options(prefix=args.prefix, source=args.source, config=args.config,
                   bin_dir=args.bin_dir, vllm_python=args.vllm_python or default_vllm_python(),
                   dry_run=args.dry_run, model=args.model, model_dir=args.model_dir,
                   max_model_len=args.max_model_len, upstreams=tuple(args.upstream),
                   redis_url=args.redis_url or HOST_REDIS_URL,
                   edge_listen=args.edge_listen or HOST_EDGE_LISTEN,
                   vllm_unit=(False if args.no_vllm_unit
                              else True if args.vllm_python is not None else None))
    try:
        todo = plan(opts)
    except InstallError as e:
        for line in e.problems:
            print(line, file=sys.stderr)
        print(f"tokengate install: {len(e.problems)} problem(s); nothing changed",
              file=sys.stderr)
        return 1
    todo.run()
    for note in todo.notes:
        print(f"note: {note}")
    if opts.on_host and not opts.dry_run:
        print(todo.next_steps)
    return 0
