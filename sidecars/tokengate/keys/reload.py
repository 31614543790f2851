"""Applying an edited configuration to its running edges, without a restart: the edge's
compiled ``edge.json`` is written again (atomically, keeping its owner, group and mode,
like the YAML file) and its nginx master gets SIGHUP (what ``nginx -s reload`` sends).
``reload_edge`` returns once the master runs new workers and the old ones are shutting
down (their listening sockets closed; streams in flight on them continue): from then on
a created key is admitted and a revoked one refused.

The edges of a file (``find_edges``): the file's own running edge (``edge_of``: an
installed file's, or ``make run``'s beside any other file), or each ``--edge`` folder;
never both, so a command acts on one deployment.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tokengate import config as tg_config
from tokengate.tools import nginx_conf

RELOAD_TIMEOUT_S = 10.0
NGINX_PID = Path("/run/nginx.pid")  # Debian's nginx.conf: `pid /run/nginx.pid;`


@dataclass(frozen=True)
class EdgeTarget:
    """A running edge: its compiled configuration and its nginx master's pid file."""

    edge_json: Path
    pid_file: Path


def installed_root(config_path: Path) -> Path | None:
    """The root folder of the install whose configuration ``config_path`` is
    (``<root>/etc/tokengate/tokengate.yaml``: ``/`` on a host, the prefix of ``tokengate
    install --prefix``), or None for any other file (a checkout's, ``make run``'s)."""
    p = config_path.resolve()
    if p.name == "tokengate.yaml" and p.parent.name == "tokengate" \
            and p.parent.parent.name == "etc":
        return p.parents[2]
    return None


def edge_of(config_path: Path) -> EdgeTarget:
    """The one edge a configuration file belongs to: an install's (``<root>/etc/
    tokengate/edge.json``, Debian nginx's ``<root>/run/nginx.pid``) for an installed
    file, else ``make run``'s (``var/run/nginx`` beside the file)."""
    root = installed_root(config_path)
    if root is not None:
        return EdgeTarget(nginx_conf.debian_paths(root)["edge_json"],
                          root / NGINX_PID.relative_to("/"))
    d = config_path.resolve().parent / "var" / "run" / "nginx"
    return EdgeTarget(d / "edge.json", d / "nginx.pid")


def find_edges(config_path: Path, dirs: list[Path]) -> list[EdgeTarget]:
    """The edges to reload: ``dirs`` (each with edge.json and nginx.pid), else the
    configuration's own edge (``edge_of``) when its pid file and edge.json exist. One
    deployment: a checkout's file never reaches an installed edge, nor the reverse."""
    if dirs:
        return [EdgeTarget(d / "edge.json", d / "nginx.pid") for d in dirs]
    own = edge_of(config_path)
    return [own] if own.pid_file.exists() and own.edge_json.exists() else []


def _workers(master: int) -> dict[int, str]:
    """The master's children: pid -> process title ("nginx: worker process", "nginx:
    worker process is shutting down", ...)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == master:
                out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ") \
                    .decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
    return out


def reload_edge(target: EdgeTarget, cfg: tg_config.Config,
                timeout_s: float = RELOAD_TIMEOUT_S) -> None:
    """Compile ``cfg`` into the edge's edge.json, SIGHUP its master and wait until new
    workers serve and every old one is shutting down. Raises ``RuntimeError`` when the
    master is gone or did not reload in time (its error log says why)."""
    from tokengate.tools import compile_config

    try:
        master = int(target.pid_file.read_text().strip())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{target.pid_file}: no nginx master: {e}") from e
    compile_config.write(cfg.path, target.edge_json)
    old = {pid for pid, title in _workers(master).items() if "worker process" in title}
    try:
        os.kill(master, signal.SIGHUP)
    except OSError as e:
        raise RuntimeError(f"nginx master {master} ({target.pid_file}): {e}") from e
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _workers(master)
        fresh = [p for p, t in now.items() if p not in old and t.endswith("worker process")]
        still = [p for p in old if p in now and not now[p].endswith("shutting down")]
        if fresh and not still:
            return
        time.sleep(0.02)
    raise RuntimeError(f"nginx master {master} ({target.pid_file}) did not reload within "
                       f"{timeout_s:.0f} s: see its error log")


def apply_to(cfg: tg_config.Config, dirs: list[Path]) -> list[tuple[EdgeTarget, str | None]]:
    """Reload every edge of ``cfg``'s file (``find_edges(cfg.path, dirs)``) with it:
    (edge, None) for each one reloaded, (edge, why not) for each one that was not. No
    edge found: an empty list."""
    out: list[tuple[EdgeTarget, str | None]] = []
    for t in find_edges(cfg.path, dirs):
        try:
            reload_edge(t, cfg)
            out.append((t, None))
        except (RuntimeError, OSError, tg_config.ConfigError) as e:
            out.append((t, str(e)))
    return out


def apply(args: argparse.Namespace, cfg: tg_config.Config) -> int:
    """Reload every edge found; prints one line each. Returns the exit status."""
    if args.no_apply:
        return 0
    done = apply_to(cfg, args.edge or [])
    if not done:
        own = edge_of(cfg.path)
        print(f"no running edge of {cfg.path} ({own.pid_file} with {own.edge_json}; "
              "--edge DIR for another): nothing reloaded", file=sys.stderr)
        return 0
    status = 0
    for t, error in done:
        if error is None:
            print(f"applied: {t.edge_json} (nginx reloaded)", file=sys.stderr)
        else:
            print(f"not applied: {error} (the file is as it is: reload that edge yourself)",
                  file=sys.stderr)
            status = 1
    return status
