"""The Debian host that ``tokengate install`` writes to: the user and group the services
run as, the units and templates it installs, the executables' folders the committed units
name, the folders the units cannot see (``ProtectHome=yes``) and whether a path or an
interpreter lies below them; and the error that stops an install before any change."""

from __future__ import annotations

import os
import re
from pathlib import Path

USER = "tokengate"
GROUP = "www-data"   # nginx's workers' group on Debian (`user www-data;` in nginx.conf)
UNITS = ("tokengate-counter.service", "tokengate-ledger.service",
         "tokengate-limits.service", "tokengate-console.service", "tokengate-vllm@.service",
         "tokengate-console-apply.path", "tokengate-console-apply.service",
         "tokengate-batch.service")
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


class InstallError(Exception):
    """Something that stops the install before any change; ``problems``: one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


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


def hidden(path: Path) -> bool:
    """True when ``path``, its target or a link on the way lies below ``HIDDEN``."""
    return any(p == h or h in p.parents for p in (*_visits(path), path.resolve())
               for h in HIDDEN)


def named(path: Path) -> str:
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


def unseen_interpreter(what: str, python: Path) -> str | None:
    """A problem line when the units cannot see a file that starting ``python`` needs."""
    for f in interpreter_files(python):
        if hidden(f):
            # the interpreter itself is named first: then only where its link ends
            needs = f.resolve() if f == python.absolute() else named(f)
            return (f"{what}: its interpreter {python} needs {needs}, which is below "
                    f"{', '.join(map(str, HIDDEN))}, hidden from the units (ProtectHome=yes): "
                    "make the virtualenv from a Python outside them, e.g. /usr/bin/python3 "
                    "-m venv /opt/tokengate")
    return None
