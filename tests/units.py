"""The units of systemd/ run the way systemd would run them, without systemd (it is not
PID 1 on a test machine): a unit file read as systemd reads it, ``ExecStart=`` turned
into an argv with the install prefix's specifiers (%E, %t, ...) and the unit's
``Environment=`` / ``EnvironmentFile=``, started in ``/`` with systemd's environment.

Specifiers are systemd.unit(5)'s for a system unit, with the prefix in front: %E =
<prefix>/etc, %t = <prefix>/run, %S = <prefix>/var/lib, %C = <prefix>/var/cache,
%L = <prefix>/var/log; %i / %I = the instance.

``PrivateNetwork=yes`` is kept, as systemd.exec(5) sets it up: the service runs in a
network namespace of its own whose only device is the loopback, up (``unshare --net``):
it reaches no address of the host's, and nothing of the host's reaches its ports, while
unix sockets (paths) still connect.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# systemd's PATH for system services (systemd 252)
SYSTEMD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class Unit:
    """A unit file: every ``key=value`` of each section, in order (keys repeat)."""

    path: Path
    sections: dict[str, list[tuple[str, str]]]

    def values(self, section: str, key: str) -> list[str]:
        return [v for k, v in self.sections.get(section, []) if k == key]

    def value(self, section: str, key: str) -> str:
        """The last assignment of ``key`` (systemd's rule for single-valued settings)."""
        found = self.values(section, key)
        assert found, f"{self.path.name}: no {key}= in [{section}]"
        return found[-1]


def read_unit(path: Path) -> Unit:
    """Parse ``path`` as systemd does: comments (# ;), [Section] headers, lines continued
    with a trailing backslash."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = (pending + " " + raw.strip()) if pending else raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path}: cannot read {raw!r}"
        current.append((key.strip(), value.strip()))
    return Unit(path, sections)


def specifiers(prefix: Path, instance: str = "") -> dict[str, str]:
    """The specifiers of a system unit installed under ``prefix``."""
    return {"%E": str(prefix / "etc"), "%t": str(prefix / "run"),
            "%S": str(prefix / "var/lib"), "%C": str(prefix / "var/cache"),
            "%L": str(prefix / "var/log"), "%i": instance, "%I": instance, "%%": "%"}


def expand(text: str, spec: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        assert m.group(0) in spec, f"specifier {m.group(0)} is not handled here"
        return spec[m.group(0)]
    return re.sub(r"%.", one, text)


def _env_assignments(text: str) -> dict[str, str]:
    out = {}
    for word in shlex.split(text):
        key, sep, value = word.partition("=")
        assert sep, f"not an assignment: {word!r}"
        out[key] = value
    return out


def environment(unit: Unit, spec: dict[str, str]) -> dict[str, str]:
    """``Environment=`` then ``EnvironmentFile=`` (which wins, as in systemd; a leading
    ``-`` makes a missing file fine)."""
    env: dict[str, str] = {}
    for line in unit.values("Service", "Environment"):
        env.update(_env_assignments(expand(line, spec)))
    for name in unit.values("Service", "EnvironmentFile"):
        optional = name.startswith("-")
        path = Path(expand(name.lstrip("-"), spec))
        if not path.exists() and optional:
            continue
        for raw in path.read_text().splitlines():
            line = raw.strip()
            if line and line[0] not in "#;":
                # a file's line is one assignment, its value the rest of the line
                # (spaces kept; one pair of enclosing quotes removed), unlike Environment=
                key, sep, value = line.partition("=")
                assert sep, f"{path}: not an assignment: {raw!r}"
                value = value.strip()
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                env[key.strip()] = value
    return env


def exec_start(unit: Unit, spec: dict[str, str], env: dict[str, str]) -> list[str]:
    """``ExecStart=`` as an argv (see ``command``)."""
    return command(unit, "ExecStart", spec, env)


def command(unit: Unit, setting: str, spec: dict[str, str], env: dict[str, str]) -> list[str]:
    """``setting`` (ExecStart, ExecStartPre, ...) as an argv: its prefixes (``-`` ...)
    dropped, specifiers, then ``${VAR}`` (one word) and a whole word ``$VAR`` (split at
    whitespace, no word when empty), as systemd.service(5)."""
    line = expand(unit.value("Service", setting).lstrip("-@+!:"), spec)
    argv: list[str] = []
    for word in shlex.split(line):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if m:
            argv += env.get(m.group(1), "").split()
            continue
        argv.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}",
                           lambda m: env.get(m.group(1), ""), word))
    return argv


@dataclass
class Running:
    """A unit's ExecStart running as a child process (its own process group)."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_for(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n"
                                     + self.log_tail())
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{self.name}: no {what} after {timeout_s:.0f} s:\n"
                             + self.log_tail())

    def group_pids(self) -> set[int]:
        """Every process of its process group (the workers too)."""
        out = set()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid:  # field 5: pgrp
                out.add(int(stat.parent.name))
        return out

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def start(unit_path: Path, prefix: Path, log_dir: Path, instance: str = "",
          run_as_group: bool = True, user: str | None = None) -> Running:
    """Run the unit's ExecStart with its environment and UMask=, in ``/``, as systemd
    would, except for the user: the unit's ``Group=`` is applied, ``User=``
    is not (root stays root: the checkout's virtualenv lives under /root, which no
    other user may enter, and the unit's ``tokengate`` user need not exist here);
    ``user``: run as that user instead (with the unit's group only), for a unit whose
    executables that user can run."""
    unit = read_unit(unit_path)
    spec = specifiers(prefix, instance)
    unit_env = environment(unit, spec)
    argv = exec_start(unit, spec, unit_env)
    env = {"PATH": SYSTEMD_PATH, "LANG": "C.UTF-8", "HOME": str(prefix / "var/lib/tokengate"),
           **unit_env}
    if "PYTHONPATH" in os.environ:
        # the code under test, when the test run points Python at it
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    runtime = unit.values("Service", "RuntimeDirectory")
    if runtime:
        env["RUNTIME_DIRECTORY"] = str(prefix / "run" / runtime[-1])
    groups = unit.values("Service", "Group")
    if run_as_group and groups:
        gid = grp.getgrnam(groups[-1]).gr_gid
        who = [f"--reuid={pwd.getpwnam(user).pw_uid}"] if user is not None else []
        argv = ["setpriv", *who, f"--regid={gid}", "--clear-groups", "--", *argv]
    if unit.values("Service", "PrivateNetwork")[-1:] == ["yes"]:
        argv = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
                *argv]
    umask = int(unit.values("Service", "UMask")[-1], 8) \
        if unit.values("Service", "UMask") else 0o022
    log_dir.mkdir(parents=True, exist_ok=True)
    name = unit_path.name.replace("@.", f"@{instance}.")
    log = log_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd="/", env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, umask=umask)
    return Running(name, argv, proc, log)
